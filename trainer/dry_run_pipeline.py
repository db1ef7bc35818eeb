"""The dry run of an auto-mode pipeline (`train.py --dry-run --world-size N`, mode "auto",
`pipeline_parallel_degree` > 1), on a fake world: every kind of stage (the first, the last,
the middle ones of as many blocks) planned once on the stage submesh, side by side in worker
processes (trainer/stage_processes.py), the cut by their predicted times (trainer/auto_pipeline.py
`plan_pipeline`), and the pipeline's plan printed: the schedule, each stage's blocks, pp rank,
predicted time and peak with the microbatches the schedule keeps in flight, against the memory
limit."""

from __future__ import annotations

import os
import time

from models import build_model
from parallel import _torch as T
from parallel.auto.cost.memory import format_bytes
from parallel.auto.plan.pipeline import PipelinePlan
from parallel.mesh import build_mesh

from .auto_pipeline import plan_pipeline
from .config import JobConfig
from .dry_run import main as recipe_main
from .dry_run_auto import faked_device, simulated_job
from .dry_run_auto import main as auto_main
from .stage_processes import DryRunJob, StageProcesses
from .tokenizer import tokenizer_vocab

STAGE_WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Processes the dry run plans its kinds of stage on (a pipeline has three or four kinds)."""

__all__ = ["dry_run_main", "dry_run_pipeline", "format_pipeline_report", "main"]


def dry_run_pipeline(job_config: JobConfig, world_size: int, workers: int = STAGE_WORKERS
                     ) -> tuple[PipelinePlan, list[str]]:
    """(the pipeline's plan, the report's header and notes) of `job_config` on a fake world;
    two kinds of stage or more are planned on `workers` processes (trainer/stage_processes.py)."""
    t0 = time.time()
    device = faked_device(job_config)
    cfg, note = simulated_job(job_config, world_size, device)
    m = cfg.model
    vocab = m.vocab_size if m.vocab_size > 0 else tokenizer_vocab(cfg) or build_model(
        m.name, m.flavor, device="meta", **m.arg_overrides()).args.vocab_size
    with T.fake_world(world_size):
        mesh = build_mesh(cfg.parallelism.degrees, world_size, device.type, expert_axis=True)
        model = build_model(m.name, m.flavor, device="meta", **{**m.arg_overrides(), "vocab_size": vocab})
        elsewhere = StageProcesses(DryRunJob(cfg, world_size, vocab), workers) if workers > 1 else None
        plan = plan_pipeline(model, mesh, cfg, elsewhere)
        axes = " x ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape))
    t = cfg.training
    lines = [f"dry run (auto mode, pipeline): {m.name}/{m.flavor} on a fake world of {world_size} ranks, fake "
             f"{device} tensors, mesh {axes}, local batch {t.local_batch_size} x {t.seq_len} tokens "
             f"({time.time() - t0:.1f} s)", *([f"  note: {note}"] if note else [])]
    return plan, lines


def format_pipeline_report(plan: PipelinePlan, lines: list[str]) -> str:
    """The header, the pipeline plan's summary, planning time and the memory check per stage."""
    out = [*lines, plan.summary()]
    distinct = list({id(s.plan): s for s in plan.stages}.values())
    seconds = sum(sum(s.plan.timings.values()) for s in distinct)
    out.append(f"planning: {seconds:.1f} s over {len(distinct)} distinct stage plans (the last cut's; trace, "
               "candidates, solve, memory estimate)")
    for s in distinct:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in s.plan.timings.items() if v >= 0.05)
        out.append(f"  stage {s.index}'s plan: {parts}; recomputation {s.plan.recompute.get('summary', 'fixed')}")
    for s in plan.stages:
        k = plan.in_flight(s.index)
        peak, limit = s.peak_bytes(k), s.plan.memory.limit_bytes if s.plan.memory is not None else 0
        if peak is not None and limit:
            verdict = "fits" if peak <= limit else "DOES NOT FIT: raise pipeline_parallel_degree or lower " \
                                                   "pipeline_parallel_microbatch_size"
            held = f"{k} microbatch{'es' if k > 1 else ''}"
            out.append(f"memory: stage {s.index} peaks at {format_bytes(peak)} a device with {held} in flight, "
                       f"limit {format_bytes(limit)}: {verdict}")
    return "\n".join(out)


def main(job_config: JobConfig, world_size: int) -> int:
    """Print the report; exit code 1 when a stage does not fit its memory limit."""
    plan, lines = dry_run_pipeline(job_config, world_size)
    print(format_pipeline_report(plan, lines), flush=True)
    over = [s for s in plan.stages if s.plan.memory is not None and s.plan.memory.limit_bytes
            and (s.peak_bytes(plan.in_flight(s.index)) or 0) > s.plan.memory.limit_bytes]
    return 1 if over else 0


def dry_run_main(job_config: JobConfig, world_size: int) -> int:
    """``train.py --dry-run``: the recipes' dry run (manual mode), auto mode's, or this one (auto
    mode with a pp degree); its exit code."""
    if job_config.parallelism.mode != "auto":
        return recipe_main(job_config, world_size)
    if job_config.parallelism.degrees.resolved(world_size)["pp"] > 1:
        return main(job_config, world_size)
    return auto_main(job_config, world_size)
