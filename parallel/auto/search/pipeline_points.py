"""Pipelined meshes in the mesh search: a pp degree, a schedule and a microbatch count.

A pipelined candidate is a mesh ``pp=P,<inner>`` (pp the outermost axis: its stages' groups are
whole nodes once the inner mesh fills one, as TorchTitan lays it out), one of
:data:`PP_SCHEDULES` and a microbatch count, at the job's fixed global batch: each data rank of
the inner mesh holds ``global / data degree`` samples a step, cut into the microbatches (no
gradient accumulation beside them). Its price is the pipeline's plan
(parallel/auto/stage_plans.py): every kind of stage planned on the inner mesh with its
microbatches in flight, the step as ``n x slowest rank + fill and drain`` with the p2p sends,
the peak as the largest stage's. The search keeps the recipe's balanced cut (the trainer recuts
by predicted unit times when it runs the job). Inner meshes: ``dp_shard`` and ``tp`` only (cp
and an HSDP replicate axis are left to the meshes without a pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.mesh import DP_SHARD, PP, TP
from parallel.recipes.pp import PipelineLayout, RecipeError, pipeline_layout
from parallel.settings import PipelineSettings

from .mesh_space import MeshSearchError, MeshSpec, enumerate_meshes

PP_DEGREES = (2, 4, 8, 16)
"""Pipeline degrees the search tries (those dividing the world, at most a stage per two units)."""
PP_SCHEDULES = ("1F1B", "Interleaved1F1B")
"""The schedules priced: one stage a rank, and two a rank (looped). GPipe holds every
microbatch (1F1B's step at more memory) and the zero-bubble schedules are priced as 1F1B."""
MICROBATCHES_PER_STAGE = (1, 2)
"""Microbatch counts tried, as multiples of the pp degree (more: a smaller bubble, smaller matmuls)."""
INNER_AXES = (DP_SHARD, TP)


@dataclass(frozen=True)
class PipelineChoice:
    """How a pipelined point runs: torch's schedule and the microbatches of a step."""

    schedule: str
    n_microbatches: int

    @property
    def label(self) -> str:
        return f"{self.schedule} x{self.n_microbatches}"


def pipeline_meshes(world: int, gpus_per_node: int, n_layers: int, degrees: tuple[int, ...] = PP_DEGREES
                    ) -> list[MeshSpec]:
    """``pp=P`` + every inner mesh of ``world / P`` devices over dp_shard and tp, for each P of
    `degrees` that divides the world and leaves at least two units (blocks, the embedding and the
    head) a stage."""
    out = []
    for pp in degrees:
        if world % pp or world // pp < 1 or n_layers + 2 < 2 * pp:
            continue
        try:
            inner = enumerate_meshes(world // pp, gpus_per_node, axes=INNER_AXES)
        except MeshSearchError:
            continue
        out += [MeshSpec((pp, *s.shape), (PP, *s.names)) for s in inner]
    return out


def stage_mesh(spec: MeshSpec) -> MeshSpec:
    """The inner mesh a pipelined point's stages are planned on (its mesh without pp)."""
    kept = [(s, n) for s, n in zip(spec.shape, spec.names) if n != PP] or [(1, DP_SHARD)]
    return MeshSpec(tuple(s for s, _ in kept), tuple(n for _, n in kept))


def choices(pp: int, n_layers: int, per_rank: int) -> list[PipelineChoice]:
    """The schedules and microbatch counts a data rank's ``per_rank`` samples allow (each a
    layout the pp recipe accepts: torch's schedules' own rules)."""
    out = []
    for schedule in PP_SCHEDULES:
        for k in MICROBATCHES_PER_STAGE:
            n = k * pp
            if n <= per_rank and per_rank % n == 0 and layout(schedule, pp, n_layers, n, per_rank) is not None:
                out.append(PipelineChoice(schedule, n))
    return out


def layout(schedule: str, pp: int, n_layers: int, n_microbatches: int, per_rank: int) -> PipelineLayout | None:
    """The pp recipe's layout of the choice (the balanced cut), None when it cannot run."""
    settings = PipelineSettings(pipeline_parallel_schedule=schedule,
                                pipeline_parallel_microbatch_size=per_rank // n_microbatches)
    try:
        return pipeline_layout(n_layers, pp, settings, per_rank)
    except RecipeError:
        return None


def pipeline_settings(row: dict) -> dict:
    """The `[parallelism]` pipeline keys of a pipelined row's schedule and microbatch rows
    (empty for a row without pp)."""
    if not row.get("pipeline"):
        return {}
    return {"pipeline_parallel_schedule": row["schedule"], "pipeline_parallel_microbatch_size": int(row["local_batch"])}
