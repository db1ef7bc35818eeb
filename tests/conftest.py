"""Every test process runs torch on one thread, and so does every process it starts (torchrun
ranks, the fork server of the multi-rank tests): the suite runs as two pytest-xdist workers
on two cores, each starting 2-8 ranks besides, and the tiny debug models run fastest on one
thread anyway (two OpenMP threads per process on a busy 2-core machine can be 10x slower).
The plan cache is a fresh folder per test process."""

import atexit
import os
import shutil
import tempfile

import torch

torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
# the plan cache of the tests is their own (and so is every rank's they start): a plan or a
# failure row cached by an earlier run, or by the user, must never answer a test
os.environ["AUTOTITAN_CACHE"] = tempfile.mkdtemp(prefix="autotitan-test-cache-")
atexit.register(shutil.rmtree, os.environ["AUTOTITAN_CACHE"], True)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with slow tests run first (stable order otherwise): xdist's `--dist loadscope`
    hands modules out in collection order, so the long multi-rank modules start early and
    the quick ones fill the end, instead of one worker finishing the trainer's slow modules
    (collected last) alone while the other idles."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)
