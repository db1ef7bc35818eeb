"""Exact solver: the placement Problem as an integer program (pulp; HiGHS or CBC).

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
from dataclasses import dataclass

import numpy as np
import pulp

from parallel.auto.problem import PlanningError, Problem, check_feasible

log = logging.getLogger(__name__)


@dataclass
class Solution:
    """One strategy index per group, with how it was obtained."""

    labels: list[int]
    objective: float
    solver: str
    status: str  # "optimal" | "time_limit" (feasible, optimality not proven)
    seconds: float
    num_vars: int
    num_constraints: int

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"


def available_solver(name: str = "auto") -> str:
    """'highs' when highspy is installed (faster), else 'cbc'; or the one asked for."""
    if name not in ("auto", "highs", "cbc"):
        raise ValueError(f"unknown ILP solver {name!r}; use 'auto', 'highs' or 'cbc'")
    if name in ("auto", "highs"):
        try:
            import highspy  # noqa: F401

            if pulp.HiGHS().available():
                return "highs"
        except ImportError:
            pass
        if name == "highs":
            raise ValueError("solver 'highs' requested but highspy is not installed (pip install highspy)")
    return "cbc"


def _solver(name: str, time_limit: float | None, verbose: bool) -> pulp.LpSolver:
    if name == "highs":
        return pulp.HiGHS(msg=verbose, timeLimit=time_limit, threads=1, random_seed=0)
    with warnings.catch_warnings():  # the bundled CBC binary works offline; pulp 3.3 warns about 4.0
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=verbose, timeLimit=time_limit, threads=1, options=["randomSeed 42", "randomCbcSeed 42"])


def _var(lp: pulp.LpProblem, name: str, low: float, up: float, cat: str) -> pulp.LpVariable:
    if hasattr(lp, "add_variable"):  # pulp >= 3.3
        return lp.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)


def solve_ilp(
    prob: Problem, *, solver: str = "auto", time_limit: float | None = 600.0, verbose: bool = False
) -> Solution:
    """Solve `prob` exactly (up to the time limit, whose expiry is reported in `status`)."""
    name = available_solver(solver)
    t0 = time.perf_counter()
    lp = pulp.LpProblem("placement", pulp.LpMinimize)
    x: list[dict[int, pulp.LpVariable]] = []
    objective: dict[pulp.LpVariable, float] = {}
    n_cons = 0
    for g in range(prob.num_groups):
        idx = np.flatnonzero(prob.allowed[g])
        xs = {int(s): _var(lp, f"x{g}_{s}", 0, 1, pulp.LpBinary) for s in idx}
        x.append(xs)
        lp += pulp.LpAffineExpression([(v, 1.0) for v in xs.values()]) == 1, f"one{g}"
        n_cons += 1
        for s, v in xs.items():
            c = float(prob.unary[g][s])
            if c:
                objective[v] = c
    n_y = 0
    for ei, e in enumerate(prob.edges):
        src_x, dst_x = x[e.src], x[e.dst]
        src_classes = {int(e.src_cls[s]) for s in src_x}
        dst_classes = {int(e.dst_cls[t]) for t in dst_x}
        y: dict[tuple[int, int], pulp.LpVariable] = {}
        for a in sorted(src_classes):
            for b in sorted(dst_classes):
                c = e.cost[a, b]
                if math.isfinite(c):
                    v = _var(lp, f"y{ei}_{a}_{b}", 0, 1, pulp.LpContinuous)
                    y[(a, b)] = v
                    if c:
                        objective[v] = float(c)
        n_y += len(y)
        for a in sorted(src_classes):
            terms = [(v, 1.0) for (aa, _), v in y.items() if aa == a]
            terms += [(xv, -1.0) for s, xv in src_x.items() if e.src_cls[s] == a]
            lp += pulp.LpAffineExpression(terms) == 0, f"ms{ei}_{a}"
        for b in sorted(dst_classes):
            terms = [(v, 1.0) for (_, bb), v in y.items() if bb == b]
            terms += [(xv, -1.0) for t, xv in dst_x.items() if e.dst_cls[t] == b]
            lp += pulp.LpAffineExpression(terms) == 0, f"md{ei}_{b}"
        n_cons += len(src_classes) + len(dst_classes)
    total = prob.total_param_bytes
    if prob.param_groups and total > 0 and (prob.memory_high is not None or prob.memory_low is not None):
        # in units of the total so coefficients stay O(1)
        terms = [(x[g][s], float(prob.param_bytes[g][s] / total)) for g in prob.param_groups for s in x[g]]
        mem = pulp.LpAffineExpression(terms)
        if prob.memory_high is not None:
            lp += mem <= prob.memory_high + 1e-9, "mem_high"
            n_cons += 1
        if prob.memory_low is not None:
            lp += mem >= prob.memory_low - 1e-9, "mem_low"
            n_cons += 1
    lp += pulp.LpAffineExpression(list(objective.items()))
    n_vars = sum(len(xs) for xs in x) + n_y
    build_s = time.perf_counter() - t0
    log.info("ilp: %d vars (%d strategy, %d edge), %d constraints, built in %.2fs, solving with %s",
             n_vars, n_vars - n_y, n_y, n_cons, build_s, name)
    lp.solve(_solver(name, time_limit, verbose))
    seconds = time.perf_counter() - t0
    status = pulp.LpStatus[lp.status]
    if status != "Optimal" or lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if status == "Infeasible" or lp.sol_status == pulp.LpSolutionInfeasible:
            check_feasible(prob)  # names the conflicting constraints when it can
            raise PlanningError(
                "the ILP is infeasible under the given constraints: "
                + "; ".join(c.description for c in prob.constraints) or "(no user constraints)"
            )
        raise PlanningError(f"the {name} solver found no solution (status {status}, "
                            f"time limit {time_limit}s): raise the time limit or relax the constraints")
    labels = []
    for g, xs in enumerate(x):
        best = max(xs.items(), key=lambda kv: (kv[1].varValue or 0.0, -kv[0]))
        labels.append(best[0])
    obj = prob.energy(labels)
    proven = lp.sol_status == pulp.LpSolutionOptimal
    sol = Solution(labels, obj, name, "optimal" if proven else "time_limit", seconds, n_vars, n_cons)
    if not proven:
        log.warning("ilp: the %.0fs time limit expired; the plan is feasible but not proven optimal", time_limit)
    log.info("ilp: objective %.1f µs, status %s, %.2fs", obj, sol.status, seconds)
    return sol
