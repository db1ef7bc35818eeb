"""The run folder (``<job.dump_folder>/<job.name>``): the folders a config names stay inside
it, and one job at a time uses it.

Confinement: a restart deletes the trainer's own unfinished folders in the checkpoint folder
and prunes old checkpoints, so a checkpoint folder that resolves somewhere else (an absolute
``checkpoint.folder``, a ``job.name`` of ``../../etc``) would let a job delete files outside
its run. `check_folders` refuses such a config before anything runs: every folder key must
stay inside the run folder, and the run folder inside ``job.dump_folder``.

Lock: two jobs with the same ``job.name`` would share a checkpoint folder: each could resume
the other's checkpoints or delete its temporary folders. Rank 0 holds an ``flock`` on
``<run folder>/.lock`` while the job runs (the kernel drops it when the process dies, so a
killed job never leaves a stale lock) and writes who holds it into the file; a second job on
the folder stops with one line naming the holder (after waiting `LOCK_WAIT_S` for a holder
that is going away: a restart right after a crash).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from .errors import ConfigError

LOCK = ".lock"
LOCK_WAIT_S = 10.0
"""How long a job waits for the run folder's lock before it says who holds it."""
FOLDER_KEYS = (("checkpoint", "folder"), ("profiling", "save_traces_folder"),
               ("profiling", "save_memory_snapshot_folder"))
"""Folder settings that are relative to the run folder."""

__all__ = ["FOLDER_KEYS", "LOCK", "RunFolderLock", "check_folders", "inside"]


def inside(parent: Path, child: Path) -> bool:
    """`child` is `parent` or below it, after resolving ``..`` and symbolic links."""
    parent, child = parent.resolve(), child.resolve()
    return child == parent or parent in child.parents


def check_folders(cfg: Any) -> None:
    """One ConfigError for the first folder setting that leaves its place: ``job.name`` must name
    a folder inside ``job.dump_folder``; the keys in `FOLDER_KEYS` folders inside the run folder."""
    dump = Path(cfg.job.dump_folder)
    run = dump / cfg.job.name
    if Path(cfg.job.name).is_absolute() or not inside(dump, run) or run.resolve() == dump.resolve():
        raise ConfigError(f"{cfg.source}: 'job.name' = {cfg.job.name!r}: the run folder {run} must be a folder inside "
                          f"job.dump_folder ({dump}); give a plain name (and set job.dump_folder for another place)")
    for section, key in FOLDER_KEYS:
        value = getattr(getattr(cfg, section), key)
        if Path(value).is_absolute() or not inside(run, run / value) or (run / value).resolve() == run.resolve():
            default = getattr(type(getattr(cfg, section))(), key)
            raise ConfigError(f"{cfg.source}: '{section}.{key}' = {value!r}: it must name a folder inside the run "
                              f"folder {run} (the job creates and deletes files there); give a relative name such "
                              f"as {default!r}, and set job.dump_folder to move the whole run elsewhere")


_HELD: dict[str, list] = {}
"""Resolved lock path -> [open file, holders in this process]: the lock is per process (a test
that builds several trainers on one folder in one process holds it once)."""


def _drop_in_child() -> None:
    """A forked child (a data-loader worker, a compile worker) closes its copies of the lock's file:
    the lock belongs to the job's process, and must go when that process dies, not live on in an
    orphaned child."""
    for f, _ in _HELD.values():
        f.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def _holder_line() -> str:
    argv = " ".join(sys.argv)[:200]
    when = datetime.datetime.now().isoformat(timespec="seconds")
    return f"pid {os.getpid()} on {socket.gethostname()} since {when} ({argv})"


def _acquire(path: Path) -> Optional[str]:
    """Take the lock in this process (None), or the holder's line when another process has it."""
    key = str(path.resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        return None
    f = open(path, "a+")  # noqa: SIM115 - held open while the job runs
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return holder
    f.seek(0)
    f.truncate()
    f.write(_holder_line() + "\n")
    f.flush()
    _HELD[key] = [f, 1]
    return None


def _acquire_waiting(path: Path, wait_s: float) -> Optional[str]:
    """`_acquire`, retried for `wait_s` seconds: a job restarted right after a crash may find the
    old processes still exiting (their lock goes with them)."""
    deadline = time.monotonic() + wait_s
    while (holder := _acquire(path)) is not None and time.monotonic() < deadline:
        time.sleep(0.25)
    return holder


def _release(path: Path) -> None:
    key = str(path.resolve())
    entry = _HELD.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _HELD[key]
        fcntl.flock(entry[0].fileno(), fcntl.LOCK_UN)
        entry[0].close()


class RunFolderLock:
    """The run folder's lock, taken by rank 0 and agreed by every rank (a broadcast): a job whose
    folder another job holds stops on every rank with one ConfigError naming the holder. Call
    `acquire` on every rank; `release` when the job ends (idempotent)."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / LOCK
        self.rank = rank
        self.held = False

    def acquire(self, wait_s: float = LOCK_WAIT_S) -> None:
        holder = _acquire_waiting(self.path, wait_s) if self.rank == 0 else None
        if dist.is_available() and dist.is_initialized():
            box = [holder]
            dist.broadcast_object_list(box, src=0)
            holder = box[0]
        if holder is not None:
            raise ConfigError(f"run folder {self.path.parent} is in use by another job: {holder}; wait for it to end, "
                              "or give this job its own folder (--job.name or --job.dump_folder)")
        self.held = self.rank == 0

    def release(self) -> None:
        if self.held:
            self.held = False
            _release(self.path)
