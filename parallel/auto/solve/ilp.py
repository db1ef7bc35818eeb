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

try:  # optional, the faster backend: pip install .[highs]
    import highspy
except ImportError:  # pragma: no cover - CBC (bundled with pulp) then
    highspy = None

from parallel.auto.feasibility import check_feasible
from parallel.auto.problem import PlanningError, Problem
from parallel.auto.solve.solution import Solution

log = logging.getLogger(__name__)


def available_solver(name: str = "auto") -> str:
    """'highs' when highspy is installed (faster), else 'cbc'; or the one asked for."""
    if name not in ("auto", "highs", "cbc"):
        raise ValueError(f"unknown ILP solver {name!r}; use 'auto', 'highs' or 'cbc'")
    if name in ("auto", "highs"):
        if highspy is not None and pulp.HiGHS().available():
            return "highs"
        if name == "highs":
            raise ValueError("solver 'highs' requested but highspy is not installed (pip install highspy)")
    return "cbc"


def _solver(name: str, time_limit: float | None, verbose: bool) -> pulp.LpSolver:
    """The backend, single-threaded and seeded so that a plan does not depend on the run."""
    if name == "highs":
        return pulp.HiGHS(msg=verbose, timeLimit=time_limit, threads=1, random_seed=0)
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


@dataclass
class _E:
    """Working edge of the reduced problem: cost[cu[s_u], cv[s_v]]."""

    u: int
    v: int
    cu: np.ndarray
    cv: np.ndarray
    cost: np.ndarray


