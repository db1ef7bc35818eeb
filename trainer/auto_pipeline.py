"""Auto mode with a pipeline (`[parallelism] mode = "auto"`, `pipeline_parallel_degree` > 1).

    pipeline, pipeline_plan = auto_pipeline(model, mesh, job_config, device)

The cut and the schedule are the pp recipe's (`parallel.recipes.pp.pipeline_layout`: the
`pipeline_parallel_*` keys, checked the same way). Each stage this rank runs is planned on
the stage's submesh, the mesh without its pp axis (`parallel.auto.stages`): the first rank of
the stage's ranks solves and hands the plan to the others, every rank applies it. The stage
modules run under torch.distributed.pipelining's own schedule (`parallel.recipes.pp.Pipeline`).
Global rank 0 collects every stage's plan into the pipeline's plan (its summary in the log,
`pipeline_plan.json` and each stage's `plan.stage<i>.json` in the run folder).

Loss: the schedule computes each microbatch's mean cross-entropy on the last stage's local
logits; a stage plan's backward sums the gradients of its data-parallel ranks (a Partial
reduced), so every microbatch's backward starts from its loss divided by the data degree
too: the summed gradient is that of the mean over the global batch, as without a pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models import cross_entropy_loss, transformer_blocks
from parallel.auto.plan import Plan
from parallel.auto.plan.pipeline import PipelinePlan, StagePlan
from parallel.auto.request import data_degree
from parallel.auto.stages import StageShape, p2p_us, stage_planning, stage_submesh
from parallel.mesh import PP, flatten_axes
from parallel.precision import dtype_of
from parallel.recipes.pp import Pipeline, join_stages, pipeline_layout, split_model

from .auto_mode import plan_request, solve_in_group
from .config import JobConfig

logger = logging.getLogger("autotitan")

STAGE_RANKS = "pp_stage_ranks"  # the ranks of one set of stages: the mesh's non-pp axes, flattened


def _hidden_dtype(job_config: JobConfig) -> torch.dtype:
    """The dtype stages hand each other: the compute dtype (mixed precision's parameter dtype)."""
    t = job_config.training
    return dtype_of(t.mixed_precision_param if t.mixed_precision_param != "float32" else t.dtype)


def auto_pipeline(model: nn.Module, mesh: DeviceMesh, job_config: JobConfig, device: torch.device
                  ) -> tuple[Pipeline, PipelinePlan | None]:
    """This rank's stages of `model`, each planned and applied, under the job's schedule; the
    pipeline's plan on global rank 0 (None elsewhere). RecipeError for a layout that cannot work."""
    t, pp_mesh = job_config.training, mesh[PP]
    layout = pipeline_layout(len(transformer_blocks(model)), pp_mesh.size(), job_config.parallelism.pipeline,
                             t.local_batch_size)
    ids = layout.stages_of(pp_mesh.get_local_rank())
    sub = stage_submesh(mesh)
    group = flatten_axes(mesh, [n for n in mesh.mesh_dim_names if n != PP], STAGE_RANKS).get_group()
    rows = t.local_batch_size // layout.n_microbatches
    request = plan_request(job_config, sub, local_batch_size=rows, seq_len=t.seq_len)
    request = dataclasses.replace(request, runtime=dataclasses.replace(request.runtime, micro_batches=1))
    dim = model.tok_embeddings.weight.shape[1]
    last = layout.n_stages - 1
    parts, plans, hw = [], {}, None
    for i in ids:
        part = split_model(model, layout.stages[i], i == 0, i == last)
        shape = StageShape(first=i == 0, rows=rows, seq_len=t.seq_len, dim=dim, dtype=_hidden_dtype(job_config))
        with stage_planning(part, sub, request, shape) as autop:
            plans[i] = solve_in_group(autop, group)
            parts.append(autop.apply_placement(plans[i]))
            hw = autop.cost_model().hw
    union = join_stages(model, parts, ids, layout)
    pipeline = Pipeline(union, parts, ids, layout, pp_mesh, device, cross_entropy_loss)
    nbytes = rows * t.seq_len * dim * torch.empty((), dtype=_hidden_dtype(job_config)).element_size()
    return pipeline, _gather_plan(layout, plans, pp_mesh, p2p_us(hw, mesh, nbytes))


def _gather_plan(layout: Any, plans: dict[int, Plan], pp_mesh: DeviceMesh, p2p: float) -> PipelinePlan | None:
    """Every stage's plan from the pp rank that holds it (the ranks of one data-parallel
    coordinate); the pipeline's plan on global rank 0."""
    mine = {i: p.to_json() for i, p in plans.items()}
    gathered: list[Any] = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, mine, group=pp_mesh.get_group())
    if dist.get_rank() != 0:
        return None
    stages = [StagePlan(i, layout.stages[i], layout.rank_of(i), Plan.from_json(d))
              for part in gathered for i, d in part.items()]
    return PipelinePlan(layout.schedule, layout.pp, layout.n_microbatches, sorted(stages, key=lambda s: s.index),
                        p2p_us=p2p)


def save_pipeline_plan(plan: PipelinePlan, run_dir: Path) -> None:
    """The pipeline's plan and each stage's plan (a Plan file each: replayable, `plan.py` reads it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    plan.save(str(run_dir / "pipeline_plan.json"))
    for s in plan.stages:
        s.plan.save(str(run_dir / f"plan.stage{s.index}.json"))
    logger.info("pipeline plan saved to %s (stages: plan.stage<i>.json)", run_dir / "pipeline_plan.json")


def gradient_scale(mesh: DeviceMesh) -> float:
    """What each microbatch's loss is multiplied by before its backward, beyond 1 / microbatches:
    1 / the data degree of the stage's submesh (the plan sums its data ranks' gradients)."""
    return 1.0 / data_degree(stage_submesh(mesh))
