"""The dry run's pipeline stages planned in worker processes, one kind of stage each.

    solve_kinds = StageProcesses(DryRunJob(cfg, world_size, vocab), workers=2)
    plan = plan_pipeline(model, mesh, cfg, solve_kinds)

A pipeline's kinds of stage (the first, the last, the middle ones of as many blocks) are
solved independently: on one process the dry run takes their sum, on a 405B job some 500 s
of which the largest kind is 280. Here each kind not solved yet goes to a spawned process of
its own (its own fake world, the model built on meta, the stage traced and solved exactly as
on one process, one torch thread); the plans come back as JSON, the largest kind first (by its
microbatches in flight, then its blocks), so the dry run takes about the largest kind's plan.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys
import time
from typing import Any

import torch

from models import build_model
from parallel import _torch as T
from parallel.auto.plan import Plan
from parallel.auto.stage_plans import KindsSolved
from parallel.mesh import build_mesh
from parallel.recipes.pp import PipelineLayout

from .auto_pipeline import stage_job
from .config import JobConfig
from .dry_run_auto import faked_device


@dataclasses.dataclass(frozen=True)
class DryRunJob:
    """What a worker rebuilds the dry run's stages from: the simulated job (planner resolved),
    the fake world's size and the vocabulary the model is built with."""

    job_config: JobConfig
    world_size: int
    vocab_size: int


class StageProcesses:
    """`PipelineStages.solve_kinds` on `workers` spawned processes (parallel/auto/stage_plans.py)."""

    def __init__(self, job: DryRunJob, workers: int = 2) -> None:
        self.job, self.workers = job, workers

    def __call__(self, layout: PipelineLayout, stages: list[int]) -> KindsSolved:
        order = sorted(stages, key=lambda i: (layout.in_flight(i), len(layout.stages[i])), reverse=True)
        plans: dict[int, Plan] = {}
        hardware: Any = None
        t0 = time.perf_counter()
        n = min(self.workers, len(order))
        # leaving the pool terminates its processes: a kind that failed does not wait for the others
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            tasks = [(self.job, layout, i) for i in order]
            for i, plan_json, hardware, seconds in pool.imap_unordered(_plan_stage, tasks, chunksize=1):
                plans[i] = Plan.from_json(plan_json, source=f"stage {i}'s worker")
                print(f"[dry run] pipeline stage {i} ({_stage_words(layout, i)}) planned in {seconds:.1f} s "
                      f"({len(plans)}/{len(order)} kinds, {time.perf_counter() - t0:.0f} s, {n} processes)",
                      file=sys.stderr, flush=True)
        return KindsSolved(plans, hardware)


def _stage_words(layout: PipelineLayout, i: int) -> str:
    n = len(layout.stages[i])
    parts = (["the embedding"] if i == 0 else []) + [f"{n} block{'s' if n != 1 else ''}"] + \
        (["the output"] if i == layout.n_stages - 1 else [])
    return " + ".join(parts) + f", {layout.in_flight(i)} in flight"


def _plan_stage(task: tuple[DryRunJob, PipelineLayout, int]) -> tuple[int, dict, Any, float]:
    """In a worker: one stage of a layout planned on its own fake world (the stage, its plan's
    JSON, the cost model's hardware, seconds)."""
    job, layout, stage = task
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg, m = job.job_config, job.job_config.model
    device = faked_device(cfg)
    with T.fake_world(job.world_size):
        mesh = build_mesh(cfg.parallelism.degrees, job.world_size, device.type, expert_axis=True)
        model = build_model(m.name, m.flavor, device="meta", **{**m.arg_overrides(), "vocab_size": job.vocab_size})
        stages = stage_job(model, mesh, cfg, layout)
        plans, _ = stages.plan_distinct(layout, only=[stage])
        return stage, plans[stage].to_json(), stages.hw, time.perf_counter() - t0
