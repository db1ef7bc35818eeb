"""Timing helpers of the calibration (cost/calibrate.py, cost/calibrate_ops.py): short calls of a
function, each timed alone, and the best of them, measured again while other work on the
host spreads them too widely."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def _sync() -> None:
    """Wait for the accelerator's queued work (timing GPU kernels needs it; no-op on CPU)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def _times(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of `reps` calls of `fn` (after `warmup` calls), each timed alone."""
    for _ in range(warmup):
        fn()
    _sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return ts


SPREAD_LIMIT = 0.5
"""How much slower than the best of its short measurements a figure's median may be before
it is measured again (median / best - 1): wider, other work took the cores meanwhile."""
ROUNDS = 3


def _best_time(fn: Callable[[], object], reps: int = 9) -> tuple[float, float]:
    """(best seconds, spread) of short repeated calls of `fn`, measured again (up to `ROUNDS`
    rounds) while the spread is over `SPREAD_LIMIT`.

    Why the best and not the median: other work on the host only ever slows a call down, so
    the fastest of many short calls is the machine's own speed, while a median over a busy
    window rates it at whatever share the other work left (a profile measured with 51 % of
    the cores taken rated a run 2.4x slow, and was cached and planned with)."""
    best, spread = float("inf"), float("inf")
    for _ in range(ROUNDS):
        ts = sorted(_times(fn, reps))
        best = min(best, ts[0])
        spread = min(spread, ts[len(ts) // 2] / ts[0] - 1)
        if spread <= SPREAD_LIMIT:
            break
    return best, spread
