"""One 2-rank gloo run shared by test_profiling.py and test_no_deprecations.py (made once per
test process): the hardware calibration's collectives, then a manual (FSDP2) and an auto-mode
job of a tiny LLaMA, 3 steps each with `[profiling]` on (step 2 traced), every warning
recorded. Gloo shows no collective on 1 rank, hence 2."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import warnings
from pathlib import Path

from dist_utils import run_distributed

TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.hardware", "h100",
        "--checkpoint.enable", "false"]
PROFILE = ["--profiling.enable_profiling", "true", "--profiling.profile_freq", "2"]
MODES = ("manual", "auto")


def _recorded(caught) -> list[tuple[str, str, str]]:
    return [(w.category.__name__, str(w.message), f"{w.filename}:{w.lineno}") for w in caught]


def _worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from parallel.auto.cost import calibrate
    from trainer.config import load_config
    from trainer.trainer import Trainer

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in calibrate.COLLECTIVE_KINDS:  # what hardware = "auto" measures
            calibrate._collective_fn(kind, 64 * world, None, None)()
        calibrate.measure_stream_latency(k=2, reps=1)
        dist.barrier()
    out["calibration"] = _recorded(caught)
    for mode in MODES:
        extra = ["--parallelism.hardware", "cpu"] if mode == "auto" else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config("llama3_debug", [*TINY, *PROFILE, "--training.steps", "3", "--parallelism.mode", mode,
                                               *extra, "--job.dump_folder", tmp, "--job.name", mode], world_size=world)
            out[mode + "_steps"] = sorted(Trainer(cfg).train())
        out[mode] = _recorded(caught)
    return out


@functools.lru_cache(maxsize=None)
def two_rank_profiled_jobs() -> tuple[Path, tuple[dict, ...]]:
    """(the jobs' dump folder, each rank's result); run once per test process."""
    tmp = tempfile.mkdtemp(prefix="autotitan-profiled-jobs-")
    atexit.register(shutil.rmtree, tmp, True)
    return Path(tmp), tuple(run_distributed(_worker, 2, tmp, timeout=300))
