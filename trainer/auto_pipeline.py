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
from parallel.auto.plan.pipeline_html import save_pipeline_html
from parallel.auto.request import data_degree
from parallel.auto.stage_plans import PipelineStages, SolveKinds, faster_cut
from parallel.auto.stages import stage_submesh
from parallel.mesh import PP, flatten_axes
from parallel.precision import dtype_of
from parallel.recipes.pp import Pipeline, join_stages, pipeline_layout

from .auto_mode import plan_request, solve_in_group
from .config import JobConfig
from .measured import StepForecast

logger = logging.getLogger("autotitan")

STAGE_RANKS = "pp_stage_ranks"  # the ranks of one set of stages: the mesh's non-pp axes, flattened


def _hidden_dtype(job_config: JobConfig) -> torch.dtype:
    """The dtype stages hand each other: the compute dtype (mixed precision's parameter dtype)."""
    t = job_config.training
    return dtype_of(t.mixed_precision_param if t.mixed_precision_param != "float32" else t.dtype)


def auto_pipeline(model: nn.Module, mesh: DeviceMesh, job_config: JobConfig, device: torch.device
                  ) -> tuple[Pipeline, PipelinePlan]:
    """This rank's stages of `model`, each planned and applied, under the job's schedule; the
    pipeline's plan. RecipeError for a layout that cannot work.

    The cut: the recipe's (equal units) is planned first; unless the job fixed the split
    (`pipeline_parallel_split_points`, `pipeline_parallel_layers_per_stage`), the stages' plans
    price every unit (stages.unit_times) and the cut whose slowest stage is fastest is planned
    instead when it is predicted faster by more than `RECUT_GAIN`."""
    t, pp_mesh, par = job_config.training, mesh[PP], job_config.parallelism
    settings = par.pipeline
    layout = pipeline_layout(len(transformer_blocks(model)), pp_mesh.size(), settings, t.local_batch_size)
    saved = PipelinePlan.load(par.plan_file) if par.plan_file else None  # a bad file fails before tracing
    if saved is not None:  # its cut and its stages' plans, replayed
        saved.check_layout(layout.schedule, layout.pp, layout.n_microbatches, layout.n_stages, par.plan_file)
        layout = dataclasses.replace(layout, stages=tuple(s.layers for s in saved.stages))
    job = _StageJob(model, mesh, job_config, layout)
    parts, plans = job.plan_and_apply(layout, saved)
    if saved is None and not _fixed_split(settings):
        gathered: list[Any] = [None] * pp_mesh.size()  # every unit's time, from the rank that planned it
        dist.all_gather_object(gathered, job.unit_times(layout, plans), group=pp_mesh.get_group())
        cut = faster_cut(layout, {u: us for part in gathered for u, us in part.items()}, job.n_layers)
        if cut is not None:
            layout = dataclasses.replace(layout, stages=cut)
            parts, plans = job.plan_and_apply(layout)
    ids = layout.stages_of(pp_mesh.get_local_rank())
    pipeline = Pipeline(join_stages(model, parts, ids, layout), parts, ids, layout, pp_mesh, device,
                        cross_entropy_loss)
    return pipeline, _gather_plan(layout, plans, pp_mesh, job.p2p_us())


def plan_pipeline(model: nn.Module, mesh: DeviceMesh, job_config: JobConfig,
                  solve_kinds: SolveKinds | None = None) -> PipelinePlan:
    """The pipeline's plan made for the dry run's fake world: every kind of stage solved once
    (on this process, or by `solve_kinds`: trainer/stage_processes.py), the cut by their
    predicted unit times, as `auto_pipeline` cuts."""
    settings = job_config.parallelism.pipeline
    layout = pipeline_layout(len(transformer_blocks(model)), mesh[PP].size(), settings,
                             job_config.training.local_batch_size)
    return stage_job(model, mesh, job_config, layout, solve_kinds).plan(layout, recut=not _fixed_split(settings))


def stage_job(model: nn.Module, mesh: DeviceMesh, job_config: JobConfig, layout: Any,
              solve_kinds: SolveKinds | None = None) -> PipelineStages:
    """The stages of `job_config`'s pipeline on `mesh` (one microbatch's request, the compute dtype)."""
    return _StageJob(model, mesh, job_config, layout, solve_kinds)


