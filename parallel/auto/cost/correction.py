"""A calibrated profile corrected by what a job measured on this machine.

`hardware = "auto"` prices plans with figures measured in a few seconds (cost/calibrate.py);
what those figures miss (the dispatch of a real step's ops, attention and optimizer kernels
slower than the matmul roof, ...) shows as a measured step time far from the predicted one.
After its warm-up the trainer compares the two; when they differ by more than 25 % the
measured ratio is written into the cached profile's `[correction]` table, with where it
came from, and the next plan's step simulation multiplies by it:

    [correction]
    step_time_ratio = 1.38
    job = "llama3_debug_auto"   config = "..."   when = "2025-..."   measured_ms = ...

Only a profile this host measured and cached is changed (a named profile, h100 ..., holds
published figures, never a job's), only by rank 0, and against a prediction that counts the
host's other work as the job started (cost/contention.py: the load's share is not the model's). A
recalibration writes a fresh profile: the correction goes with the old one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from parallel.cache_dir import cache_root

from .hardware import HardwareProfile, load_hardware

log = logging.getLogger("parallel.auto.cost")

BAND = (0.8, 1.25)
"""measured / predicted within this band: the prediction holds, nothing is recorded."""


def run_delay_s() -> float:
    """Seconds this thread has waited for a core so far (Linux schedstat; 0 where unknown).

    Why: on a shared host a step is slower by the time its ranks sat runnable while other
    work held the cores; that is the load's, not the cost model's, and is taken out of the
    measured step before it corrects the profile."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def step_time_ratio(hw: HardwareProfile) -> float:
    """The measured correction the step prediction is multiplied by (1: none)."""
    corr = getattr(hw, "correction", None) or {}
    return float(corr.get("step_time_ratio", 1.0))


def correctable(hw: HardwareProfile) -> Path | None:
    """The cached file of a profile this host measured (`hardware = "auto"`), else None."""
    if hw.name != "auto":
        return None
    path = Path(hw.source)
    root = (cache_root() / "hardware").resolve()
    try:
        inside = path.resolve().parent == root
    except OSError:
        return None
    return path if inside and path.is_file() else None


def record_correction(hw: HardwareProfile, measured_us: float, predicted_us: float,
                      provenance: dict[str, Any]) -> str | None:
    """Write measured / uncorrected-predicted into `hw`'s cached file when `predicted_us` (the
    corrected prediction) is off by more than `BAND`; the one line to log, None when nothing
    was to be written. `provenance`: job, config, world size, ... (kept beside the ratio)."""
    from .calibrate import save_profile  # calibrate imports torch.distributed: only when writing

    ratio = measured_us / predicted_us
    if BAND[0] <= ratio <= BAND[1]:
        return None
    path = correctable(hw)
    if path is None:
        return None
    raw_us = predicted_us / step_time_ratio(hw)
    new = measured_us / raw_us
    current = load_hardware(path)
    corr = {"step_time_ratio": new, **provenance, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "measured_ms": measured_us / 1e3, "predicted_ms": raw_us / 1e3}
    save_profile(current.replace(correction=corr, source=str(path)), path)
    return (f"cost model: measured / predicted = {ratio:.2f} is outside {BAND[0]}-{BAND[1]}: recorded "
            f"step_time_ratio = {new:.2f} in {path} ([correction]); the next plan on this machine is priced "
            f"with it (measure the machine again to drop it: --parallelism.recalibrate true)")
