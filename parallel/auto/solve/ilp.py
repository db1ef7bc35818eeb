"""Exact solver: the placement Problem as an integer program (HiGHS via solve/highs_ilp.py, or CBC via pulp).

Formulation (marginal/flow, which scales where linearised products do not):
  x[g, s]  binary, one per allowed strategy s of group g;  sum_s x[g, s] = 1
  y[e, a, b] in [0, 1], one per finite-cost pair (producer output class a, consumer input
  class b) of edge e, with marginals
      sum_b y[e, a, b] = sum_{s in class a} x[src, s]
      sum_a y[e, a, b] = sum_{t in class b} x[dst, t]
  (with binary x the marginals are unit vectors, so y is their outer product: integral).
  minimise  sum unary[g, s] x[g, s] + sum cost[e, a, b] y[e, a, b]
  subject to the byte-weighted parameter-memory budget  low·B <= sum bytes[g, s] x[g, s] <= high·B.
"""

from __future__ import annotations

import logging
import math
import time
import warnings

import numpy as np
import pulp

try:  # optional, the faster backend: pip install .[highs]
    import highspy
except ImportError:  # pragma: no cover - CBC (bundled with pulp) then
    highspy = None

from parallel.auto.problem.feasibility import check_feasible
from parallel.auto.problem.placement_problem import PlanningError, Problem
from parallel.auto.solve.presolve import BUDGET_SCALE, BUDGET_SLACK, Reduced, ReducedEdge, prune_to_budget
from parallel.auto.solve.solution import Solution

log = logging.getLogger(__name__)


def available_solver(name: str = "auto") -> str:
    """'highs' when highspy is installed (faster), else 'cbc'; or the one asked for ("auto"
    and "ilp", the planner's solver setting for the exact ILP: the faster one)."""
    if name not in ("auto", "ilp", "highs", "cbc"):
        raise ValueError(f"unknown ILP solver {name!r}; use 'auto', 'highs' or 'cbc'")
    if name in ("auto", "ilp", "highs"):
        if highspy is not None and pulp.HiGHS().available():
            return "highs"
        if name == "highs":
            raise ValueError("solver 'highs' requested but highspy is not installed (pip install highspy)")
    return "cbc"


def _cbc(time_limit: float | None, verbose: bool) -> pulp.LpSolver:
    """CBC, single-threaded and seeded so that a plan does not depend on the run."""
    with warnings.catch_warnings():  # the bundled CBC binary works offline; pulp 3.3 warns about 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=verbose, timeLimit=time_limit, threads=1,
                                 options=["randomSeed 42", "randomCbcSeed 42"])


def _var(lp: pulp.LpProblem, name: str, low: float, up: float, cat: str) -> pulp.LpVariable:
    """A variable registered with `lp` (pulp >= 3.3 wants variables created by the problem)."""
    if hasattr(lp, "add_variable"):  # pulp >= 3.3
        return lp.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)


_XVars = dict[int, dict[int, pulp.LpVariable]]
"""x[g][s]: the binary strategy variables of each group that survived elimination."""


def _add_strategy_vars(lp: pulp.LpProblem, red: Reduced, alive: list[int],
                       objective: dict[pulp.LpVariable, float]) -> _XVars:
    """x[g][s] for every finite strategy of every remaining group, exactly one per group."""
    x: _XVars = {}
    for g in alive:
        idx = np.flatnonzero(np.isfinite(red.unary[g]))
        xs = {int(s): _var(lp, f"x{g}_{s}", 0, 1, pulp.LpBinary) for s in idx}
        x[g] = xs
        lp += pulp.LpAffineExpression([(v, 1.0) for v in xs.values()]) == 1, f"one{g}"
        for s, v in xs.items():
            c = float(red.unary[g][s])
            if c:
                objective[v] = c
    return x


def _add_edge(lp: pulp.LpProblem, ei: int, e: ReducedEdge, src_x: dict[int, pulp.LpVariable],
              dst_x: dict[int, pulp.LpVariable], objective: dict[pulp.LpVariable, float]) -> tuple[int, int]:
    """y[a, b] of one edge over its finite class pairs, tied to x by the two marginals: (#y, #constraints)."""
    src_classes = sorted({int(e.cu[s]) for s in src_x})
    dst_classes = sorted({int(e.cv[t]) for t in dst_x})
    n_y = 0
    by_a: dict[int, list] = {a: [] for a in src_classes}
    by_b: dict[int, list] = {b: [] for b in dst_classes}
    for a in src_classes:
        for b in dst_classes:
            c = e.cost[a, b]
            if math.isfinite(c):
                v = _var(lp, f"y{ei}_{a}_{b}", 0, 1, pulp.LpContinuous)
                n_y += 1
                by_a[a].append((v, 1.0))
                by_b[b].append((v, 1.0))
                if c:
                    objective[v] = float(c)
    for s, xv in src_x.items():
        by_a[int(e.cu[s])].append((xv, -1.0))
    for t, xv in dst_x.items():
        by_b[int(e.cv[t])].append((xv, -1.0))
    for a, terms in by_a.items():
        lp += pulp.LpAffineExpression(terms) == 0, f"ms{ei}_{a}"
    for b, terms in by_b.items():
        lp += pulp.LpAffineExpression(terms) == 0, f"md{ei}_{b}"
    return n_y, len(by_a) + len(by_b)


