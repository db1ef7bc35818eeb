"""Fitting a plan in memory when the solve chooses the recomputation ([activation_checkpoint]
mode = "auto"): the solve's memory row holds the kept activations and the model states
(problem/recompute.py); what the row leaves out (activations outside the blocks, transients,
the allocator's view of the peak) is read off the memory estimate of the plan the solve
made, and the row's limit is lowered by it for the next solve, a few rounds.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from parallel.auto import resharding
from parallel.auto.cost.memory import format_bytes
from parallel.auto.plan import Plan
from parallel.auto.problem.placement_problem import MemoryLimitError, PlanningError
from parallel.auto.problem.recompute import STATE_FACTOR, RecomputeRow
from parallel.auto.runtime import RuntimeOptions

log = logging.getLogger("parallel.auto.api")

ROUNDS = 4
"""Solves after the first one, each with the row moved by what the last estimate added."""
LOOSEN = 0.02
"""A fitting plan is solved again with a looser row only when the row over-counted by more
than this share of the limit."""


def chooses_recompute(runtime: RuntimeOptions) -> bool:
    return runtime.ac_mode == "auto"


def plan_options(runtime: RuntimeOptions, plan: Plan) -> RuntimeOptions:
    """The options a plan runs with: under mode "auto" the plan's own per-block choice
    (every block kept when the solve had nothing to choose), and its resharding choice."""
    runtime = resharding.resolved(runtime, plan)
    if not chooses_recompute(runtime):
        return runtime
    blocks = plan.recompute.get("blocks")
    if not blocks:
        return dataclasses.replace(runtime, ac_mode="none", ac_blocks=None)
    return dataclasses.replace(runtime, ac_mode="none", ac_blocks=tuple(blocks))


def replay_row(runtime: RuntimeOptions, plan: Plan) -> RecomputeRow | None:
    """The recomputation choice a replayed plan's problem poses: the plan's own (no row: the
    replay prices the plan's choice, it does not choose)."""
    if not chooses_recompute(runtime) or not plan.recompute.get("blocks"):
        return None
    return RecomputeRow(None, keep_choice=True)


@dataclasses.dataclass
class RowState:
    """The row's limit for the next solve: the memory limit less what the estimate adds to it."""

    limit: int  # bytes (0: no limit)
    outside: float = 0.0  # the estimate's peak less the row's value, largest seen
    full_only: bool = False  # every block recomputed, no row (the plan a refusal names)
    held: int = 1  # microbatches whose kept activations are alive at the peak (a pipeline stage's in flight)

    def row(self) -> RecomputeRow:
        """held x kept activations + states <= limit, posed as kept + states / held <= limit / held."""
        if self.full_only:
            return RecomputeRow(None, full_only=True)
        return RecomputeRow((self.limit - self.outside) / self.held if self.limit else None,
                            state_factor=STATE_FACTOR / self.held)


def row_value(plan: Plan, state_factor: float, held: int = 1) -> float:
    """The row's value of a plan: its kept activations (`held` microbatches') and model states (bytes)."""
    return held * plan.recompute.get("activation_bytes", 0.0) + \
        state_factor * plan.memory_fraction * plan.total_param_bytes


def fit_with_recompute(autop: Any, plan: Plan, low: float | None, high: float | None, level: int) -> Plan:
    """Estimate the plan and move the row by what the estimate says it missed: over the limit,
    lower it and solve again (recomputing more, sharding more); within the limit while the
    row counted more than the estimate found, raise it and solve again (recomputing less).
    The fastest plan that fits; MemoryLimitError naming the parts under full recomputation
    when none does."""
    state: RowState = autop.recompute_row
    best: Plan | None = None
    est = None
    for round_ in range(ROUNDS + 1):
        est = autop.estimate_memory(plan)
        plan.memory = est
        plan.timings["memory"] = autop.timings.get("memory", 0.0)
        if not plan.recompute:
            return plan if est.fits else _refuse(autop, plan, est, low, high)
        outside = est.peak_bytes - row_value(plan, STATE_FACTOR, state.held)
        if est.fits:
            if best is None or plan.objective_us < best.objective_us:
                best = plan
            recomputes = any(c != "none" for c in plan.recompute["blocks"])
            if not recomputes or outside >= state.outside - LOOSEN * state.limit or round_ == ROUNDS:
                break
            state.outside, verb = outside, "raised"  # the row counted more than the estimate: loosen it
        elif best is not None:  # a loosened row overshot: the last plan that fitted stands
            break
        elif round_ == ROUNDS:
            break
        else:
            state.outside, verb = max(state.outside, outside), "lowered"
        log.log(level, "memory: peak %s of %s with recomputation %s: the row %s by what the estimate adds "
                "(%s outside it); solving again", format_bytes(est.peak_bytes), format_bytes(est.limit_bytes),
                plan.recompute.get("summary"), verb, format_bytes(state.outside))
        try:
            prob, sol = autop.build_and_solve(low, high)
        except PlanningError:
            break
        plan = autop.plan_of(prob, sol, low, high)
    if best is not None:
        return best
    return _refuse(autop, plan, est, low, high)


def first_solve(autop: Any, low: float | None, high: float | None) -> tuple[Any, Any]:
    """The first solve; when no plan keeps the row, the plan that recomputes every block (the
    row is a bound the estimate corrects: that plan may still fit, and the fit then checks it;
    a recipe's constraints made the LLaMA 3 70B FSDP·TP8 shape refused at 52 of 79.6 GiB)."""
    try:
        return autop.build_and_solve(low, high)
    except PlanningError:
        state: RowState | None = autop.recompute_row
        if state is None or not state.limit or state.full_only:
            raise
        autop.recompute_row = dataclasses.replace(state, full_only=True)
        try:
            return autop.build_and_solve(low, high)
        finally:
            autop.recompute_row = state


def _refuse(autop: Any, plan: Plan | None, est: Any, low: float | None, high: float | None) -> Plan:
    """The plan that recomputes every block when its estimate fits (the row, a bound, may have
    refused what fits: the 70B FSDP·TP8 recipe shape's row was infeasible at a 52 GiB peak of
    79.6), else MemoryLimitError with its estimate."""
    state: RowState = autop.recompute_row
    full = plan
    if plan is None or (plan.recompute and set(plan.recompute["blocks"]) != {"full"}):
        saved, autop.recompute_row = state, dataclasses.replace(state, full_only=True)
        try:
            prob, sol = autop.build_and_solve(low, high)
            full = autop.plan_of(prob, sol, low, high)
            est = autop.estimate_memory(full)
        finally:
            autop.recompute_row = saved
    if est is not None and est.fits and full is not None:
        full.memory = est
        log.info("memory: no plan kept the recomputation row; the plan recomputing every block fits (peak %s of %s)",
                 format_bytes(est.peak_bytes), format_bytes(est.limit_bytes))
        return full
    what = "with every block recomputed" if full.recompute else "(the graph has no blocks to recompute)"
    raise MemoryLimitError(
        f"no plan fits in the memory limit {what}: predicted peak {format_bytes(est.peak_bytes)} per device "
        f"({est.parts()}, in the {est.phase}) > {format_bytes(est.limit_bytes)} ({est.limit_source}); "
        f"{autop.memory_advice_text(est)}", est)