def _fixed_split(settings: Any) -> bool:
    return bool(settings.pipeline_parallel_split_points or settings.pipeline_parallel_layers_per_stage)


class _StageJob(PipelineStages):
    """This rank's stages: the pipeline's stages of one microbatch's request, and the group
    of ranks that shares a stage's plan."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, job_config: JobConfig, layout: Any,
                 solve_kinds: SolveKinds | None = None) -> None:
        t = job_config.training
        sub = stage_submesh(mesh)
        request = plan_request(job_config, sub, local_batch_size=t.local_batch_size // layout.n_microbatches,
                               seq_len=t.seq_len)
        super().__init__(model, mesh, request, _hidden_dtype(job_config), solve_kinds=solve_kinds)
        self.cfg, self.pp_mesh = job_config, mesh[PP]
        self.group = flatten_axes(mesh, [n for n in mesh.mesh_dim_names if n != PP], STAGE_RANKS).get_group()

    def plan_and_apply(self, layout: Any, saved: PipelinePlan | None = None
                       ) -> tuple[list[nn.Module], dict[int, Plan]]:
        """This rank's stage modules of `layout`, planned (shared in the stage's group), or taken
        from `saved` (checked against the stage: model, submesh, input shapes), and applied."""
        parts, plans = [], {}
        for i in layout.stages_of(self.pp_mesh.get_local_rank()):
            part = self.part(layout, i)
            with self.planner(layout, i, part) as autop:
                if saved is not None:
                    plans[i] = saved.stages[i].plan
                    plans[i].check_compatible(model=part, mesh=self.sub, source=f"{self.cfg.parallelism.plan_file}, "
                                              f"stage {i}", input_shapes=[[list(x.shape), str(x.dtype)]
                                                                          for x in autop.input_fn])
                else:
                    plans[i] = solve_in_group(autop, self.group)
                parts.append(autop.apply_placement(plans[i]))
        return parts, plans


def _gather_plan(layout: Any, plans: dict[int, Plan], pp_mesh: DeviceMesh, p2p: float) -> PipelinePlan:
    """The pipeline's plan, on every rank: every stage's plan from the pp rank that holds it
    (the ranks of one data-parallel coordinate)."""
    mine = {i: p.to_json() for i, p in plans.items()}
    gathered: list[Any] = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, mine, group=pp_mesh.get_group())
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
    save_pipeline_html(plan, run_dir)
    logger.info("pipeline picture (stages, the schedule simulated) saved to %s", run_dir / "pipeline_plan.html")


def gradient_scale(mesh: DeviceMesh) -> float:
    """What each microbatch's loss is multiplied by before its backward, beyond 1 / microbatches:
    1 / the data degree of the stage's submesh (the plan sums its data ranks' gradients)."""
    return 1.0 / data_degree(stage_submesh(mesh))


def pipeline_forecast(plan: PipelinePlan, micro_batches: int = 1) -> StepForecast:
    """The pipeline's predicted step (`micro_batches` schedule steps of gradient accumulation)
    for the trainer's measured-step line: its compute and communication are the slowest pp
    rank's stages', once per microbatch; the peak, the largest stage's with its microbatches in flight."""
    slowest = max(range(plan.pp), key=plan.rank_us)
    mine = [s for s in plan.stages if s.rank == slowest]
    compute = plan.n_microbatches * sum(s.plan.compute_us for s in mine)
    comm = plan.n_microbatches * sum(sum(s.plan.comm_us.values()) for s in mine)
    peaks = [s.peak_bytes(plan.in_flight(s.index)) for s in plan.stages]
    return StepForecast(step_us=plan.step_us * micro_batches, compute_us=compute * micro_batches,
                        comm_us=comm * micro_batches, peak_bytes=int(max(peaks)) if None not in peaks else None,
                        words=f"{plan.schedule} over {len(plan.stages)} planned stages, bubble "
                              f"{plan.bubble_us / 1e3:,.1f} ms, slowest pp rank {slowest}")
