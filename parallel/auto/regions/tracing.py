"""Regions while the planner traces: marked modules' forwards become their region's op."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from parallel.auto.regions.declaration import MARKER, RegionError, declared, region_of
from parallel.auto.regions.ops import call_region, tracing


@contextlib.contextmanager
def traced_regions(model: nn.Module, enabled: Sequence[str] = ()) -> Iterator[list[str]]:
    """While tracing: declared regions (decorated functions) become their ops, and so do the
    forwards of `model`'s modules marked with `local_map_region` = one of `enabled`. Yields
    the list the region names met are appended to (once each)."""
    met: list[str] = []
    patched = []
    regions = declared()
    for mod in model.modules():
        name = getattr(type(mod), MARKER, None)
        if name in enabled:
            if name not in regions:
                raise RegionError(f"region {name!r} (module {type(mod).__name__}) is not declared; "
                                  f"declare it with parallel.auto.regions.declare")
            mod.forward = functools.partial(call_region, name)
            patched.append(mod)
    prev = getattr(tracing, "active", False)
    tracing.active = True
    try:
        yield met
    finally:
        tracing.active = prev
        for mod in patched:
            del mod.forward


def marked_regions(model: nn.Module) -> tuple[str, ...]:
    """The declared regions `model`'s modules are marked with (`local_map_region`), in module
    order: what to pass as AutoParallel's `regions` to plan them as regions."""
    out: list[str] = []
    regions = declared()
    for mod in model.modules():
        name = getattr(type(mod), MARKER, None)
        if name in regions and name not in out:
            out.append(name)
    return tuple(out)


def regions_in(gm: Any) -> list[str]:
    """Names of the regions whose forward op appears in a traced graph (first-use order)."""
    out: list[str] = []
    for n in gm.graph.nodes:
        hit = region_of(n.target) if n.op == "call_function" else None
        if hit is not None and not hit[1] and hit[0].name not in out:
            out.append(hit[0].name)
    return out