class _Reduced:
    """Exact min-sum elimination of groups with at most two neighbours (MRF variable elimination).

    A group joined to the rest by <= 2 edges (and not in the memory constraint) is
    minimised out: a leaf folds into its neighbour's unary cost, a chain link becomes
    one edge between its two neighbours whose cost is the min over the link's strategies.
    Chains of views/transposes/pointwise ops collapse this way, which shrinks the ILP
    without changing its optimum; labels are recovered in reverse order afterwards.
    """

    MAX_TENSOR = 4_000_000  # skip eliminations whose (strategies x classes x classes) table is larger

    def __init__(self, prob: Problem, protect: set[int]):
        self.unary = [np.where(a, u, np.inf) for u, a in zip(prob.unary, prob.allowed)]
        self.edges: dict[int, _E] = {}
        self.adj: list[set[int]] = [set() for _ in range(prob.num_groups)]
        for i, e in enumerate(prob.edges):
            self._add(_E(e.src, e.dst, e.src_cls, e.dst_cls, e.cost), i)
        self.next_id = len(prob.edges)
        self.alive = [True] * prob.num_groups
        self.protect = protect
        self.steps: list[tuple] = []  # recovery records, in elimination order
        self._run()
        self._prune_duplicates(prob)

    def _add(self, e: _E, i: int | None = None) -> None:
        if i is None:
            i = self.next_id
            self.next_id += 1
        self.edges[i] = e
        self.adj[e.u].add(i)
        self.adj[e.v].add(i)

    def _drop(self, i: int) -> _E:
        e = self.edges.pop(i)
        self.adj[e.u].discard(i)
        self.adj[e.v].discard(i)
        return e

    def _oriented(self, i: int, g: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(other group, g's class array, other's class array, cost[g class, other class])."""
        e = self.edges[i]
        if e.u == g:
            return e.v, e.cu, e.cv, e.cost
        return e.u, e.cv, e.cu, e.cost.T

    def _run(self) -> None:
        work = [g for g in range(len(self.adj)) if len(self.adj[g]) <= 2]
        while work:
            g = work.pop()
            if not self.alive[g] or g in self.protect or len(self.adj[g]) > 2:
                continue
            ok = np.isfinite(self.unary[g])
            if not ok.any():
                continue  # infeasible: leave it to the solver (it reports infeasibility)
            idx = np.flatnonzero(ok)
            edges = sorted(self.adj[g])
            if len(edges) == 0:
                self.steps.append(("free", g, int(idx[np.argmin(self.unary[g][idx])])))
            elif len(edges) == 1:
                w, cg, cw, m = self._oriented(edges[0], g)
                table = self.unary[g][idx][:, None] + m[cg[idx], :]  # [s, class of w]
                best = table.min(axis=0)
                arg = idx[table.argmin(axis=0)]
                self._drop(edges[0])
                self.unary[w] = self.unary[w] + best[cw]
                self.steps.append(("leaf", g, w, cw, arg))
                work.append(w)
            else:
                u, cg1, cu, m1 = self._oriented(edges[0], g)
                w, cg2, cw, m2 = self._oriented(edges[1], g)
                if u == w:  # two edges to the same neighbour: fold into its unary
                    t_idx = np.arange(len(cu))
                    table = (self.unary[g][idx][:, None] + m1[cg1[idx]][:, cu[t_idx]] + m2[cg2[idx]][:, cw[t_idx]])
                    best = table.min(axis=0)
                    arg = idx[table.argmin(axis=0)]
                    self._drop(edges[0])
                    self._drop(edges[1])
                    self.unary[u] = self.unary[u] + best
                    self.steps.append(("fold", g, u, arg))
                    work.append(u)
                else:
                    if len(idx) * m1.shape[1] * m2.shape[1] > self.MAX_TENSOR:
                        continue
                    table = (self.unary[g][idx][:, None, None] + m1[cg1[idx]][:, :, None] + m2[cg2[idx]][:, None, :])
                    best = table.min(axis=0)
                    arg = idx[table.argmin(axis=0)]
                    self._drop(edges[0])
                    self._drop(edges[1])
                    self._add(_E(u, w, cu, cw, best))
                    self.steps.append(("link", g, u, w, cu, cw, arg))
            self.alive[g] = False

    def _prune_duplicates(self, prob: Problem) -> None:
        """Keep one strategy per (classes on every remaining edge, parameter bytes) signature.

        Two strategies of a group that look the same to every neighbour (and to the memory
        constraint) differ only in their unary cost, so the dearer one can never be
        needed: exact.
        """
        for g in range(len(self.adj)):
            if not self.alive[g]:
                continue
            u = self.unary[g]
            ok = np.flatnonzero(np.isfinite(u))
            if len(ok) < 2:
                continue
            cols = []
            for i in sorted(self.adj[g]):
                e = self.edges[i]
                cols.append(e.cu if e.u == g else e.cv)
            pb = prob.param_bytes.get(g) if g in self.protect else None
            best: dict[tuple, int] = {}
            for s in ok:
                sig = tuple(int(c[s]) for c in cols) + ((float(pb[s]),) if pb is not None else ())
                b = best.get(sig)
                if b is None or u[s] < u[b]:
                    best[sig] = int(s)
            keep = np.zeros(len(u), dtype=bool)
            keep[list(best.values())] = True
            self.unary[g] = np.where(keep, u, np.inf)

    def recover(self, labels: list[int | None]) -> list[int]:
        """Fill in the eliminated groups' labels from the survivors', in reverse elimination order."""
        for step in reversed(self.steps):
            kind, g = step[0], step[1]
            if kind == "free":
                labels[g] = step[2]
            elif kind == "leaf":
                _, _, w, cw, arg = step
                labels[g] = int(arg[cw[labels[w]]])
            elif kind == "fold":
                _, _, u, arg = step
                labels[g] = int(arg[labels[u]])
            else:
                _, _, u, w, cu, cw, arg = step
                labels[g] = int(arg[cu[labels[u]], cw[labels[w]]])
        return [int(x) for x in labels]  # type: ignore[arg-type]


def _memory_constrained(prob: Problem) -> bool:
    """Whether the parameter-memory budget is a constraint at all (parameters and a bound)."""
    return bool(prob.param_groups) and prob.total_param_bytes > 0 and (
        prob.memory_high is not None or prob.memory_low is not None)


def _add_strategy_vars(lp: pulp.LpProblem, red: _Reduced, alive: list[int],
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


def _add_edge(lp: pulp.LpProblem, ei: int, e: _E, src_x: dict[int, pulp.LpVariable],
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
    """low <= parameter bytes / total <= high (in units of the total so coefficients stay O(1)): #constraints."""
    total = prob.total_param_bytes
    terms = [(x[g][s], float(prob.param_bytes[g][s] / total)) for g in prob.param_groups for s in x[g]]
    mem = pulp.LpAffineExpression(terms)
    n_cons = 0
    if prob.memory_high is not None:
        lp += mem <= prob.memory_high + 1e-9, "mem_high"
        n_cons += 1
    if prob.memory_low is not None:
        lp += mem >= prob.memory_low - 1e-9, "mem_low"
        n_cons += 1
    return n_cons


def _build_lp(prob: Problem, red: _Reduced, memory: bool) -> tuple[pulp.LpProblem, _XVars, int, int]:
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


def _read_labels(x: _XVars, red: _Reduced, num_groups: int) -> list[int]:
    """The chosen strategy of every group: the largest x of each remaining group, then the eliminated ones."""
    labels: list[int | None] = [None] * num_groups
    for g, xs in x.items():
        best = max(xs.items(), key=lambda kv: (kv[1].varValue or 0.0, -kv[0]))
        labels[g] = best[0]
    return red.recover(labels)


def solve_ilp(
    prob: Problem, *, solver: str = "auto", time_limit: float | None = 600.0, verbose: bool = False,
    eliminate: bool = True,
) -> Solution:
    """Solve `prob` exactly (up to the time limit, whose expiry is reported in `status`)."""
    name = available_solver(solver)
    t0 = time.perf_counter()
    memory = _memory_constrained(prob)
    protect = set(prob.param_groups) if memory else set()
    red = _Reduced(prob, protect) if eliminate else _Reduced(prob, set(range(prob.num_groups)))
    lp, x, n_y, n_cons = _build_lp(prob, red, memory)
    n_vars = sum(len(xs) for xs in x.values()) + n_y
    build_s = time.perf_counter() - t0
    log.info("ilp: %d vars (%d strategy, %d edge) over %d of %d groups after elimination, %d constraints, "
             "built in %.2fs, solving with %s", n_vars, n_vars - n_y, n_y, len(x), prob.num_groups, n_cons,
             build_s, name)
    lp.solve(_solver(name, time_limit, verbose))
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
