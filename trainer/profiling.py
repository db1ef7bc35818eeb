"""Profiler traces and memory snapshots of chosen training steps (`[profiling]`).

    with StepProfiler(cfg, run_dir, rank, device, start_step=step) as prof:
        while ...:
            trainer.next_step()
            prof.step()

Every `profile_freq`-th step (steps N x profile_freq, counted from the job's start, so a
resumed job profiles the same steps) is recorded by torch.profiler after a few warm-up steps
and written per rank as a Chrome trace (chrome://tracing, Perfetto):
`<run_dir>/<save_traces_folder>/iteration_N/rank{R}_trace.json`, the collectives included
(gloo's and NCCL's own events). With `enable_memory_snapshot`, at the same steps: on CUDA
the caching allocator's history (`rank{R}_memory_snapshot.pickle`, pytorch.org/memory_viz);
on CPU, which has no allocator history, the profiler records memory (profile_memory) and
writes its per-op memory table (`rank{R}_memory.txt`), the trace carrying the memory
events. (The profiler's `export_memory_timeline` is deprecated in torch 2.13 and not used.)

Each recorded step is also split into compute and communication (`step_split`, taken by the
trainer with `take_split`: the measured step beside the predicted one, trainer/measured.py).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from parallel import _torch as T
from parallel.measure import PHASE_PREFIX

from .config import ConfigError, JobConfig
from .config_checks import check_writable
from .device import CUDA

WARMUP_STEPS = 3
"""Steps the profiler runs before the recorded one (fewer when profile_freq is smaller)."""
EXPECTED_WARNINGS = ("Incomplete profiler cycle", "Warning: Profiler clears events at the end of each cycle")
"""torch's warnings about what this module means to do: a job ending inside a warm-up (nothing
was recorded, nothing is lost), and a trace of one step only (acc_events off)."""
COLLECTIVE_PREFIXES = ("gloo:", "c10d::", "_c10d_functional::", "nccl:", "record_param_comms")
"""Profiler event names of the collectives on CPU (the backend's own events, the c10d ops); a
CUDA kernel is one when its name says nccl."""


def check_profiling(cfg: JobConfig) -> None:
    """One config error naming the key for settings the profiler cannot use."""
    p = cfg.profiling
    if (p.enable_profiling or p.enable_memory_snapshot) and p.profile_freq < 1:
        raise ConfigError(f"{cfg.source}: 'profiling.profile_freq' = {p.profile_freq!r}: must be >= 1 "
                          "(the profiled steps are its multiples)")
    for key, on in (("save_traces_folder", p.enable_profiling),
                    ("save_memory_snapshot_folder", p.enable_memory_snapshot)):
        if on and not getattr(p, key).strip():
            raise ConfigError(f"{cfg.source}: 'profiling.{key}' = '': name a folder (under the run folder)")


@contextlib.contextmanager
def _expected_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        for message in EXPECTED_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        yield


class StepProfiler:
    """The `[profiling]` section at work in the training loop (inactive when both switches are off)."""

    def __init__(self, cfg: JobConfig, run_dir: Path, rank: int, device: torch.device, start_step: int = 0):
        check_profiling(cfg)
        p = cfg.profiling
        self.rank, self.freq = rank, p.profile_freq
        self.trace_dir = Path(run_dir) / p.save_traces_folder if p.enable_profiling else None
        self.memory_dir = Path(run_dir) / p.save_memory_snapshot_folder if p.enable_memory_snapshot else None
        self.cuda = device.type == CUDA
        for key, folder in (("save_traces_folder", self.trace_dir), ("save_memory_snapshot_folder", self.memory_dir)):
            if folder is not None:
                check_writable(cfg.source, f"profiling.{key}", getattr(p, key), folder, rank)
        self.step_num = start_step
        self._prof: Optional[profile] = None
        self._closing = False
        self._split: Optional[tuple[int, float, float]] = None
        # the torch profiler runs for traces, and on CPU for the memory table
        self._profiler_on = self.trace_dir is not None or (self.memory_dir is not None and not self.cuda)

    def __enter__(self) -> StepProfiler:
        if self.memory_dir is not None and self.cuda:
            T.record_cuda_memory_history(True)
        if self._profiler_on:
            warmup = min(WARMUP_STEPS, self.freq - 1)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(
                activities=activities, record_shapes=True,
                profile_memory=self.memory_dir is not None and not self.cuda,
                schedule=schedule(wait=self.freq - 1 - warmup, warmup=warmup, active=1),
                on_trace_ready=self._trace_ready)
            with _expected_warnings():
                self._prof.__enter__()
            self._prof.step_num = self.step_num  # the schedule counts the job's steps
        return self

    def step(self) -> None:
        """After each training step: the profiler's schedule moves on; a CUDA snapshot is dumped
        at a profiled step."""
        self.step_num += 1
        if self._prof is not None:
            with _expected_warnings():
                self._prof.step()
        if self.memory_dir is not None and self.cuda and self.step_num % self.freq == 0:
            T.dump_cuda_memory_snapshot(str(self._folder(self.memory_dir, self.step_num)
                                            / f"rank{self.rank}_memory_snapshot.pickle"))

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            # what the profiler started after the last step is no step of the job: not written
            self._closing = True
            with _expected_warnings():
                self._prof.__exit__(*exc)
            self._prof = None
        if self.memory_dir is not None and self.cuda:
            T.record_cuda_memory_history(False)

    def take_split(self) -> Optional[tuple[int, float, float]]:
        """(step, compute µs, communication µs) of the step recorded since the last call, else None."""
        split, self._split = self._split, None
        return split

    @staticmethod
    def _folder(root: Path, step: int) -> Path:
        folder = root / f"iteration_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _trace_ready(self, prof: profile) -> None:
        """The recorded step, written once it is over (prof.step_num: that step's number)."""
        if self._closing:
            return
        self._split = (prof.step_num, *step_split(prof, self.cuda))
        if self.trace_dir is not None:
            prof.export_chrome_trace(str(self._folder(self.trace_dir, prof.step_num) / f"rank{self.rank}_trace.json"))
        if self.memory_dir is not None:
            table = prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=40)
            (self._folder(self.memory_dir, prof.step_num) / f"rank{self.rank}_memory.txt").write_text(table + "\n")


def step_split(prof: profile, cuda: bool) -> tuple[float, float]:
    """(compute µs, communication µs) of a recorded step. On CUDA: the kernels' device time,
    NCCL's against the rest. On CPU: from the step's first phase range to its last (forward
    and backward, clip, optimizer: what the trainer's step timer holds, less the batch's
    sharding), the collectives' own CPU time (self time: a nested event counts once) against
    the rest, which is what a step with no device does when it is not communicating."""
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
        comm = sum(e.self_device_time_total for e in kernels if "nccl" in e.name.lower())
        return sum(e.self_device_time_total for e in kernels) - comm, comm
    spans = [e.time_range for e in events if e.name.startswith(PHASE_PREFIX)]
    spans = spans or [e.time_range for e in events if e.name.startswith("ProfilerStep")]
    if not spans:
        return 0.0, 0.0
    lo, hi = min(r.start for r in spans), max(r.end for r in spans)
    comm = sum(e.self_cpu_time_total for e in events
               if e.name.startswith(COLLECTIVE_PREFIXES) and lo <= e.time_range.start < hi)
    return max(hi - lo - comm, 0.0), comm
