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
from parallel.auto.problem.placement_problem import PlanningError
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
    experts: str = ""  # where the plan puts the routed experts (its summary's line)

    def row(self) -> str:
        peak = f"{self.peak_gib:9.1f}" if self.peak_gib is not None else f"{'n/a':>9}"
        return f"    {self.name:<38}{self.step_ms:>11,.1f}{peak}{self.tokens_per_s_per_gpu:>12,.0f}"


def priced(name: str, plan: Plan, step_tokens: int, world: int, micro_batches: int, solve_s: float = 0.0
           ) -> PricedPlan:
    """`plan` priced for this job: `step_tokens`, the global tokens of one micro-batch."""
    step_us = plan.step_time_us(micro_batches)
    peak = plan.memory.peak_bytes / 2**30 if plan.memory is not None else None
    lines = [line.strip() for line in plan.summary().splitlines()]
    experts = next((line for line in lines if line.startswith("moe.experts.w1:")), "")
    return PricedPlan(name, step_us / 1e3, peak, step_tokens * micro_batches / (step_us * 1e-6) / world, solve_s,
                      experts)


def ep_recipe(pm, mesh: DeviceMesh, cfg: JobConfig, tokens: tuple[int, int]) -> tuple[Plan | str, float] | None:
    """The EP recipe's plan on the free plan's trace (`pm`: the planned ParallelModule), or
    why it has none (it does not fit), and its solve time; None when the mesh has no ``ep`` axis."""
    names = axis_names(mesh)
    if EP not in names:
        return None
    request = plan_request(cfg, mesh, local_batch_size=tokens[0], seq_len=tokens[1])
    t0 = time.perf_counter()
    with planning(pm.meta_template, mesh, request, graph=pm.plan_runner.graph) as autop:
        presets.expert_parallel(autop, names.index(EP), data_axes(mesh))
        try:
            plan: Plan | str = autop.optimize_placement(verbose=False)
        except PlanningError as e:
            plan = f"no plan ({e})"
    return plan, time.perf_counter() - t0


def format_comparison(rows: list[PricedPlan | str]) -> list[str]:
    """The table the dry run prints (a str row: a plan that could not be made, and why), and
    the free plan's ratio to the recipe."""
    lines = ["the plan next to the mesh's hand recipe, priced alike by the cost model (the solver's price of a step, "
             "Plan.step_time_us: compute plus communication; the peak of each plan's memory estimate):",
             f"    {'plan':<38}{'step ms':>11}{'peak GiB':>9}{'tok/s/GPU':>12}"]
    lines += [r.row() if isinstance(r, PricedPlan) else f"    {r}" for r in rows]
    lines += [f"    {r.name.split(' (')[0]}: {r.experts}" for r in rows if isinstance(r, PricedPlan) and r.experts]
    if len(rows) == 2 and all(isinstance(r, PricedPlan) for r in rows) and rows[1].tokens_per_s_per_gpu > 0:
        lines.append(f"    free plan / recipe: {rows[0].tokens_per_s_per_gpu / rows[1].tokens_per_s_per_gpu:.3f}x "
                     f"tokens/s (recipe solved in {rows[1].solve_s:.1f} s)")
    return lines
