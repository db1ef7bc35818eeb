"""TorchTitan's published recipe shapes, priced beside the mesh search's picks.

An expert's answer to "which mesh?" for the LLaMA 3 family, as TorchTitan publishes it: FSDP
for 8B, FSDP·TP8 for 70B, FSDP8·TP8·PP8 with Interleaved 1F1B for 405B (tp within a node, pp
between nodes). Each shape is planned as a point of the search (same request, global batch,
hardware, cache) with the recipe's placements as constraints: FSDP on the data axes, Megatron
column/row projections on tp (search/point.py PRESETS), the rest the planner's. So the search's
pick and the recipe are priced by one cost model, and `compare_line` says by how much the pick
is predicted faster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from parallel.auto.request import BaseJob
from parallel.mesh import DP_SHARD, PP, TP

from .mesh_space import MeshSpec
from .pipeline_points import PipelineChoice
from .spec import Point, with_choice, with_global_batch

TP_DEGREE = 8
"""TorchTitan's tensor-parallel degree for 70B and 405B: one node of eight GPUs."""


@dataclass(frozen=True)
class RecipeShape:
    """A hand recipe's mesh: its name, mesh, schedule (pipelined) and placements preset."""

    name: str
    mesh: MeshSpec
    preset: str
    schedule: str = ""  # a pipelined shape's schedule; its microbatches are one sample each


def recipe_shapes(model: str, flavor: str, world: int) -> list[RecipeShape]:
    """The published shapes of the job's model on `world` devices (FSDP alone for a model
    TorchTitan publishes no other shape for); a shape the world cannot hold is left out."""
    out = [RecipeShape("FSDP", MeshSpec((world,), (DP_SHARD,)), "fsdp")]
    if model != "llama3" or flavor not in ("70B", "405B") or world % TP_DEGREE:
        return out
    if world > TP_DEGREE:
        out.append(RecipeShape(f"FSDP·TP{TP_DEGREE}", MeshSpec((world // TP_DEGREE, TP_DEGREE), (DP_SHARD, TP)),
                               "fsdp_tp"))
    pp, dp = 8, world // (8 * TP_DEGREE)
    if flavor == "405B" and dp >= 1 and world % (pp * TP_DEGREE) == 0:
        names, shape = (PP, DP_SHARD, TP) if dp > 1 else (PP, TP), (pp, dp, TP_DEGREE) if dp > 1 else (pp, TP_DEGREE)
        out.append(RecipeShape(f"FSDP{dp}·TP{TP_DEGREE}·PP{pp} Interleaved1F1B", MeshSpec(shape, names),
                               "fsdp_tp", schedule="Interleaved1F1B"))
    return out


def recipe_points(job: BaseJob, world: int, shapes: list[RecipeShape], base: Point, global_batch: int,
                  start: int) -> list[Point]:
    """A point per shape, like `base` (the job's point of the search) but on the shape's mesh
    and preset, at `global_batch`; a pipelined shape runs one sample a microbatch."""
    out = []
    for i, shape in enumerate(shapes):
        p = with_global_batch(dataclasses.replace(base, index=start + i, mesh=shape.mesh, preset=shape.preset,
                                                  mesh_auto=False), global_batch)
        if shape.schedule and not p.reject:
            per_rank = global_batch // p.data_degree
            p = with_choice(p, PipelineChoice(shape.schedule, per_rank), per_rank)
        out.append(p)
    return out


def compare_line(best: dict | None, recipes: list[tuple[RecipeShape, dict]]) -> str:
    """One line per recipe shape: its predicted step and the search's pick against it."""
    lines = []
    for shape, row in recipes:
        if row.get("status") != "ok" or not row.get("step_ms"):
            lines.append(f"{shape.name} ({shape.mesh.label}): {row.get('status')}")
        elif best is None:
            lines.append(f"{shape.name} ({shape.mesh.label}): {row['step_ms']:,.1f} ms per step")
        else:
            lines.append(f"{shape.name} ({shape.mesh.label}): {row['step_ms']:,.1f} ms per step; the pick "
                         f"({best['mesh']}{', ' + best['pipeline'] if best.get('pipeline') else ''}) is predicted "
                         f"{row['step_ms'] / best['step_ms']:.2f}x faster")
    return "\n".join(lines)
