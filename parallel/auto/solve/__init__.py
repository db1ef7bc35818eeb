"""Solvers of the placement Problem and the choice between them.

    solve(prob, solver="auto" | "ilp" | "mrf" | "highs" | "cbc", ...) -> Solution

* ``"ilp"``: the exact integer program (solve/ilp.py; backend HiGHS when installed, else
  CBC; ``"highs"`` / ``"cbc"`` pick the backend and imply the ILP);
* ``"mrf"``: the pairwise-MRF solver (solve/mrf.py: TRW-S + local search, then the
  repeated layers re-solved jointly with the rest fixed) on the same Problem, with the
  parameter-memory budget handled as the paper does (§4.3): when the
  budget is "fully sharded" every parameter group is restricted to its most-sharded
  strategies, which makes the budget hold whatever else is chosen; a looser budget is
  enforced by a Lagrangian penalty on parameter bytes (bisection on the multiplier);
* ``"auto"``: the ILP while it is small (edge variables below ``ILP_MAX_EDGE_VARS``;
  ``CBC_MAX_EDGE_VARS`` without HiGHS), the MRF otherwise. The choice and why are logged.

`seed.py` (split-dimension seeding) solves cheaper problems first and narrows a 3-D/4-D mesh's
candidates around their plans; it is here because it runs the solvers (api.py calls it).
"""

from __future__ import annotations

import logging

from parallel.auto.problem.placement_problem import Problem
from parallel.auto.solve.ilp import available_solver, solve_ilp
from parallel.auto.solve.problem_mrf import MRFEffort, solve_problem_mrf
from parallel.auto.solve.solution import Solution

log = logging.getLogger("parallel.auto.solve")

SOLVERS = ("auto", "ilp", "mrf", "highs", "cbc")
ILP_MAX_EDGE_VARS = 500_000
"""`solver="auto"` uses the exact ILP up to this many edge variables, the MRF above. On
HiGHS (solve/highs_ilp.py) DeepSeek-V3 16B on 8x8 (236 k edge variables) is proven
optimal in 3.7 s, where the MRF took 15-18 s to the same objective; the 3-D/4-D seeded
problems (~1-2 M) stay with the MRF."""
CBC_MAX_EDGE_VARS = 200_000
"""The same limit when CBC is the only backend (no highspy): slower, so smaller."""

__all__ = ["SOLVERS", "ILP_MAX_EDGE_VARS", "CBC_MAX_EDGE_VARS", "MRFEffort", "Solution", "choose_solver", "solve",
           "solve_problem_mrf"]


def choose_solver(prob: Problem, solver: str = "auto", *,
                  max_ilp_edge_vars: int | None = None) -> tuple[str, str]:
    """(kind, reason): kind is "ilp" or "mrf". `solver` is one of SOLVERS (the planner's
    setting, checked once by PlannerConfig.check)."""
    if solver in ("ilp", "highs", "cbc"):
        return "ilp", f"solver={solver!r} asked for"
    if solver == "mrf":
        return "mrf", "solver='mrf' asked for"
    if solver != "auto":
        raise ValueError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    if max_ilp_edge_vars is None:
        max_ilp_edge_vars = ILP_MAX_EDGE_VARS if available_solver() == "highs" else CBC_MAX_EDGE_VARS
    n = prob.num_edge_vars()
    if n <= max_ilp_edge_vars:
        return "ilp", f"auto: {n:,} edge variables <= {max_ilp_edge_vars:,}: exact ILP"
    return "mrf", f"auto: {n:,} edge variables > {max_ilp_edge_vars:,}: MRF (TRW-S + local search)"


def solve(prob: Problem, solver: str = "auto", *, time_limit: float | None = 600.0, verbose: bool = False,
          max_ilp_edge_vars: int | None = None, start: list[int] | None = None,
          effort: MRFEffort = MRFEffort()) -> Solution:
    """Solve `prob` with the chosen solver; the returned Solution names the one used.
    `start`: one strategy per group from a neighbouring problem's plan (a warm start: an
    incumbent for the exact ILP, a second starting point for the MRF's local search);
    `effort`: how hard the MRF works (its sweeps' patience, the repeated layers' re-solve)."""
    kind, why = choose_solver(prob, solver, max_ilp_edge_vars=max_ilp_edge_vars)
    log.info("solver: %s", why)
    if kind == "ilp":  # the setting as it is: "highs" / "cbc" name the backend, "ilp" / "auto" take the best
        return solve_ilp(prob, solver=solver, time_limit=time_limit, verbose=verbose, start=start)
    return solve_problem_mrf(prob, time_budget=time_limit, start=start, effort=effort)
