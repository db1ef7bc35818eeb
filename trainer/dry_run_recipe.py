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

import dataclasses
import time
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from parallel.auto.plan import Plan
from parallel.auto.problem.placement_problem import PlanningError
from parallel.auto.request import data_axes, planning
from parallel.auto.search import presets
from parallel.mesh import EP, TP, axis_names

from .auto_mode import plan_request
from .config import JobConfig


@dataclass(frozen=True)
class PricedPlan:
    """One plan of the job as the cost model prices it: the step graph simulated (with what
    its activation checkpointing recomputes) where the memory estimate made one, else the
    solver's price; MFU by the model's FLOPs per token on the profile's peak."""

    name: str
    step_ms: float
    peak_gib: float | None  # None: the memory estimate is off
    tokens_per_s_per_gpu: float
    solve_s: float = 0.0
    experts: str = ""  # where the plan puts the routed experts (its summary's line)
    mfu: float | None = None
    recompute: str = ""  # what the plan recomputes

    def row(self) -> str:
        peak = f"{self.peak_gib:9.1f}" if self.peak_gib is not None else f"{'n/a':>9}"
        mfu = f"{self.mfu:>7.1%}" if self.mfu is not None else f"{'n/a':>7}"
        return f"    {self.name:<44}{self.step_ms:>11,.1f}{peak}{self.tokens_per_s_per_gpu:>12,.0f}{mfu}"


def priced(name: str, plan: Plan, step_tokens: int, world: int, micro_batches: int, solve_s: float = 0.0,
           flops: tuple[float, float] | None = None, recompute: str = "") -> PricedPlan:
    """`plan` priced for this job: `step_tokens`, the global tokens of one micro-batch;
    `flops`: (FLOPs per token, peak FLOP/s per device) for the MFU."""
    step_us = plan.step_time_us(micro_batches)
    if plan.timeline is not None and micro_batches == 1:  # the step graph as it runs, recomputation in it
        step_us = plan.timeline.step_us
    peak = plan.memory.peak_bytes / 2**30 if plan.memory is not None else None
    lines = [line.strip() for line in plan.summary().splitlines()]
    experts = next((line for line in lines if line.startswith("moe.experts.w1:")), "")
    tps = step_tokens * micro_batches / (step_us * 1e-6) / world
    mfu = tps * flops[0] / flops[1] if flops else None
    return PricedPlan(name, step_us / 1e3, peak, tps, solve_s, experts, mfu,
                      recompute or plan.recompute.get("summary", ""))


def fsdp_preset(pm, mesh: DeviceMesh, cfg: JobConfig, tokens: tuple[int, int]) -> tuple[Plan | str, float, str]:
    """The expert's recipe shape on the free plan's trace: with a ``tp`` axis FSDP·TP
    (Megatron projections on tp, their weights sharded on the data axes too) and the same
    recomputation options as the free plan; without one the FSDP preset (parameters fully
    sharded on the data axes, gathered for every matmul) with per-op SAC. Its plan (or why it
    has none), its solve time and its name."""
    request = plan_request(cfg, mesh, local_batch_size=tokens[0], seq_len=tokens[1])
    names = axis_names(mesh)
    if TP not in names:
        request = dataclasses.replace(request, runtime=dataclasses.replace(request.runtime, ac_mode="selective",
                                                                           ac_option="op", ac_blocks=None))
    t0 = time.perf_counter()
    with planning(pm.meta_template, mesh, request, graph=pm.plan_runner.graph) as autop:
        if TP in names:
            presets.megatron(autop, names.index(TP), fsdp_other_axes=True, data_axes=data_axes(mesh))
        else:
            presets.fsdp(autop, data_axes(mesh))
        try:
            plan: Plan | str = autop.optimize_placement(verbose=False)
        except PlanningError as e:
            plan = f"no plan ({e})"
    name = (f"FSDP·TP{mesh.shape[names.index(TP)]} preset (AC chosen alike)" if TP in names
            else "FSDP preset (per-op SAC)")
    return plan, time.perf_counter() - t0, name


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


PUBLISHED = {
    ("llama3", "8B", 8): "TorchTitan's published LLaMA 3.1 8B on 8 H100s, seq 8192, local batch 2: 5,762 tok/s/GPU "
                         "(FSDP, selective AC), 6,667 (the same, compiled)",
    ("llama3", "70B", 64): "TorchTitan's published LLaMA 3.1 70B: 829 tok/s/GPU on 256 H100s (FSDP32·TP8, Float8, "
                           "full AC): a reference, not like-for-like",
}
"""Published throughput of the shipped H100 jobs' shapes, printed beside the prediction."""


def published_reference(model: str, flavor: str, world: int) -> str | None:
    return PUBLISHED.get((model, flavor, world))


def format_comparison(rows: list[PricedPlan | str]) -> list[str]:
    """The table the dry run prints (a str row: a plan that could not be made, and why), and
    the free plan's ratio to the recipe."""
    lines = ["the plan next to the mesh's hand recipe, priced alike by the cost model (each plan's step graph "
             "simulated, its recomputation included, or the solver's price where there is none; the peak of each "
             "plan's memory estimate; MFU by the model's FLOPs per token):",
             f"    {'plan':<44}{'step ms':>11}{'peak GiB':>9}{'tok/s/GPU':>12}{'MFU':>7}"]
    lines += [r.row() if isinstance(r, PricedPlan) else f"    {r}" for r in rows]
    lines += [f"    {r.name.split(' (')[0]}: {r.experts}" for r in rows if isinstance(r, PricedPlan) and r.experts]
    lines += [f"    {r.name.split(' (')[0]} recomputes: {r.recompute}" for r in rows
              if isinstance(r, PricedPlan) and r.recompute]
    if len(rows) == 2 and all(isinstance(r, PricedPlan) for r in rows) and rows[1].tokens_per_s_per_gpu > 0:
        lines.append(f"    free plan / recipe: {rows[0].tokens_per_s_per_gpu / rows[1].tokens_per_s_per_gpu:.3f}x "
                     f"tokens/s, step {rows[0].step_ms / rows[1].step_ms:.3f}x (recipe solved in "
                     f"{rows[1].solve_s:.1f} s)")
    return lines
