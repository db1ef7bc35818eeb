"""Where autotitan keeps what it measured or planned on this host: one root for all of it.

    $AUTOTITAN_CACHE                      if set (the test suite sets a fresh folder per process)
    $XDG_CACHE_HOME/autotitan             else, if XDG_CACHE_HOME is set
    ~/.cache/autotitan                    else

Under it, `hardware/` holds the measured profiles of `hardware = "auto"` and `plans/` the
planned sweep points. One root, so that whoever isolates one (a test run, a CI job) isolates
both: a profile measured while the test suite loaded the machine must never be what a later
job on this host plans with.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The folder autotitan's caches live under (read from the environment on every call)."""
    own = os.environ.get("AUTOTITAN_CACHE")
    if own:
        return Path(own)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "autotitan"


__all__ = ["cache_root"]
