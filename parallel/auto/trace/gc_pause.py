"""Planning with Python's cyclic garbage collector paused.

Planning builds millions of long-lived objects (joint and step graphs, fake tensors,
candidate specs). Every few thousand allocations the collector runs, and every tenth of
those runs walks the older generation; its full walks grow with the heap, so on LLaMA 3 8B
on 4x8 they took ~1.6 s of a 10.4 s plan (measured with the collector off for the whole
job, scripts/bench_planner.py's 8b-4x8: 10.4 -> 8.8 s, the memory estimate 5.8 -> 4.8 s).
The planner's entry points pause it. Reference counting still frees what is not in a cycle;
the cycles made meanwhile (every dropped fx graph is one) wait for the collector's first run
after planning returns, which frees them in one go: 0.5-2.2 s on the bench's jobs, and peak
RSS 40-170 MiB higher than with the collector on.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic collections off inside (nested uses and a collector already off: no-op)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pauses_collector(fn: F) -> F:
    """`fn` runs with the collector paused (`collector_paused`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with collector_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
