"""The auto dry run's yardstick: the hand-written recipe of the job's mesh, priced by the same
cost model as the planner's free plan.

A prediction alone says little: is 4.2 s a step good? The recipe an expert would write for
this mesh answers it. With an ``ep`` axis (``expert_parallel_degree`` in auto mode) that is
the EP recipe (parallel/recipes/ep.py): FSDP on every data axis, experts split over ``ep``
with the tokens sent there all-to-all (parallel/auto/search/presets.expert_parallel). It is
solved on the free plan's own trace (no second trace), with the same request and cost model,
and both plans are priced alike: the step (``Plan.step_time_us``, its micro-batches), the
memory estimate's peak, tokens per second per GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from parallel.auto.plan import Plan
from parallel.auto.request import data_axes, planning
from parallel.auto.search import presets
from parallel.mesh import EP, axis_names

from .auto_mode import plan_request
from .config import JobConfig


@dataclass(frozen=True)
class PricedPlan:
    """One plan of the job as the cost model prices it."""

    name: str
    step_ms: float
    peak_gib: float | None  # None: the memory estimate is off
    tokens_per_s_per_gpu: float
    solve_s: float = 0.0

    def row(self) -> str:
        peak = f"{self.peak_gib:9.1f}" if self.peak_gib is not None else f"{'n/a':>9}"
        return f"    {self.name:<34}{self.step_ms:>11,.1f}{peak}{self.tokens_per_s_per_gpu:>12,.0f}"


def priced(name: str, plan: Plan, step_tokens: int, world: int, micro_batches: int, solve_s: float = 0.0
           ) -> PricedPlan:
    """`plan` priced for this job: `step_tokens`, the global tokens of one micro-batch."""
    step_us = plan.step_time_us(micro_batches)
    peak = plan.memory.peak_bytes / 2**30 if plan.memory is not None else None
    return PricedPlan(name, step_us / 1e3, peak, step_tokens * micro_batches / (step_us * 1e-6) / world, solve_s)


def ep_recipe(pm, mesh: DeviceMesh, cfg: JobConfig, tokens: tuple[int, int]) -> tuple[Plan, float] | None:
    """The EP recipe's plan on the free plan's trace (`pm`: the planned ParallelModule) and
    its solve time; None when the mesh has no ``ep`` axis."""
    names = axis_names(mesh)
    if EP not in names:
        return None
    request = plan_request(cfg, mesh, local_batch_size=tokens[0], seq_len=tokens[1])
    t0 = time.perf_counter()
    with planning(pm.meta_template, mesh, request, graph=pm.plan_runner.graph) as autop:
        presets.expert_parallel(autop, names.index(EP), data_axes(mesh))
        plan = autop.optimize_placement(verbose=False)
    return plan, time.perf_counter() - t0


def format_comparison(rows: list[PricedPlan]) -> list[str]:
    """The table the dry run prints, and the free plan's ratio to the recipe."""
    lines = ["priced by the same cost model (the plan's step, its memory estimate's peak):",
             f"    {'plan':<34}{'step ms':>11}{'peak GiB':>9}{'tok/s/GPU':>12}"]
    lines += [r.row() for r in rows]
    if len(rows) == 2 and rows[1].tokens_per_s_per_gpu > 0:
        lines.append(f"    free plan / recipe: {rows[0].tokens_per_s_per_gpu / rows[1].tokens_per_s_per_gpu:.3f}x "
                     f"tokens/s (recipe solved in {rows[1].solve_s:.1f} s)")
    return lines
