"""How much other work on the host slows this job's step: the factor a prediction made
with a quiet machine's figures is multiplied by, measured when the job starts.

A calibrated profile (`hardware = "auto"`) holds the machine's own speed: its compute
figures are the best of short repeated runs, so other work does not lower them, and they
are cached for later jobs that may find the machine quiet. But a job that starts beside
other work runs slower than that: with R ranks of T threads each on C cores and B cores'
worth of other work, the ranks get C / (R·T + B) of a core each when R·T + B > C (the
scheduler shares the cores evenly among runnable threads). The share is measured as the
host's busy cores over half a second while this job's ranks wait (/proc/stat), once per
job, and kept on the in-memory profile only (`HardwareProfile.contention`); the cached file
never holds it.
"""

from __future__ import annotations

import os

import torch

NOISE_CORES = 0.1
"""Busy cores below this are the host's own housekeeping, not other work."""


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def contention_factor(busy_share: float, ranks_on_host: int, threads_per_rank: int | None = None,
                      cores: int | None = None) -> float:
    """max(1, (R·T + B) / C): how much slower each rank's step runs than on a quiet host.

    `busy_share`: the share of the host's cores busy while this job's ranks waited (other
    work); `ranks_on_host`: this job's ranks on the host; `threads_per_rank`: each rank's
    intra-op threads (default: this process's)."""
    cores = cores or host_cores()
    threads = threads_per_rank if threads_per_rank is not None else torch.get_num_threads()
    other = max(0.0, busy_share * cores - NOISE_CORES)
    return max(1.0, (ranks_on_host * threads + other) / cores)


__all__ = ["NOISE_CORES", "contention_factor", "host_cores"]
