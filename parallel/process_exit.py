"""Leaving a planner process quickly.

A process that planned holds millions of small objects (joint and step graphs, fake
tensors, candidates, caches). The garbage collection at interpreter shutdown walks every
one of them, touching pages the kernel may have reclaimed meanwhile: after planning a
3B-shaped LLaMA on 1x8 while a 4-rank job shared the machine, exit took 2.2 s, 0.24 s
with the objects frozen; on an idle machine 0.3 s either way (scripts/bench_planner.py's
job). Freezing moves them out of the collector's reach; reference counting still frees
them and atexit handlers still run.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable


def exit_with(main: Callable[[], int | None]) -> None:
    """Run `main`, then exit with its return code, skipping the collector's final walk."""
    try:
        rc = main()
    finally:
        gc.freeze()
    sys.exit(rc)


def freezes_at_exit(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A program's `main(argv=None)` that, run as the program (argv None: its process ends right
    after), freezes what it leaves on return, as `exit_with` does; given an argv list (a test
    calling it in its own process) it is `main` unchanged."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        if argv is not None:
            return main(argv)
        try:
            return main(None)
        finally:
            gc.freeze()

    return run
