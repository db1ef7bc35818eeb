"""When the recomputation row refuses every plan, the plan that recomputes every block is still
estimated and kept if it fits (the row is a bound the estimate corrects); a refusal names it."""

import types

import pytest

from parallel.auto import recompute_fit
from parallel.auto.problem.placement_problem import MemoryLimitError, PlanningError
from parallel.auto.recompute_fit import RowState


class _Planner:
    """A planner whose row is infeasible unless it is the every-block-recomputed one."""

    def __init__(self, peak: int, limit: int) -> None:
        self.recompute_row = RowState(limit=limit)
        self.peak, self.limit, self.solves = peak, limit, []

    def build_and_solve(self, low, high):
        self.solves.append(self.recompute_row.full_only)
        if not self.recompute_row.full_only:
            raise PlanningError("the row cannot be kept")
        return "problem", "solution"

    def plan_of(self, prob, sol, low, high):
        return types.SimpleNamespace(recompute={"blocks": ["full", "full"]}, memory=None)

    def estimate_memory(self, plan):
        return types.SimpleNamespace(peak_bytes=self.peak, limit_bytes=self.limit, fits=self.peak <= self.limit,
                                     parts=lambda: "parts", phase="backward", limit_source="the test")

    def memory_advice_text(self, est):
        return "advice"


def test_an_infeasible_row_solves_with_every_block_recomputed():
    autop = _Planner(peak=52, limit=80)
    assert recompute_fit.first_solve(autop, None, None) == ("problem", "solution")
    assert autop.solves == [False, True] and not autop.recompute_row.full_only  # the row is back


def test_a_refusal_keeps_the_every_block_recomputed_plan_when_it_fits():
    fits = _Planner(peak=52, limit=80)
    plan = recompute_fit._refuse(fits, None, None, None, None)
    assert plan.memory.peak_bytes == 52 and plan.recompute["blocks"] == ["full", "full"]
    over = _Planner(peak=90, limit=80)
    with pytest.raises(MemoryLimitError, match="with every block recomputed"):
        recompute_fit._refuse(over, None, None, None, None)
