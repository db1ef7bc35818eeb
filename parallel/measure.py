"""Measuring tools for tests, benchmarks and the dry run: what a run allocates, independent
of the planner's memory estimate.

    with AllocatorPeak() as mem:         # the allocator: every allocation, any op, any thread
        trainer.train_step(x, y)
    print(mem.result.peak_bytes, mem.result.phase, mem.result.op)

    with MemoryTracker() as mem:         # torch's dispatcher: the storages of op outputs
        loss = model(x).sum(); loss.backward()
    print(mem.peak)

`AllocatorPeak` is the observer to check the estimate against: the estimate walks the same
FX graph a `MemoryTracker` sees, so the tracker shares its blind spots (kernel scratch,
collective buffers, allocations outside dispatched ops); the allocator does not.
On CPU torch 2.13 has no allocator statistic of its own (`torch.cpu` offers no
`max_memory_allocated`; the C10 flag `caffe2_report_cpu_memory_usage` alone only logs), but the
CPU allocator reports every allocation and free to the profiler when `profile_memory=True`:
the `[memory]` events (bytes, time, thread), from which the running total and its peak are
rebuilt here. Frees of blocks allocated before the window are not reported (the allocator
does not know their size), so the figure is the peak of bytes allocated inside the window
above what was alive at its start. The reporting is per thread, though: a thread the
profiler does not follow frees unseen, and gloo's worker threads often let go of a
collective's buffers last (an all-gather's input, a reduce-scatter's copy of its input),
after the part of their work the profiler follows: 3-5 of 40 all-gather + reduce-scatter
pairs on 2 gloo ranks left a block counted alive to the window's end, and the events'
running sum put the same HF GPT-2 step (scripts/bench_foreign_memory.py) at 195-219 MiB.
So the window also turns on libc10's flag `caffe2_report_cpu_memory_usage` (ctypes):
with it the CPU allocator keeps its own total over every thread's allocations and frees,
each reported event carries it, and that total is the figure (195.0 MiB every step; where
the flag cannot be found, the events' running sum is). On CUDA the caching allocator's own
`max_memory_allocated` (after `reset_peak_memory_stats`) is the figure; the profiler still
locates the peak. The phase of the peak is the innermost `phase(...)` range around it
(the trainer marks its step: forward_backward, clip, optimizer); inside forward_backward,
whose one step graph has no marker of its own, the backward begins at the first op named
`*backward*` (any case: the loss's nll_loss_backward, autograd's engine ranges), where the
estimate's walk splits it too (at the loss).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from parallel import _torch as T

__all__ = ["AllocatorPeak", "MemoryTracker", "PeakMeasurement", "phase", "rss_bytes", "state_bytes"]

PHASE_PREFIX = "autotitan.phase."
_PHASES = {"forward_backward": "forward", "clip": "clip", "optimizer": "optimizer"}


def phase(name: str) -> contextlib.AbstractContextManager:
    """A named range of a training step (forward_backward, clip, optimizer) that
    `AllocatorPeak` attributes its peak to; a profiler range, ~1 µs when nothing profiles."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


