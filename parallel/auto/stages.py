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

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.auto.api import AutoParallel
from parallel.auto.config import resolve_planner
from parallel.auto.cost import HardwareProfile
from parallel.auto.cost.comm import axis_links
from parallel.auto.request import PlanRequest, data_degree, data_placements, default_memory_high, planner_regions
from parallel.auto.trace.gc_pause import collector_paused
from parallel.mesh import PP

__all__ = ["StageShape", "p2p_us", "stage_inputs", "stage_planning", "stage_submesh"]


@dataclass(frozen=True)
class StageShape:
    """What a stage takes: token ids (``first``) or the previous stage's hidden state of
    ``dim`` features in ``dtype``; ``rows`` per data-parallel rank (one microbatch), ``seq_len``."""

    first: bool
    rows: int
    seq_len: int
    dim: int
    dtype: torch.dtype


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


@contextmanager
def stage_planning(part: nn.Module, sub: DeviceMesh, request: PlanRequest, shape: StageShape
                   ) -> Iterator[AutoParallel]:
    """The entered AutoParallel of one stage on ``sub``: its input, output and the output's
    gradient pinned to the data placement; the parameter budget as ``request.planning`` sets it."""
    planner = resolve_planner(request.planner, math.prod(sub.shape), getattr(sub, "device_type", None))
    pl = data_placements(sub)
    with collector_paused(), AutoParallel(part, stage_inputs(shape, sub), sub, planner=planner,
                                          runtime=request.runtime, mp_policy=request.mp_policy,
                                          regions=planner_regions(part, cp=False), stage=True) as autop:
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
