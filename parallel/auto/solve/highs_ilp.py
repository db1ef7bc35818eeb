"""The exact ILP on HiGHS: LP bound, a plan from it, reduced-cost pruning, then the integer program.

HiGHS alone spends most of an 8B 4x8 solve (11 s of 12) in MIP presolve, probing and
heuristics before it meets a plan as good as the one that rounding the LP relaxation and
a local search give in 1 s. So:

1. solve the LP relaxation (its value bounds every plan from below);
2. round it (each group's largest x) and improve by single-group moves: the incumbent;
3. drop every strategy whose reduced cost exceeds incumbent - bound (presolve.py: exact)
   and eliminate again on what is left;
4. solve the smaller integer program (HiGHS presolve off: it costs more than it saves
   here), to a zero gap; the incumbent is the answer should the time limit expire first.

When the incumbent meets the bound, step 4 is skipped: the plan is proven optimal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import highspy
import numpy as np

from parallel.auto.problem.feasibility import check_feasible
from parallel.auto.problem.placement_problem import PlanningError, Problem
from parallel.auto.problem.recompute import RowTracker
from parallel.auto.solve.highs_model import ArrayModel, PeakRow, build_array_model, read_labels, to_highs_lp
from parallel.auto.solve.presolve import (
    Reduced,
    budget_bytes,
    budget_holds,
    prune_by_reduced_cost,
    prune_to_budget,
)
from parallel.auto.solve.solution import Solution

log = logging.getLogger("parallel.auto.solve.ilp")

_OPTIMAL_GAP = 1e-9
"""Relative gap under which the incumbent counts as proven optimal."""


@dataclass
class _Stage:
    """A reduced problem and its integer program."""

    prob: Problem
    red: Reduced
    model: ArrayModel

    @classmethod
    def of(cls, prob: Problem, memory: bool, eliminate: bool) -> "_Stage":
        protect = (set(prob.param_groups) if memory else set()) | peak_groups(prob)
        red = Reduced(prob, protect if eliminate else set(range(prob.num_groups)))
        alive = [g for g in range(prob.num_groups) if red.alive[g]]
        budget = ({g: prob.param_bytes[g] for g in prob.param_groups}, prob.total_param_bytes,
                  prob.memory_low, prob.memory_high) if memory else None
        ids = sorted(red.edges)
        edges = [red.edges[i] for i in ids]
        return cls(prob, red, build_array_model(red.unary, edges, alive, budget, _peak_row(prob, ids)))

    def full_labels(self, labels: dict[int, int]) -> list[int]:
        out: list[int | None] = [None] * self.prob.num_groups
        for g, s in labels.items():
            out[g] = s
        return self.red.recover(out)


def peak_groups(prob: Problem) -> set[int]:
    """Groups in the recomputation choice's memory row: kept from elimination (which is
    exact for the objective only)."""
    choice = prob.recompute
    if choice is None or not choice.limited:
        return set()
    kept = {e.src for e in prob.edges if e.kind == "recompute" and e.memory is not None and e.memory.any()}
    return kept | set(prob.param_groups) | {choice.group}


def _peak_row(prob: Problem, ids: list[int]) -> PeakRow | None:
    """The memory row over the reduced problem's edges (`ids`: their ids; the original edges
    keep theirs, and an edge of the row joins two protected groups, so it is never merged)."""
    choice = prob.recompute
    if choice is None or not choice.limited:
        return None
    n = len(prob.edges)
    edge_bytes = {pos: prob.edges[i].memory for pos, i in enumerate(ids)
                  if i < n and prob.edges[i].kind == "recompute" and prob.edges[i].memory is not None}
    factor = choice.row.state_factor
    return PeakRow(edge_bytes, {g: factor * prob.param_bytes[g] for g in prob.param_groups}, choice.row.limit)


def _highs(model: ArrayModel, *, integer: bool, time_limit: float | None, verbose: bool) -> highspy.Highs:
    """A solved HiGHS instance: single-threaded and seeded, so a plan does not depend on the run."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", verbose)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    if time_limit is not None:
        h.setOptionValue("time_limit", max(0.01, float(time_limit)))
    if integer:
        h.setOptionValue("presolve", "off")
        h.setOptionValue("mip_rel_gap", 0.0)
    h.passModel(to_highs_lp(model, integer=integer))
    h.run()
    return h


def _has_solution(h: highspy.Highs) -> bool:
    return h.getInfo().primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible


