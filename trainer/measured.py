"""The step as the run measured it after its warm-up, next to what the mode predicted of it.

    forecast = parallelizer.predict(model, micro_batches)        # None: the mode predicts nothing
    measured = MeasuredStep(step_us, steps, peak_bytes, ...)      # the trainer's timers, allocator, profiler
    forecast.report(measured.step_us / 1e6)                       # the log's "measured / predicted = R"
    step_scalars(measured, forecast)                              # TensorBoard: step_time/*, memory/*
    save_measured_page(forecast, measured, run_dir)               # plan.html: the Step section, both

A user sees where the cost model is wrong on the run's own page and beside the loss curve,
not only in one log line. The peak is the allocator's (`torch.cuda.max_memory_allocated`
over the timed steps), an observer independent of the plan's estimate; a CPU run has no
allocator statistic without a profiler (parallel.measure.AllocatorPeak) and leaves it out.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from parallel.auto.cost.timeline import MeasuredStep, StepTimeline
from parallel.auto.plan.html import save_html
from parallel.measure import AllocatorPeak, state_bytes

SPLIT_SCALARS = ("step_time/measured_compute_ms", "step_time/measured_comm_ms")
"""The scalars of the profiler's split, written when a later profiled step brings it."""
PEAK_SCALARS = ("memory/measured_peak_gib",)
"""The scalar of the CPU allocator's peak, written after the step `CpuPeakProbe` watched."""


class CpuPeakProbe:
    """A CPU run's allocator peak: torch has no `max_memory_allocated` on CPU, so one step
    after the timed ones runs under `AllocatorPeak` (the profiler's allocator events; that
    step is slower, and is not one the median is of). Bytes alive before the step (parameter
    shards, buffers, optimizer states: `state_bytes`) plus the step's own peak above them."""

    def __init__(self) -> None:
        self.done = False
        self._mem: Optional[AllocatorPeak] = None
        self._base = 0

    def watch(self, measured: Optional[MeasuredStep], device: Any, model: Any, optimizer: Any,
              profiling: bool) -> contextlib.AbstractContextManager:
        """The context to run the next step in: the allocator's window when this step is the
        one to watch (a CPU run, its step measured without a peak, not profiled already)."""
        if self.done or measured is None or measured.peak_bytes is not None or device.type != "cpu" or profiling:
            return contextlib.nullcontext()
        self.done = True
        optimizer.zero_grad(set_to_none=True)  # the step's own first act: the base holds no gradients
        self._base = state_bytes(model, optimizer)
        self._mem = AllocatorPeak(device)
        return self._mem

    def take(self) -> Optional[int]:
        """This rank's peak bytes of the watched step (once; None otherwise)."""
        mem, self._mem = self._mem, None
        if mem is None or mem.result is None:
            return None
        return self._base + mem.result.peak_bytes


@dataclass
class StepForecast:
    """A mode's prediction of one training step as the trainer runs it (all its micro-batches)."""

    step_us: float
    compute_us: float
    comm_us: float  # communicating (overlapped or not)
    peak_bytes: Optional[int]  # the plan's memory estimate per device (None: not estimated)
    words: str  # how it was predicted, for the log line
    plan: Any = None  # the plan whose page shows the step (None: no page)
    timeline: Optional[StepTimeline] = None  # the simulated step, drawn on the page
    note: str = ""  # what the mode learnt from the measured step (parallelizer.correct_prediction)

    def report(self, measured_s: float) -> str:
        """The log's comparison (tools/gpu_check_report.py reads its "measured / predicted = R")."""
        return (f"predicted {self.step_us / 1e3:,.1f} ms by the cost model ({self.words}); "
                f"measured / predicted = {measured_s * 1e6 / self.step_us:.2f}{self.note}")


def repeated(timeline: Optional[StepTimeline], n: int) -> Optional[StepTimeline]:
    """`timeline` run `n` times back to back: the step of `n` micro-batches, each one step
    graph (the step's one gradient reduction is not priced, as the log line says)."""
    if timeline is None or n == 1:
        return timeline
    shift = timeline.step_us
    events = [dataclasses.replace(e, start_us=e.start_us + k * shift, end_us=e.end_us + k * shift)
              for k in range(n) for e in timeline.events]
    phases = [(p, a + k * shift, b + k * shift) for k in range(n) for p, a, b in timeline.phases]
    return dataclasses.replace(timeline, step_us=shift * n, events=events, phases=phases,
                               source=f"{timeline.source}, {n} micro-batches")


def _ms(us: Optional[float]) -> Optional[float]:
    return None if us is None else us / 1e3


def step_scalars(measured: MeasuredStep, forecast: Optional[StepForecast]) -> dict[str, float]:
    """TensorBoard scalars of the step after its warm-up: measured and predicted side by side
    (ms, GiB); a number nobody gave is left out."""
    out = {"step_time/measured_ms": _ms(measured.step_us),
           "step_time/measured_compute_ms": _ms(measured.compute_us),
           "step_time/measured_comm_ms": _ms(measured.comm_us),
           "memory/measured_peak_gib": None if measured.peak_bytes is None else measured.peak_bytes / 2**30}
    if forecast is not None:
        out |= {"step_time/predicted_ms": _ms(forecast.step_us),
                "step_time/predicted_compute_ms": _ms(forecast.compute_us),
                "step_time/predicted_comm_ms": _ms(forecast.comm_us),
                "memory/predicted_peak_gib": None if forecast.peak_bytes is None else forecast.peak_bytes / 2**30}
    return {k: v for k, v in out.items() if v is not None}


def save_measured_page(forecast: Optional[StepForecast], measured: MeasuredStep, run_dir: Path) -> Optional[Path]:
    """plan.html again, its Step section showing the measured step beside the predicted one
    (rank 0; the page of a planned run only). The path written, or None."""
    if forecast is None or forecast.plan is None:
        return None
    path = Path(run_dir) / "plan.html"
    save_html(forecast.plan, path, timeline=forecast.timeline, measured=measured)
    return path


def describe(measured: MeasuredStep) -> str:
    """The measured step in words: its median, split and peak where known."""
    split = ""
    if measured.compute_us is not None and measured.comm_us is not None:
        split = (f", compute {measured.compute_us / 1e3:,.1f} ms and communication {measured.comm_us / 1e3:,.1f} ms "
                 f"({measured.source})")
    peak = f", allocator peak {measured.peak_bytes / 2**30:,.2f} GiB" if measured.peak_bytes is not None else ""
    return (f"measured {measured.step_us / 1e3:,.1f} ms (median of {measured.steps} steps after the warm-up"
            f"{split}{peak})")


__all__ = ["PEAK_SCALARS", "SPLIT_SCALARS", "CpuPeakProbe", "StepForecast", "describe", "repeated",
           "save_measured_page", "step_scalars"]
