"""Pipeline stages the planner plans: auto mode with a ``pp`` mesh axis.

    sub = stage_submesh(mesh)                                  # the mesh without its pp axis
    with stage_planning(part, sub, request, StageShape(...)) as autop:
        plan = autop.optimize_placement()
        stage_module = autop.apply_placement(plan)             # what a PipelineStage drives

A stage module (``parallel.recipes.pp.split_model``: some blocks, the embedding on the first,
norm and output head on the last) is traced as a stage (``trace_joint(stage=True)``): its
forward returns the hidden state (the last stage: the logits), and the gradient of a
hidden-state input is part of the joint graph, so the plan's backward returns what the
schedule sends to the stage before. Its input, its output and the output's gradient are
pinned to the data placement (Shard(0) on the data axes, Replicate on the others): every
rank of the stage holds its own rows, whole, so consecutive stages hand each other plain
local tensors, and what runs between them is the schedule's point-to-point traffic alone.
Inside the stage the planner is free (FSDP-, TP- or DDP-shaped placements per layer, as
without a pipeline); the schedule's loss is computed outside the plan, on the last stage's
local logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.auto.api import AutoParallel
from parallel.auto.config import resolve_planner
from parallel.auto.cost import HardwareProfile
from parallel.auto.cost.comm import axis_links
from parallel.auto.cost.memory import MemoryEstimate
from parallel.auto.plan import Plan
from parallel.auto.request import PlanRequest, data_degree, data_placements, default_memory_high, planner_regions
from parallel.auto.trace.gc_pause import collector_paused
from parallel.mesh import PP
from parallel.recipes.pp import fill_and_drain_us

__all__ = ["EMBEDDING", "StagePlanner", "StageShape", "balanced_stages", "p2p_us", "stage_inputs",
           "stage_planning", "stage_times_us", "pipeline_step_us", "stage_submesh", "unit_times"]


@dataclass(frozen=True)
class StageShape:
    """What a stage takes: token ids (``first``) or the previous stage's hidden state of
    ``dim`` features in ``dtype``; ``rows`` per data-parallel rank (one microbatch), ``seq_len``."""

    first: bool
    rows: int
    seq_len: int
    dim: int
    dtype: torch.dtype
    microbatches_held: int = 1  # saved activations the schedule holds on the stage (plan/pipeline.in_flight)


def stage_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh a stage is planned on: ``mesh`` without its pp axis (its other axes, in order)."""
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n != PP)
    if not names:
        raise ValueError(f"a pipeline needs a mesh axis besides {PP!r} to plan its stages on; "
                         f"got {mesh.mesh_dim_names}")
    return mesh[names] if len(names) > 1 else mesh[names[0]]


def stage_inputs(shape: StageShape, sub: DeviceMesh) -> tuple[torch.Tensor]:
    """The stage's global-shaped input on meta (one microbatch of every data-parallel rank)."""
    rows = shape.rows * data_degree(sub)
    if shape.first:
        return (torch.zeros((rows, shape.seq_len), dtype=torch.long, device="meta"),)
    return (torch.empty((rows, shape.seq_len, shape.dim), dtype=shape.dtype, device="meta", requires_grad=True),)


class StagePlanner(AutoParallel):
    """The planner of one pipeline stage: its memory estimate holds the saved activations of
    the ``microbatches_held`` microbatches the schedule keeps in flight on the stage (the
    others' ``saved_bytes`` on top of one microbatch's step), so the recomputation and the
    resharding it chooses fit the stage's peak under the schedule, not one microbatch's."""

    def __init__(self, *args: Any, microbatches_held: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, stage=True, **kwargs)
        self.microbatches_held = microbatches_held

    def estimate_memory(self, plan: Plan, options: Any = None) -> MemoryEstimate:
        est = super().estimate_memory(plan, options)
        extra = (self.microbatches_held - 1) * est.saved_bytes
        return dataclasses.replace(est, activations_bytes=est.activations_bytes + extra,
                                   peak_bytes=est.peak_bytes + extra, microbatches_held=self.microbatches_held)