def _proc_status(key: str) -> int:
    """A byte figure of /proc/self/status (VmRSS, VmHWM); 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _proc_status("VmRSS")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the storages alive between steps: parameter shards (a DTensor's local
    tensor), buffers, optimizer states; each storage once."""
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()] + list(module.buffers())
    for st in (optimizer.state.values() if optimizer is not None else ()):
        tensors += [v.to_local() if isinstance(v, DTensor) else v for v in st.values() if torch.is_tensor(v)]
    seen = {T.storage_id(t): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"}
    return sum(seen.values())


@dataclass
class PeakMeasurement:
    """What one measured window allocated, seen by the allocator."""

    device: str  # "cpu" or "cuda"
    source: str  # which allocator figure the peak is
    peak_bytes: int  # bytes allocated in the window and alive at its worst moment
    end_bytes: int  # ... and still alive when the window closed
    phase: str  # the step phase at the peak: forward, backward, clip, optimizer ("" outside any)
    op: str  # the innermost op running when the peak allocation was made
    rss_start: int  # resident set size when the window opened
    rss_peak: int  # the kernel's peak RSS during the window (0: not available)
    rss_end: int
    events: int  # allocator events seen

    def to_json(self) -> dict:
        return asdict(self)


class AllocatorPeak:
    """The allocator's peak over a window (see the module docstring); `result` after exit."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device).type
        self.result: PeakMeasurement | None = None
        self._prof: Any = None

    def __enter__(self) -> "AllocatorPeak":
        self._rss_reset = _reset_peak_rss()
        self._rss_start = rss_bytes()
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._flag = T.cpu_allocator_report_flag() if self.device == "cpu" else None
        if self._flag is not None:
            self._flag_was, self._flag.value = self._flag.value, True
        self._prof = torch.profiler.profile(activities=acts, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self._prof.__exit__(*exc)
        if self._flag is not None:
            self._flag.value = self._flag_was
        rss_end = rss_bytes()
        events = self._prof.profiler.kineto_results.events()
        allocs = T.profiler_allocations(self._prof, self.device)
        peak, end, at, count = _running_peak(allocs, own_total=self._flag is not None)
        p_phase, op = _locate(events, at) if at is not None else ("", "")
        source = "profiler [memory] events of the CPU allocator" + (", its own total" if self._flag is not None else "")
        if self.device == "cuda":
            peak = torch.cuda.max_memory_allocated() - self._cuda_start
            end = torch.cuda.memory_allocated() - self._cuda_start
            source = "torch.cuda.max_memory_allocated (caching allocator)"
        self.result = PeakMeasurement(
            device=self.device, source=source, peak_bytes=peak, end_bytes=end, phase=p_phase, op=op,
            rss_start=self._rss_start, rss_peak=_proc_status("VmHWM") if self._rss_reset else 0, rss_end=rss_end,
            events=count)


def _running_peak(allocs: list[tuple[int, int, int]], own_total: bool) -> tuple[int, int, int | None, int]:
    """(peak of the bytes alive above the window's start, its end value, the time of the
    peak's allocation, count) of `T.profiler_allocations`: by the allocator's own total (`own_total`:
    every thread's frees in it) or by the events' running sum."""
    base = allocs[0][2] - allocs[0][1] if allocs else 0
    total, peak, at = 0, 0, None
    for t, nbytes, after in allocs:
        total = after - base if own_total else total + nbytes
        if total > peak:
            peak, at = total, t
    return peak, total, at, len(allocs)


def _locate(events: list, t: int) -> tuple[str, str]:
    """(phase, innermost op) at time `t`: the phase ranges are `phase()`'s; inside
    forward_backward the first `*backward*` op starts the backward."""
    ops = [e for e in events if e.name() != "[memory]" and e.device_type().name == "CPU" and not e.is_async()]
    around = [e for e in ops if e.start_ns() <= t <= e.end_ns()]
    marks = [e for e in around if e.name().startswith(PHASE_PREFIX)]
    name = ""
    if marks:
        mark = max(marks, key=lambda e: e.start_ns())
        name = _PHASES.get(mark.name()[len(PHASE_PREFIX):], mark.name()[len(PHASE_PREFIX):])
        if name == "forward":
            bwd = [e for e in ops if mark.start_ns() <= e.start_ns() <= t and "backward" in e.name().lower()
                   and not e.name().startswith(PHASE_PREFIX)]
            name = "backward" if bwd else "forward"
    inner = [e for e in around if not e.name().startswith(PHASE_PREFIX)]
    op = max(inner, key=lambda e: e.start_ns()).name() if inner else ""
    return name, op


class MemoryTracker(T.TorchDispatchMode):
    """Live bytes of tensor storages created by ops run under this mode, and their peak.

    Works on real, meta and fake tensors (it reads ``untyped_storage().nbytes()``; a
    DTensor counts its local shard); views share their base's storage and are counted
    once; a storage is released when its last reference dies. Storages resized in place
    (FSDP2 frees and re-allocates its unsharded parameters with ``storage.resize_``,
    which no dispatch mode sees; they come from ``empty``-like ops) are re-measured at
    every op, so the peak is exact at op granularity. Tensors that existed before
    entering (parameters, inputs) are not counted once passed to ``exclude`` (otherwise
    their storage counts from the first op that takes a view of them).
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, counted bytes]
        self._watch: dict[int, list] = {}  # resizable storages (outputs of empty-like ops)
        self.current = 0
        self.peak = 0

    def _add(self, t: torch.Tensor, watch: bool) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # storage-less subclasses
            return
        key = id(st)
        if key in self._live:
            return

        def _free(_ref, key=key, self_ref=weakref.ref(self)):
            me = self_ref()
            if me is not None:
                entry = me._live.pop(key, None)
                me._watch.pop(key, None)
                if entry is not None:
                    me.current -= entry[1]

        n = st.nbytes()
        entry = [weakref.ref(st, _free), n]
        self._live[key] = entry
        if watch:
            self._watch[key] = entry
        self.current += n

    def exclude(self, tensors: Any) -> None:
        """Storages that exist before the measured region (parameters, optimizer states,
        inputs): views and in-place ops on them under this mode are not new memory."""
        for t in T.tree_flatten(tensors)[0]:
            if isinstance(t, DTensor):
                t = t.to_local()
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self._live.setdefault(id(st), [weakref.ref(st), 0])

    def _refresh(self) -> None:
        """Re-measure the storages that can be resized in place (FSDP2's buffers come
        from ``empty``-like ops); compute outputs keep their size for life."""
        for entry in self._watch.values():
            st = entry[0]()
            if st is not None:
                n = st.nbytes()
                if n != entry[1]:
                    self.current += n - entry[1]
                    entry[1] = n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops + collectives first
        out = func(*args, **(kwargs or {}))
        watch = "empty" in T.op_name(func)
        for t in T.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, watch)
        self._refresh()
        if self.current > self.peak:
            self.peak = self.current
        return out