def _add_memory_budget(lp: pulp.LpProblem, prob: Problem, x: _XVars) -> int:
    """low <= parameter bytes / total <= high, in millionths of the total (BUDGET_SCALE: the
    solver's feasibility tolerance then stays below a byte): #constraints."""
    scale = BUDGET_SCALE / prob.total_param_bytes
    terms = [(x[g][s], float(prob.param_bytes[g][s] * scale)) for g in prob.param_groups for s in x[g]]
    mem = pulp.LpAffineExpression(terms)
    n_cons = 0
    if prob.memory_high is not None:
        lp += mem <= (prob.memory_high + BUDGET_SLACK) * BUDGET_SCALE, "mem_high"
        n_cons += 1
    if prob.memory_low is not None:
        lp += mem >= (prob.memory_low - BUDGET_SLACK) * BUDGET_SCALE, "mem_low"
        n_cons += 1
    return n_cons


def _build_lp(prob: Problem, red: Reduced, memory: bool) -> tuple[pulp.LpProblem, _XVars, int, int]:
    """The integer program of the reduced problem: (lp, x, #edge variables, #constraints)."""
    alive = [g for g in range(prob.num_groups) if red.alive[g]]
    lp = pulp.LpProblem("placement", pulp.LpMinimize)
    objective: dict[pulp.LpVariable, float] = {}
    x = _add_strategy_vars(lp, red, alive, objective)
    n_cons, n_y = len(alive), 0
    for ei, e in sorted(red.edges.items()):
        ny, nc = _add_edge(lp, ei, e, x[e.u], x[e.v], objective)
        n_y += ny
        n_cons += nc
    if memory:
        n_cons += _add_memory_budget(lp, prob, x)
    lp += pulp.LpAffineExpression(list(objective.items()))
    return lp, x, n_y, n_cons


def _check_solved(lp: pulp.LpProblem, prob: Problem, name: str, time_limit: float | None) -> None:
    """Raise PlanningError unless the solver returned an assignment (optimal or feasible)."""
    status = pulp.LpStatus[lp.status]
    if status == "Optimal" and lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return
    if status == "Infeasible" or lp.sol_status == pulp.LpSolutionInfeasible:
        check_feasible(prob)  # names the conflicting constraints when it can
        raise PlanningError(
            "the ILP is infeasible under the given constraints: "
            + ("; ".join(c.description for c in prob.constraints) or "(no user constraints)")
        )
    raise PlanningError(f"the {name} solver found no solution (status {status}, "
                        f"time limit {time_limit}s): raise the time limit or relax the constraints")


def _read_labels(x: _XVars, red: Reduced, num_groups: int) -> list[int]:
    """The chosen strategy of every group: the largest x of each remaining group, then the eliminated ones."""
    labels: list[int | None] = [None] * num_groups
    for g, xs in x.items():
        best = max(xs.items(), key=lambda kv: (kv[1].varValue or 0.0, -kv[0]))
        labels[g] = best[0]
    return red.recover(labels)


def solve_ilp(
    prob: Problem, *, solver: str = "auto", time_limit: float | None = 600.0, verbose: bool = False,
    eliminate: bool = True, start: list[int] | None = None,
) -> Solution:
    """Solve `prob` exactly (up to the time limit, whose expiry is reported in `status`):
    HiGHS through its own arrays (solve/highs_ilp.py), CBC through pulp. `start` (a
    neighbouring plan's strategies) is a warm start on HiGHS; CBC solves without it."""
    name = available_solver(solver)
    if name == "highs":
        from parallel.auto.solve.highs_ilp import solve_highs

        return solve_highs(prob, time_limit=time_limit, verbose=verbose, eliminate=eliminate, start=start)
    if prob.recompute is not None and prob.recompute.limited:
        raise PlanningError("choosing activation checkpointing under a memory limit needs the HiGHS ILP or the "
                            f"MRF, not {name}: [planner] solver = \"highs\" or \"mrf\" in the job's TOML (or a "
                            "fixed [activation_checkpoint] mode)")
    t0 = time.perf_counter()
    prob, memory = prune_to_budget(prob)  # the same problem, fewer strategies
    protect = set(prob.param_groups) if memory else set()
    red = Reduced(prob, protect) if eliminate else Reduced(prob, set(range(prob.num_groups)))
    lp, x, n_y, n_cons = _build_lp(prob, red, memory)
    n_vars = sum(len(xs) for xs in x.values()) + n_y
    build_s = time.perf_counter() - t0
    log.info("ilp: %d vars (%d strategy, %d edge) over %d of %d groups after elimination, %d constraints, "
             "built in %.2fs, solving with %s", n_vars, n_vars - n_y, n_y, len(x), prob.num_groups, n_cons,
             build_s, name)
    lp.solve(_cbc(time_limit, verbose))
    seconds = time.perf_counter() - t0
    _check_solved(lp, prob, name, time_limit)
    full = _read_labels(x, red, prob.num_groups)
    obj = prob.energy(full)
    proven = lp.sol_status == pulp.LpSolutionOptimal
    sol = Solution(full, obj, name, "optimal" if proven else "time_limit", seconds, n_vars, n_cons)
    if not proven:
        log.warning("ilp: the %.0fs time limit expired; the plan is feasible but not proven optimal", time_limit)
    log.info("ilp: objective %.1f µs, status %s, %.2fs", obj, sol.status, seconds)
    return sol