def _local_search(stage: _Stage, labels: dict[int, int], memory: bool, rounds: int = 50) -> dict[int, int]:
    """Single-group moves (each group to its best strategy given its neighbours) until none
    improves; a parameter group's move must keep the budget."""
    prob, red = stage.prob, stage.red
    adj: dict[int, list] = {g: [] for g in labels}
    for e in red.edges.values():
        adj[e.u].append(e)
        adj[e.v].append(e)
    params = set(prob.param_groups) if memory else set()
    least, most = budget_bytes(prob)
    used = sum(float(prob.param_bytes[g][labels[g]]) for g in params)
    row = RowTracker(prob, labels) if prob.recompute is not None and prob.recompute.limited else None
    for _ in range(rounds):
        changed = False
        for g, (idx, _first) in stage.model.x_cols.items():
            cost = red.unary[g][idx].copy()
            for e in adj[g]:
                cost += e.cost[e.cu[idx], e.cv[labels[e.v]]] if e.u == g else e.cost[e.cu[labels[e.u]], e.cv[idx]]
            if g in params:
                after = used - float(prob.param_bytes[g][labels[g]]) + prob.param_bytes[g][idx]
                cost = np.where((after >= least) & (after <= most), cost, np.inf)
            row_after = row.after(g, idx, labels) if row is not None and g in row.groups else None
            if row_after is not None:  # never further over the row than now
                cost = np.where(row_after <= max(row.limit, row.value) * (1 + 1e-9), cost, np.inf)
            here = int(np.searchsorted(idx, labels[g]))
            best = int(np.argmin(cost))
            if np.isfinite(cost[best]) and (not np.isfinite(cost[here])
                                            or cost[best] < cost[here] - 1e-9 * max(1.0, abs(cost[here]))):
                if g in params:
                    used += float(prob.param_bytes[g][idx[best]] - prob.param_bytes[g][labels[g]])
                if row_after is not None:
                    row.value = float(row_after[best])
                labels[g] = int(idx[best])
                changed = True
        if not changed:
            break
    return labels


def _repair_row(prob: Problem, labels: dict[int, int]) -> dict[int, int]:
    """A rounding over the recomputation row moved to the first option that recomputes
    enough (options go from none to every block full), so the local search starts inside it."""
    choice = prob.recompute
    if choice is None or not choice.limited or choice.group not in labels:
        return labels
    for a in range(labels[choice.group], len(choice.options)):
        labels[choice.group] = a
        if RowTracker(prob, labels).value <= choice.row.limit:
            break
    return labels


def _infeasible(prob: Problem) -> PlanningError:
    check_feasible(prob)  # names the conflicting constraints when it can
    return PlanningError("the ILP is infeasible under the given constraints: "
                         + ("; ".join(c.description for c in prob.constraints) or "(no user constraints)"))


def _from_start(stage: _Stage, budgeted: Problem, start: list[int], rounded: dict[int, int],
                memory: bool) -> tuple[dict[int, int], float] | None:
    """A warm start as a stage incumbent: its strategies on the surviving groups (the LP's
    rounding where a strategy was eliminated as dominated), improved by the same local search,
    with its objective; None when it breaks the parameter budget."""
    labels = {}
    for g, (idx, _first) in stage.model.x_cols.items():
        s = int(start[g])
        pos = int(np.searchsorted(idx, s))
        labels[g] = s if pos < len(idx) and int(idx[pos]) == s else rounded[g]
    labels = _local_search(stage, labels, memory)
    full = stage.full_labels(labels)
    value = budgeted.energy(full)
    if not budget_holds(budgeted, full) or not np.isfinite(value):
        return None
    return labels, value


