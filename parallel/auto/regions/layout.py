"""What a region's local function is told at run time, and the checks on what it returns.

`make_layout` writes the layout string a region op gets (per mesh axis the chosen option,
this rank's coordinate and the axis's process-group name, and the declared output
placements); `context_from` reads it back as a `RegionContext`; `check_outputs` checks each
output's local shape against the declared placements (`RegionError` names region, axis,
placements).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from parallel.auto.candidates.placements import local_shape, parse_placements, placement_str
from parallel.auto.regions.declaration import NAMESPACE, Option, Region, RegionError, declared


@dataclass(frozen=True)
class AxisLayout:
    """One mesh axis as a region's local function sees it."""

    name: str
    size: int
    rank: int  # this rank's coordinate on the axis
    group: str  # process-group name (functional collectives take it)
    option: str


@dataclass(frozen=True)
class RegionContext:
    """What the local function knows: the chosen option per mesh axis, and the order of the
    sequence the inputs follow (`load_balance`: the load-balanced CP order for that many
    ranks, 1 = natural order; see parallel/recipes/cp.py)."""

    region: str
    axes: tuple[AxisLayout, ...] = ()
    load_balance: int = 1

    def axes_with(self, option: str) -> tuple[AxisLayout, ...]:
        """The mesh axes (in mesh order) this rank runs `option` on."""
        return tuple(a for a in self.axes if a.option == option)


def axis_options(r: Region, backward: bool, spec: Any) -> list[Option]:
    """The option each mesh axis runs, read off a strategy's input placements."""
    ins = [s.placements for s in spec.input_specs]
    ins = ins[r.n_outputs:] if backward else ins
    chosen = []
    for i in range(len(ins[0]) if ins else 0):
        axis = tuple(p[i] for p in ins)
        hit = next((o for o in r.all_options() if tuple(o.inputs) == axis), None)
        if hit is None:
            raise RegionError(f"region {r.name!r}: mesh axis {i} places the inputs {axis}, which no declared "
                              "option does")
        chosen.append(hit)
    return chosen


def make_layout(r: Region, backward: bool, spec: Any, mesh: Any, out_shapes: Sequence[tuple[int, ...]],
                load_balance: int = 1) -> str:
    """The layout string a region op gets at run time (see the module docstring)."""
    names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
    opts = axis_options(r, backward, spec)
    outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    return json.dumps({
        "region": r.name, "lb": load_balance,
        "axes": [[names[i], mesh.size(i), mesh.get_local_rank(i), mesh.get_group(i).group_name, o.name]
                 for i, o in enumerate(opts)],
        "outs": [[list(s), placement_str(o.placements)] for s, o in zip(out_shapes, outs)],
    })


def option_names(target: str, input_placements: Sequence[str]) -> list[str] | None:
    """Per mesh axis, the option a planned region node runs (`target` as a plan writes it,
    e.g. "autotitan.moe_dispatch.default"; its inputs' placements); None if not a region."""
    parts = target.split(".")
    name = parts[1].removesuffix("_bwd") if len(parts) > 1 else ""
    regions = declared()
    if parts[0] != NAMESPACE or name not in regions:
        return None
    r, pls = regions[name], [parse_placements(p) for p in input_placements]
    pls = pls[r.n_outputs:] if parts[1].endswith("_bwd") else pls
    out = []
    for i in range(len(pls[0]) if pls else 0):
        axis = tuple(p[i] for p in pls)
        out.append(next((o.name for o in r.all_options() if tuple(o.inputs) == axis), "?"))
    return out


def context_from(layout: str) -> RegionContext:
    d = json.loads(layout)
    return RegionContext(d["region"], tuple(AxisLayout(*a) for a in d["axes"]), int(d.get("lb", 1)))


def _explain(shape: tuple, declared: tuple, got: tuple, mesh_shape: tuple) -> tuple[int, str] | None:
    """(mesh axis, placement) that would give `got` if only that axis's placement differed."""
    for i in range(len(declared)):
        for alt in [Replicate(), *[Shard(d) for d in range(len(shape))]]:
            trial = declared[:i] + (alt,) + declared[i + 1:]
            if alt != declared[i] and local_shape(shape, trial, mesh_shape) == got:
                return i, placement_str((alt,))[1:-1]
    return None


def check_outputs(name: str, outs: Sequence[torch.Tensor], layout: str) -> None:
    """Each output's local shape must be what its declared placements give (first step)."""
    d = json.loads(layout)
    axes, mesh_shape = d["axes"], tuple(a[1] for a in d["axes"])
    for k, (o, (shape, pl)) in enumerate(zip(outs, d["outs"])):
        declared = parse_placements(pl)
        want, got = local_shape(tuple(shape), declared, mesh_shape), tuple(o.shape)
        if got == want:
            continue
        why = _explain(tuple(shape), declared, got, mesh_shape)
        if why is not None:
            i, actual = why
            raise RegionError(
                f"local_map region {name!r}: output {k} on mesh axis {i} ({axes[i][0]!r}, option {axes[i][4]!r}) "
                f"is declared {placement_str((declared[i],))[1:-1]} but the local function returned a "
                f"{actual} shard (local shape {got}, declared {want} of global {tuple(shape)}); make the "
                "option's output placement match what the local function returns")
        raise RegionError(f"local_map region {name!r}: output {k} has local shape {got}, but its declared "
                          f"placements {pl} give {want} (global {tuple(shape)}); fix the option or the local "
                          "function")
