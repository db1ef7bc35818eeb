"""The private torch APIs that read memory: CUDA's allocator history and the CPU allocator's
own running total as the profiler reports it. Part of the torch adapter (`parallel/_torch.py`
re-exports these; the layering test allows private torch APIs in these two files only)."""

from __future__ import annotations

from typing import Any

import torch


def record_cuda_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) CUDA's caching allocator recording every alloc/free with its stack, for
    `dump_cuda_memory_snapshot` (trainer/profiling.py; torch's API for it is private)."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """The allocator's recorded history as a pickle (pytorch.org/memory_viz reads it)."""
    torch.cuda.memory._dump_snapshot(path)


def cpu_allocator_report_flag() -> Any | None:
    """libc10's `FLAGS_caffe2_report_cpu_memory_usage` as a ctypes bool (None where this build
    does not export it): on, the CPU allocator keeps its own running total over every thread's
    allocations and frees and hands it to the profiler with each memory event."""
    import ctypes
    from pathlib import Path

    try:
        lib = next((Path(torch.__file__).parent / "lib").glob("libc10.*"))
        return ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError, StopIteration):
        return None


def profiler_allocations(prof: Any, device: str) -> list[tuple[int, int, int]]:
    """(time ns, bytes (negative: a free), the allocator's total after it) of a finished
    `torch.profiler.profile(profile_memory=True)`'s allocation events on `device`, in time
    order (from the profiler's event tree, whose allocation records carry the total)."""
    from torch._C._profiler import _EventType

    out, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == device:
                out.append((e.start_time_ns, f.alloc_size, f.total_allocated))
        else:
            todo.extend(e.children)
    return sorted(out)