def solve_highs(prob: Problem, *, time_limit: float | None = 600.0, verbose: bool = False,
                eliminate: bool = True, start: list[int] | None = None) -> Solution:
    """Solve `prob` exactly with HiGHS (up to the time limit, whose expiry is reported in `status`).

    `start`: a strategy per group from a neighbouring problem's plan (a sweep's previous
    point): a second incumbent beside the LP's rounding. The better one decides whether the
    bound is already met and how many strategies the reduced costs prune; the optimum is the
    same with or without it."""
    t0 = time.perf_counter()

    def left() -> float | None:
        return None if time_limit is None else time_limit - (time.perf_counter() - t0)

    budgeted, memory = prune_to_budget(prob)
    first = _Stage.of(budgeted, memory, eliminate)
    m = first.model
    if not m.x_cols:  # elimination solved it
        return _solution(prob, first, {}, "optimal", t0)
    log.info("ilp: %d vars (%d strategy, %d edge) over %d of %d groups after elimination, %d constraints, "
             "built in %.2fs; LP relaxation with highs", m.num_cols, m.num_cols - m.num_edge_vars, m.num_edge_vars,
             len(m.x_cols), prob.num_groups, m.num_rows, time.perf_counter() - t0)
    relax = _highs(m, integer=False, time_limit=left(), verbose=verbose)
    status = relax.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise _infeasible(prob)
    stage, incumbent, inc_value = first, None, float("inf")
    if status == highspy.HighsModelStatus.kOptimal:
        sol = relax.getSolution()
        value, reduced_cost = np.asarray(sol.col_value), np.asarray(sol.col_dual)
        bound = relax.getInfo().objective_function_value
        rounded = read_labels(m, value)
        labels = _local_search(first, _repair_row(prob, dict(rounded)), memory)
        full = first.full_labels(labels)
        value_of = prob.energy(full)
        if budget_holds(budgeted, full) and np.isfinite(value_of):  # a rounding may use a forbidden pair
            incumbent, inc_value = labels, value_of
        warm = _from_start(first, budgeted, start, rounded, memory) if start is not None else None
        if warm is not None:
            log.info("ilp: warm start %.1f µs against the LP's rounding %.1f µs", warm[1], inc_value)
            if incumbent is None or warm[1] < inc_value - 1e-9 * max(1.0, abs(inc_value)):
                incumbent, inc_value = warm
        if incumbent is not None:
            log.info("ilp: LP bound %.1f µs, plan from it %.1f µs (gap %.3f%%), %.2fs", bound, inc_value,
                     100 * (inc_value - bound) / max(abs(inc_value), 1e-12), time.perf_counter() - t0)
            if inc_value - bound <= _OPTIMAL_GAP * max(1.0, abs(inc_value)):
                return _solution(prob, first, incumbent, "optimal", t0)
            pruned, dropped = prune_by_reduced_cost(budgeted, m.x_cols, value, reduced_cost, bound, inc_value)
            stage = _Stage.of(pruned, memory, eliminate)
            if not stage.model.x_cols:
                return _solution(prob, stage, {}, "optimal", t0)
            log.info("ilp: %d strategies cannot beat it (reduced cost); integer program on %d vars, %d groups",
                     dropped, stage.model.num_cols, len(stage.model.x_cols))
    incumbent_plan = None if incumbent is None else (inc_value, first, incumbent)
    return _finish_with_mip(prob, budgeted, stage, incumbent_plan, t0, time_limit=time_limit, left=left(),
                            verbose=verbose)


def _finish_with_mip(prob: Problem, budgeted: Problem, stage: _Stage,
                     best: tuple[float, _Stage, dict[int, int]] | None, t0: float, *,
                     time_limit: float | None, left: float | None, verbose: bool) -> Solution:
    """The integer program on `stage` (what the LP left open), against the LP's incumbent `best`:
    the better plan that keeps the budget, "optimal" when HiGHS proved it."""
    mip = _highs(stage.model, integer=True, time_limit=left, verbose=verbose)
    status = mip.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible and best is None:
        raise _infeasible(prob)
    proven = status == highspy.HighsModelStatus.kOptimal
    if _has_solution(mip):
        labels = read_labels(stage.model, np.asarray(mip.getSolution().col_value))
        full = stage.full_labels(labels)
        if budget_holds(budgeted, full):
            found = prob.energy(full)
            if best is None or found <= best[0]:
                best = (found, stage, labels)
    if best is not None:
        return _solution(prob, best[1], best[2], "optimal" if proven else "time_limit", t0)
    raise PlanningError(f"the highs solver found no solution (status {mip.modelStatusToString(status)}, "
                        f"time limit {time_limit}s): raise the time limit or relax the constraints")


def _solution(prob: Problem, stage: _Stage, labels: dict[int, int], status: str, t0: float) -> Solution:
    full = stage.full_labels(labels)
    seconds = time.perf_counter() - t0
    sol = Solution(full, prob.energy(full), "highs", status, seconds, stage.model.num_cols, stage.model.num_rows)
    if status != "optimal":
        log.warning("ilp: the time limit expired; the plan is feasible but not proven optimal")
    log.info("ilp: objective %.1f µs, status %s, %.2fs", sol.objective, sol.status, seconds)
    return sol
