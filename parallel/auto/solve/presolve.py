"""Exact reductions of the placement Problem before an integer program sees it.

* `prune_to_budget`: strategies that cannot meet the parameter-memory budget go (the
  default, fully sharded budget leaves no budget row at all);
* `Reduced`: min-sum elimination of groups with at most two neighbours (chains and leaves);
* `prune_by_reduced_cost`: strategies that an LP bound proves worse than a known plan go.

Each keeps every optimal plan, so the ILP's optimum is unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from parallel.auto.problem.placement_problem import Problem
from parallel.auto.problem.recompute import row_holds


@dataclass
class ReducedEdge:
    """Working edge of the reduced problem: cost[cu[s_u], cv[s_v]]."""

    u: int
    v: int
    cu: np.ndarray
    cv: np.ndarray
    cost: np.ndarray


class Reduced:
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
        self.edges: dict[int, ReducedEdge] = {}
        self.adj: list[set[int]] = [set() for _ in range(prob.num_groups)]
        for i, e in enumerate(prob.edges):
            self._add(ReducedEdge(e.src, e.dst, e.src_cls, e.dst_cls, e.cost), i)
        self.next_id = len(prob.edges)
        self.alive = [True] * prob.num_groups
        self.protect = protect
        self.steps: list[tuple] = []  # recovery records, in elimination order
        self._run()
        self._prune_duplicates(prob)

    def _add(self, e: ReducedEdge, i: int | None = None) -> None:
        if i is None:
            i = self.next_id
            self.next_id += 1
        self.edges[i] = e
        self.adj[e.u].add(i)
        self.adj[e.v].add(i)

    def _drop(self, i: int) -> ReducedEdge:
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
                    self._add(ReducedEdge(u, w, cu, cw, best))
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


def memory_constrained(prob: Problem) -> bool:
    """Whether the parameter-memory budget is a constraint at all (parameters and a bound)."""
    return bool(prob.param_groups) and prob.total_param_bytes > 0 and (
        prob.memory_high is not None or prob.memory_low is not None)


BUDGET_SLACK = 1e-9
"""The budget holds to this fraction of the parameter total (rounding of the fractions)."""

BUDGET_SCALE = 1e6
"""The budget row is in millionths of the parameter total, so HiGHS' feasibility tolerance
(1e-7 of a row's unit) is 1e-13 of the total: below one byte on any model."""


def prune_to_budget(prob: Problem) -> tuple[Problem, bool]:
    """`prob` without the strategies that cannot meet the budget, and whether the budget row is still needed.

    A parameter strategy whose bytes exceed its group's least by more than the budget's
    slack (high x total - the sum of every group's least) is in no feasible plan; likewise
    for `low`. The default budget (fully sharded) leaves each group its most-sharded
    strategies and no row at all, which frees those groups for elimination and keeps a
    knapsack row out of the integer program. Exact: only infeasible strategies go.
    """
    if not memory_constrained(prob):
        return prob, False
    total, tol = prob.total_param_bytes, BUDGET_SLACK * prob.total_param_bytes
    allowed = list(prob.allowed)
    lo, hi = {}, {}
    for g in prob.param_groups:
        pb = np.where(allowed[g], prob.param_bytes[g], np.nan)
        if np.isnan(pb).all():
            return prob, True  # a group with no strategy left: the solver reports the infeasibility
        lo[g], hi[g] = float(np.nanmin(pb)), float(np.nanmax(pb))
    least, most = sum(lo.values()), sum(hi.values())
    for g in prob.param_groups:
        keep = allowed[g].copy()
        if prob.memory_high is not None:
            keep &= prob.param_bytes[g] - lo[g] <= prob.memory_high * total - least + tol
        if prob.memory_low is not None:
            keep &= hi[g] - prob.param_bytes[g] <= most - prob.memory_low * total + tol
        allowed[g] = keep
    pruned = dataclasses.replace(prob, allowed=allowed)
    if any(not a.any() for a in allowed):
        return prob, True  # the budget cannot be met: left to the solver and check_feasible
    low_ok = prob.memory_low is None or sum(
        float(prob.param_bytes[g][allowed[g]].min()) for g in prob.param_groups) >= prob.memory_low * total - tol
    high_ok = prob.memory_high is None or sum(
        float(prob.param_bytes[g][allowed[g]].max()) for g in prob.param_groups) <= prob.memory_high * total + tol
    return pruned, not (low_ok and high_ok)


def budget_bytes(prob: Problem) -> tuple[float, float]:
    """(least, most) parameter bytes a plan may hold: the budget with BUDGET_SLACK of the total."""
    total = prob.total_param_bytes
    tol = BUDGET_SLACK * total
    return (-np.inf if prob.memory_low is None else prob.memory_low * total - tol,
            np.inf if prob.memory_high is None else prob.memory_high * total + tol)


def budget_holds(prob: Problem, labels: dict[int, int] | list[int]) -> bool:
    """Whether the plan's parameter bytes meet the budget (and the recomputation choice's
    memory row, when the problem has one)."""
    if not row_holds(prob, labels):
        return False
    if not memory_constrained(prob):
        return True
    least, most = budget_bytes(prob)
    used = sum(float(prob.param_bytes[g][labels[g]]) for g in prob.param_groups)
    return least <= used <= most


def prune_by_reduced_cost(prob: Problem, x_cols: dict[int, tuple[np.ndarray, int]], lp_value: np.ndarray,
                          reduced_cost: np.ndarray, lp_bound: float, incumbent: float) -> tuple[Problem, int]:
    """`prob` without the strategies whose LP reduced cost exceeds incumbent - bound, and how many went.

    For a plan z, objective(z) >= bound + sum of the reduced costs of the x that z sets to 1
    among those at 0 in the LP (duality). A strategy whose reduced cost alone exceeds
    the gap is therefore in no plan as good as the incumbent: dropping it keeps every
    optimum. The margin covers the LP's tolerances.
    """
    gap = incumbent - lp_bound + 1e-6 * max(1.0, abs(incumbent))
    allowed = [a.copy() for a in prob.allowed]
    dropped = 0
    for g, (idx, first) in x_cols.items():
        rc, val = reduced_cost[first:first + len(idx)], lp_value[first:first + len(idx)]
        drop = (rc > gap) & (val < 1e-9)
        if drop.all():
            continue  # cannot happen with a valid incumbent; keep the group solvable regardless
        allowed[g][idx[drop]] = False
        dropped += int(drop.sum())
    return dataclasses.replace(prob, allowed=allowed), dropped