@contextmanager
def stage_planning(part: nn.Module, sub: DeviceMesh, request: PlanRequest, shape: StageShape,
                   graph: Any = None) -> Iterator[AutoParallel]:
    """The entered planner of one stage on ``sub``: its input, output and the output's
    gradient pinned to the data placement; the parameter budget as ``request.planning`` sets it.
    `graph`: the stage's joint graph traced earlier for these global inputs (on any submesh)."""
    planner = resolve_planner(request.planner, math.prod(sub.shape), getattr(sub, "device_type", None))
    pl = data_placements(sub)
    with collector_paused(), StagePlanner(part, stage_inputs(shape, sub), sub, planner=planner,
                                          runtime=request.runtime, mp_policy=request.mp_policy,
                                          regions=planner_regions(part, cp=False),
                                          microbatches_held=shape.microbatches_held, graph=graph) as autop:
        autop.add_input_constraints([pl])
        autop.add_output_constraints([pl])
        for _, tangent in autop.graph.output_tangents:  # the gradient the schedule hands in: as the output
            autop.add_node_constraint(tangent.name, pl)
        if planner.memory_budget_low is None and planner.memory_budget_high is None:
            high = default_memory_high(sum(p.numel() for p in part.parameters()), autop.cost_model().hw)
            if high is not None:
                autop.add_parameter_memory_constraint(high=high)
        yield autop


def p2p_us(hw: HardwareProfile, mesh: DeviceMesh, nbytes: float) -> float:
    """One send of ``nbytes`` between neighbouring pp ranks: the pp axis's link (NVLink inside a
    node, the NIC across nodes), its latency and one hop, all the bytes at its bus bandwidth."""
    names = list(mesh.mesh_dim_names or ())
    link = axis_links(hw, tuple(mesh.shape), names)[names.index(PP)]
    return link.latency_us + link.hop_latency_us + nbytes / (link.bus_bandwidth_gbps["all_gather"] * 1e3)


# ------------------------------------------------------------------ the cut, by predicted time
EMBEDDING = -1
"""The unit index of the embedding; blocks are 0 .. L - 1, the head (norm, output) is L."""


def unit_times(plan: Plan, layers: Sequence[int], first: bool, last: bool, n_layers: int) -> dict[int, float]:
    """A stage plan's predicted time split over its units (the embedding, each block, the head):
    each node's compute by the module it runs in, scaled so the units sum to the plan's
    objective (its communication spread in proportion); the root module's few nodes (RoPE
    tables) go to the stage's first unit."""
    units = ([EMBEDDING] if first else []) + list(layers) + ([n_layers] if last else [])
    got = dict.fromkeys(units, 0.0)
    for node in plan.nodes.values():
        m = node.module
        if m.startswith("layers."):
            unit = int(m.split(".")[1])
        elif m.startswith("tok_embeddings"):
            unit = EMBEDDING
        elif m.startswith(("norm", "output")):
            unit = n_layers
        else:
            unit = units[0]
        got[unit if unit in got else units[0]] += node.compute_us
    total = sum(got.values())
    scale = plan.objective_us / total if total > 0 else 0.0
    return {u: t * scale for u, t in got.items()}


def balanced_stages(unit_us: Sequence[float], n_stages: int) -> tuple[tuple[int, ...], ...]:
    """The contiguous cut of the units (``unit_us``: the embedding, the L blocks, the head, in
    order) into ``n_stages`` stages, each at least one unit, whose slowest stage is fastest
    (the linear-partition recurrence); the block indices of each stage."""
    n = len(unit_us)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} units into {n_stages} stages")
    prefix = [0.0]
    for t in unit_us:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):  # the first j units in k stages
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    bounds, j = [], n
    for k in range(n_stages, 0, -1):
        bounds.append((cut[k][j], j))
        j = cut[k][j]
    n_layers = n - 2
    return tuple(tuple(u - 1 for u in range(a, b) if 0 < u <= n_layers) for a, b in reversed(bounds))


def stage_times_us(unit_us: Sequence[float], stages: Sequence[Sequence[int]]) -> list[float]:
    """Each stage's time under a cut (blocks per stage; the embedding with the first, the head with the last)."""
    times = []
    for i, blocks in enumerate(stages):
        t = sum(unit_us[b + 1] for b in blocks)
        t += unit_us[0] if i == 0 else 0.0
        t += unit_us[-1] if i == len(stages) - 1 else 0.0
        times.append(t)
    return times


def pipeline_step_us(stage_us: Sequence[float], rank_of: Sequence[int], pp: int, n_microbatches: int) -> float:
    """The step of a schedule over stages of these times (plan/pipeline.py's pricing): ``n``
    times the slowest rank's stages, plus the fill and drain (recipes.pp.fill_and_drain_us)."""
    ranks = [sum(t for t, r in zip(stage_us, rank_of) if r == rank) for rank in range(pp)]
    return n_microbatches * max(ranks) + fill_and_drain_us(stage_us, pp)
