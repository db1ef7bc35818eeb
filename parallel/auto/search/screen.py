"""A big mesh search in two passes: every candidate screened cheaply, the leaders planned in full.

Planned with the job's whole request, one LLaMA 3 70B mesh takes minutes on this machine (the
memory estimate traces the runtime's step, the recomputation is fitted in rounds of solves); a
search over a hundred meshes and pipelines would take hours. The screen plans every candidate
with a cheaper request of the same cost model:

  * two shallow copies of the model planned instead of the model, their figures extrapolated to
    its depth (search/depth_scaling.py: 2 and 3 blocks for 126);
  * the MRF solver (approximate; the ILP only where the job names it), stopping after
    SCREEN_PATIENCE sweeps without a better plan, without re-solving the repeated blocks
    afterwards (on the 405B leaders neither changed a step); split-dim seeding stays (on 4-D meshes it is
    what keeps the problem small: 30 M strategies without it for 70B);
  * the recomputation fixed instead of chosen: every block recomputed when the job says "auto"
    (TorchTitan's choice at these sizes; the job's own mode otherwise);
  * no step-graph memory estimate: a candidate's memory is its model states (parameters,
    gradients, AdamW moments as its placements shard them), so the screen drops what cannot
    hold its states, not what runs out of activation memory.

HSDP meshes (a ``dp_replicate`` axis) are screened only as refinements of the leaders: each is
its FSDP parent (``dp_replicate x dp_shard`` merged into one ``dp_shard``) with the data
collectives split between nodes and within them. Of each of the screen's :data:`REFINE_TOP`
first, the one HSDP child whose shard group (the devices of one replica) is nearest a node is
planned: the layout HSDP is for, gathers within a node and reductions across nodes. On the
405B search on 512 GPUs, of the six children of each of three leaders that one was the fastest
every time (and none beat its parent), and the 46 four-axis HSDP meshes planned whole cost
more than the rest of the search together. The others are rows saying why they were not screened.

The ``verify`` best screened candidates, and TorchTitan's recipe shapes, are then planned with the
job's whole request (its solver, recomputation choice and memory estimate): what the trainer will
plan when it runs the pick. The ranking is the screen's (one cost model for every candidate);
the verified rows say what the full plans predict.
"""

from __future__ import annotations

import dataclasses
import math

from parallel.auto.request import PlanRequest
from parallel.mesh import DP_REPLICATE, DP_SHARD

from . import depth_scaling
from .mesh_space import MeshSpec
from .point import failure_row
from .spec import Point

REFINE_TOP = 4
"""Screened meshes without dp_replicate whose HSDP refinements are screened too."""
SCREEN_FROM_WORLD = 64
"""Worlds of at least this many devices are screened by default (a 70B job on 64 GPUs and up)."""
VERIFY = 3
"""Screened candidates planned again in full by default."""
SCREEN_PATIENCE = 15
"""TRW-S sweeps without a better plan before the screen's MRF stops (the planner's default: 60)."""


def screen_request(request: PlanRequest) -> PlanRequest:
    """The request a candidate is screened with (see the module docstring)."""
    planner = request.planner
    solver = planner.solver if planner.solver in ("ilp", "highs", "cbc") else "mrf"
    planner = planner.replace(solver=solver, memory_estimate=False, memory_limit_gib=None,
                              mrf_patience=min(planner.mrf_patience, SCREEN_PATIENCE), mrf_polish=False)
    ac = "full" if request.runtime.ac_mode == "auto" else request.runtime.ac_mode
    return dataclasses.replace(request, planner=planner, runtime=dataclasses.replace(request.runtime, ac_mode=ac))


def screened(point: Point) -> Point:
    """`point` with the screen's request, priced on shallow copies where it is deep enough."""
    point = dataclasses.replace(point, request=screen_request(point.request))
    return dataclasses.replace(point, depth_scaled=not point.reject and depth_scaling.scales(point))


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


def refinements(later: list[Point], ranked: list[dict], gpus_per_node: int) -> tuple[list[Point], list[Point]]:
    """(for each FSDP parent among the REFINE_TOP first of `ranked`, its HSDP point of `later`
    whose shard group is nearest a node of `gpus_per_node` (a larger one on a tie), the others)."""
    top = [r["mesh"] for r in ranked if r["rank"] != "-" and not r.get("pipeline")][:REFINE_TOP]
    children: dict[str, list[Point]] = {}
    for p in later:
        parent = fsdp_parent(p.mesh)
        if parent is not None and parent.label in top:
            children.setdefault(parent.label, []).append(p)
    chosen = [min(kids, key=lambda p: (abs(math.log(shard_group(p.mesh) / gpus_per_node)), -shard_group(p.mesh)))
              for kids in children.values()]
    return chosen, [p for p in later if p not in chosen]


def shard_group(spec: MeshSpec) -> int:
    """The devices of one data replica: the mesh without its dp_replicate axis."""
    return spec.world // spec.degree(DP_REPLICATE)


def unrefined_row(point: Point, chosen: list[Point]) -> dict:
    parent = fsdp_parent(point.mesh)
    label = parent.label if parent else "-"
    sibling = next((c.mesh.label for c in chosen if fsdp_parent(c.mesh) == parent), None)
    why = (f"its FSDP parent {label} is not among the screen's {REFINE_TOP} first" if sibling is None else
           f"of {label}'s HSDP meshes only {sibling} is screened (its shard group nearest a node)")
    return failure_row(point, f"not screened: {why}")
