"""A big mesh search in two passes: every candidate screened cheaply, the leaders planned in full.

Planned with the job's whole request, one LLaMA 3 70B mesh takes minutes on this machine (the
memory estimate traces the runtime's step, the recomputation is fitted in rounds of solves); a
search over a hundred meshes and pipelines would take hours. The screen plans every candidate
with a cheaper request of the same cost model:

  * the MRF solver (approximate; the ILP only where the job names it); split-dim seeding stays
    (on 4-D meshes it is what keeps the problem small: 30 M strategies without it for 70B);
  * the recomputation fixed instead of chosen: every block recomputed when the job says "auto"
    (TorchTitan's choice at these sizes; the job's own mode otherwise);
  * no step-graph memory estimate: a candidate's memory is its model states (parameters,
    gradients, AdamW moments as its placements shard them), so the screen drops what cannot
    hold its states, not what runs out of activation memory.

HSDP meshes (a ``dp_replicate`` axis) are screened only as refinements of the leaders: each is
its FSDP parent (``dp_replicate x dp_shard`` merged into one ``dp_shard``) with the data
collectives split between nodes and within them, and it is planned when that parent is among
the screen's :data:`REFINE_TOP` first (without this, the 46 four-axis HSDP meshes of a 512-GPU
search cost more than the rest together); the others are rows saying so.

The ``verify`` best screened candidates, and TorchTitan's recipe shapes, are then planned with the
job's whole request (its solver, recomputation choice and memory estimate): what the trainer will
plan when it runs the pick. The ranking is the screen's (one cost model for every candidate);
the verified rows say what the full plans predict.
"""

from __future__ import annotations

import dataclasses

from parallel.auto.request import PlanRequest
from parallel.mesh import DP_REPLICATE, DP_SHARD

from .mesh_space import MeshSpec
from .point import failure_row
from .spec import Point

REFINE_TOP = 4
"""Screened meshes without dp_replicate whose HSDP refinements are screened too."""
SCREEN_FROM_WORLD = 64
"""Worlds of at least this many devices are screened by default (a 70B job on 64 GPUs and up)."""
VERIFY = 3
"""Screened candidates planned again in full by default."""


def screen_request(request: PlanRequest) -> PlanRequest:
    """The request a candidate is screened with (see the module docstring)."""
    planner = request.planner
    solver = planner.solver if planner.solver in ("ilp", "highs", "cbc") else "mrf"
    planner = planner.replace(solver=solver, memory_estimate=False, memory_limit_gib=None)
    ac = "full" if request.runtime.ac_mode == "auto" else request.runtime.ac_mode
    return dataclasses.replace(request, planner=planner, runtime=dataclasses.replace(request.runtime, ac_mode=ac))


def screened(point: Point) -> Point:
    return dataclasses.replace(point, request=screen_request(point.request))


def leaders(points: list[Point], ranked: list[dict], k: int) -> list[Point]:
    """The points of the `k` best ranked rows that fit, in rank order (`ranked`: rank_rows' rows)."""
    by_index = {p.index: p for p in points}
    return [by_index[r["index"]] for r in ranked if r["rank"] != "-"][:k]


def fsdp_parent(spec: MeshSpec) -> MeshSpec | None:
    """The mesh with `spec`'s dp_replicate folded into dp_shard (None: `spec` has no dp_replicate)."""
    r = spec.degree(DP_REPLICATE)
    if r == 1:
        return None
    kept = [(s * r if n == DP_SHARD else s, n) for s, n in zip(spec.shape, spec.names) if n != DP_REPLICATE]
    return MeshSpec(tuple(s for s, _ in kept), tuple(n for _, n in kept))


def refinements(later: list[Point], ranked: list[dict]) -> tuple[list[Point], list[Point]]:
    """(the HSDP points of `later` whose FSDP parent is among the REFINE_TOP first of `ranked`,
    the others)."""
    top = [r["mesh"] for r in ranked if r["rank"] != "-" and not r.get("pipeline")][:REFINE_TOP]
    chosen = [p for p in later if fsdp_parent(p.mesh) is not None and fsdp_parent(p.mesh).label in top]
    return chosen, [p for p in later if p not in chosen]


def unrefined_row(point: Point) -> dict:
    parent = fsdp_parent(point.mesh)
    return failure_row(point, f"not screened: its FSDP parent {parent.label if parent else '-'} is not among the "
                              f"screen's {REFINE_TOP} first")
