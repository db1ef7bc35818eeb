"""The placement Problem solved as a pairwise MRF (paper §4.3), with the parameter budget.

* fully sharded budget (the default): every parameter group keeps only its most-sharded
  strategies, which makes the budget hold whatever else is chosen; the rest is a pure MRF;
* a looser budget: a Lagrangian penalty on parameter bytes (bisection on the multiplier),
  then a budget-keeping local search;
* after TRW-S + local search (solve/mrf.py): axis-role permutations (global moves) and a
  joint re-solve of the repeated layers with the rest of the graph fixed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from parallel.auto.candidates.placements import strategy_key
from parallel.auto.problem.placement_problem import PlanningError, Problem
from parallel.auto.problem.recompute import row_holds
from parallel.auto.solve.mrf import (
    FORBIDDEN,
    MRFSolution,
    PairwiseMRF,
    block_resolve,
    budgeted_search,
    coordinate_descent,
    local_search,
    solve_mrf,
)
from parallel.auto.solve.solution import Solution
from parallel.auto.trace.joint import layer_prefix

log = logging.getLogger("parallel.auto.solve")


# ---------------------------------------------------------------------------
# Problem -> pairwise MRF
# ---------------------------------------------------------------------------


def _param_masks(prob: Problem) -> dict[int, np.ndarray]:
    """Per parameter group: its strategies of least local bytes (fully sharded)."""
    out = {}
    for g in prob.param_groups:
        b = np.where(prob.allowed[g], prob.param_bytes[g], np.inf)
        out[g] = prob.allowed[g] & (b <= b.min() * (1 + 1e-9))
    return out


def _memory_fraction(prob: Problem, labels: list[int]) -> float:
    if not prob.total_param_bytes:
        return 0.0
    return sum(float(prob.param_bytes[g][labels[g]]) for g in prob.param_groups) / prob.total_param_bytes


def _within(prob: Problem, frac: float) -> bool:
    hi = prob.memory_high
    lo = prob.memory_low
    return (hi is None or frac <= hi * (1 + 1e-9) + 1e-12) and (lo is None or frac >= lo * (1 - 1e-9) - 1e-12)


class ReducedMRF:
    """The Problem as a PairwiseMRF over allowed, non-dominated strategies.

    Labels of a group are its allowed strategies; two strategies whose placement classes
    agree on every incident edge differ only in their unary cost, so only the cheaper is
    kept (exact). `labels_to_strategies` maps an MRF assignment back to strategy indices.
    """

    def __init__(self, prob: Problem, allowed: list[np.ndarray], extra_unary: dict[int, np.ndarray] | None = None):
        self.prob = prob
        n = prob.num_groups
        incident: list[list[tuple[int, bool]]] = [[] for _ in range(n)]  # (edge index, as source)
        for ei, e in enumerate(prob.edges):
            incident[e.src].append((ei, True))
            incident[e.dst].append((ei, False))
        self.keep: list[np.ndarray] = []
        self.label_of: list[dict[int, int]] = []  # allowed strategy -> label (of its signature)
        unary = []
        for g in range(n):
            u = prob.unary[g] + (extra_unary[g] if extra_unary and g in extra_unary else 0.0)
            idx = np.flatnonzero(allowed[g] & np.isfinite(u))
            if idx.size == 0:
                raise PlanningError(f"node {prob.groups[g][0]} has no allowed strategy")
            sig = [tuple(int(prob.edges[ei].src_cls[s] if as_src else prob.edges[ei].dst_cls[s])
                         for ei, as_src in incident[g]) for s in idx]
            best: dict[tuple, int] = {}
            for s, k in zip(idx, sig):
                b = best.get(k)
                if b is None or u[s] < u[b]:
                    best[k] = int(s)
            keep = np.array(sorted(best.values()), dtype=np.int64)
            pos = {int(x): i for i, x in enumerate(keep)}
            self.label_of.append({int(s): pos[best[k]] for s, k in zip(idx, sig)})
            self.keep.append(keep)
            unary.append(u[keep])
        self.mrf = PairwiseMRF.from_unary(unary)
        count: dict[tuple[int, int], int] = {}
        for e in prob.edges:
            ks, kd = self.keep[e.src], self.keep[e.dst]
            self.mrf.add_pairwise(e.src, e.dst, e.cost[np.ix_(e.src_cls[ks], e.dst_cls[kd])])
            pair = (min(e.src, e.dst), max(e.src, e.dst))
            count[pair] = count.get(pair, 0) + 1
            if count[pair] == 1:  # class structure for fast messages (only for single-edge pairs)
                self.mrf.set_factor(e.src, e.dst, e.cost, e.src_cls[ks], e.dst_cls[kd])
            else:
                self.mrf.factors.pop(pair, None)

    def labels_to_strategies(self, labels: np.ndarray) -> list[int]:
        """Strategy index per group of an MRF assignment (each label is its signature's cheapest strategy)."""
        return [int(self.keep[g][int(a)]) for g, a in enumerate(labels)]

    def strategies_to_labels(self, strategies: list[int], default: np.ndarray | None = None) -> np.ndarray | None:
        """Labels of a strategy assignment (a dominated strategy maps to its cheaper twin);
        strategies that are not allowed take `default`'s label, or give None."""
        out = []
        for g, s in enumerate(strategies):
            lab = self.label_of[g].get(int(s))
            if lab is None:
                if default is None:
                    return None
                lab = int(default[g])
            out.append(lab)
        return np.array(out, dtype=np.int64)

    def num_labels(self) -> int:
        """Labels left after dominance pruning, over all groups (the MRF's size)."""
        return int(sum(k.size for k in self.keep))


def _axis_permutations(ndim: int) -> list[tuple[int, ...]]:
    ident = tuple(range(ndim))
    if ndim <= 3:
        return [p for p in itertools.permutations(ident) if p != ident]
    out = []
    for i, j in itertools.combinations(range(ndim), 2):
        p = list(ident)
        p[i], p[j] = p[j], p[i]
        out.append(tuple(p))
    return out


def permute_axes(prob: Problem, strategies: list[int], perm: tuple[int, ...], _cache: dict | None = None) -> list[int]:
    """The assignment with mesh-axis roles permuted: axis i takes what axis perm[i] had.

    A global move no local search can make (e.g. tensor parallel on the other axis of a
    2-D mesh: every op of every layer switches at once). Strategies without a permuted
    twin in their menu (uneven shards on the other axis size) keep their index.
    """
    cache = {} if _cache is None else _cache
    nodes = prob.candidates.nodes
    out = []

    def perm_pl(pl: object) -> object:
        if pl is None:
            return None
        if pl and isinstance(pl[0], tuple):
            return tuple(perm_pl(x) for x in pl)
        return tuple(pl[perm[i]] for i in range(len(pl)))

    for g, s in enumerate(strategies):
        c = nodes.get(prob.groups[g][0])
        if c is None:  # the recomputation choice: no placements to permute
            out.append(s)
            continue
        index = cache.get(id(c.specs))
        if index is None:
            index = cache[id(c.specs)] = {strategy_key(sp): j for j, sp in enumerate(c.specs)}
        o, ins = strategy_key(c.specs[s])
        key = (perm_pl(o), tuple(perm_pl(i) for i in ins))
        out.append(index.get(key, s))
    return out


def _repair_within_budget(prob: Problem, allowed: list[np.ndarray], strategies: list[int]) -> tuple[list[int], float]:
    """Budget-keeping local search from a plan inside the budget (closes the Lagrangian's
    duality gap: the budget often lies between two of its plans)."""
    red = ReducedMRF(prob, allowed)
    before = prob.energy(strategies)
    start = red.strategies_to_labels(strategies)
    if start is None:
        return strategies, before
    total = prob.total_param_bytes
    weight = {g: prob.param_bytes[g][red.keep[g]] / total for g in prob.param_groups}
    labels = red.labels_to_strategies(budgeted_search(red.mrf, start, weight, prob.memory_low, prob.memory_high))
    after = prob.energy(labels)
    # the search keeps the budget; the check guards the mapping back from dominance-pruned labels
    if after < before and _within(prob, _memory_fraction(prob, labels)):
        log.info("mrf: budgeted local search %.1f -> %.1f µs", before, after)
        return labels, after
    return strategies, before


def repeated_layer_groups(prob: Problem) -> list[int]:
    """Groups computed inside numbered submodules (the entries of an nn.ModuleList: the
    repeated transformer layers), forward and backward."""
    module_of = getattr(prob.candidates.graph, "module_of", {}) or {}
    return [g for g, members in enumerate(prob.groups) if layer_prefix(module_of.get(members[0], "")) is not None]


def _min_param_fraction(prob: Problem, masks: dict[int, np.ndarray]) -> float:
    """Share of parameter bytes per device with every parameter group at its most sharded."""
    if not prob.total_param_bytes:
        return 0.0
    return sum(float(prob.param_bytes[g][masks[g]].max()) for g in prob.param_groups) / prob.total_param_bytes


def _sharded_only(prob: Problem, base: list[np.ndarray], masks: dict[int, np.ndarray]) -> list[np.ndarray]:
    """`base` with every parameter group restricted to its fully sharded strategies."""
    return [base[g] & masks[g] if g in masks else base[g] for g in range(prob.num_groups)]


def _improves(e: float, energy: float) -> bool:
    """Whether `e` beats `energy` by more than rounding."""
    return e < energy - 1e-9 * max(1.0, abs(energy))


def _try_axis_permutations(prob: Problem, red: ReducedMRF, sol: MRFSolution) -> None:
    """Axis-role swaps: global moves out of a consistent but wrong mode (updates `sol` when one wins).

    Every permutation is screened cheaply (coordinate descent); only the best gets a full local search.
    """
    cache: dict = {}
    base_labels = sol.labels
    base_strats = red.labels_to_strategies(base_labels)
    best_perm = None
    for perm in _axis_permutations(len(prob.candidates.mesh.shape)):
        lab = red.strategies_to_labels(permute_axes(prob, base_strats, perm, cache), default=base_labels)
        lab = coordinate_descent(red.mrf, lab)
        e = red.mrf.energy(lab)
        if best_perm is None or e < best_perm[0]:
            best_perm = (e, lab, perm)
    if best_perm is not None and best_perm[0] < sol.energy * 1.05:
        lab = local_search(red.mrf, best_perm[1])
        e = red.mrf.energy(lab)
        if _improves(e, sol.energy):
            log.info("mrf: axis permutation %s improves %.1f -> %.1f", best_perm[2], sol.energy, e)
            sol.labels, sol.energy = lab, e


@dataclass(frozen=True)
class MRFEffort:
    """How hard the MRF solver works: TRW-S stops after `patience` sweeps without a better
    plan; `polish` re-solves the repeated layers jointly with the rest fixed afterwards."""

    patience: int = 60
    polish: bool = True

    @classmethod
    def of(cls, planner: Any) -> "MRFEffort":
        """The effort a PlannerConfig asks for (its mrf_patience and mrf_polish)."""
        return cls(planner.mrf_patience, planner.mrf_polish)


@dataclass
class _Runner:
    """One MRF solve of the Problem under a strategy mask and a Lagrangian multiplier on parameter bytes."""

    prob: Problem
    layers: list[int]  # the repeated layers' groups, re-solved jointly when polishing
    max_sweeps: int
    time_budget: float | None
    effort: MRFEffort = MRFEffort()

    def __call__(self, allowed: list[np.ndarray], lam: float = 0.0, polish: bool = False) -> tuple[list[int], float]:
        """(strategy per group, objective) of the best plan found."""
        prob = self.prob
        extra = None
        if lam:
            extra = {g: lam * prob.param_bytes[g] / prob.total_param_bytes for g in prob.param_groups}
        red = ReducedMRF(prob, allowed, extra)
        sol = solve_mrf(red.mrf, max_sweeps=self.max_sweeps, time_budget=self.time_budget,
                        patience=self.effort.patience)
        if len(prob.candidates.mesh.shape) > 1:
            _try_axis_permutations(prob, red, sol)
        if polish and self.effort.polish and self.layers and len(self.layers) < prob.num_groups:
            lab = block_resolve(red.mrf, sol.labels, self.layers, time_budget=self.time_budget,
                                patience=self.effort.patience)
            e = red.mrf.energy(lab)
            if _improves(e, sol.energy):
                log.info("mrf: re-solving the repeated layers with the rest fixed improves %.1f -> %.1f", sol.energy, e)
                sol.labels, sol.energy = lab, e
        if sol.energy >= FORBIDDEN:
            raise PlanningError("the MRF solver found no feasible assignment (every plan needs a forbidden "
                                "redistribution, e.g. Replicate -> Partial); check the constraints")
        labels = red.labels_to_strategies(sol.labels)
        return labels, prob.energy(labels)


def _lagrangian(prob: Problem, run: _Runner, base: list[np.ndarray], masks: dict[int, np.ndarray],
                over: bool, obj: float, bisection_steps: int) -> tuple[list[int], float]:
    """Best plan within the budget from a bisection on the multiplier of a parameter-byte penalty.

    `over`: the unpenalised plan is above the budget (the penalty pushes bytes down, else up);
    `obj`: its objective, the bisection's first upper end. The fully sharded plan is the fallback
    (always feasible).
    """
    best = run(_sharded_only(prob, base, masks))
    lo, hi = 0.0, max(1.0, obj)
    sign = 1.0 if over else -1.0
    for _ in range(bisection_steps):
        lam = (lo + hi) / 2 if hi < math.inf else lo * 2
        cand = run(base, sign * lam)
        if _within(prob, _memory_fraction(prob, cand[0])):
            hi = lam
            if cand[1] < best[1]:
                best = cand
        else:
            lo = lam
    return best


def _from_start(prob: Problem, allowed: list[np.ndarray], start: list[int]) -> tuple[list[int], float] | None:
    """A neighbouring plan's strategies improved by local search, kept within the budget
    (None: the start breaks the budget or uses a strategy `allowed` forbids)."""
    if not _within(prob, _memory_fraction(prob, start)):
        return None
    red = ReducedMRF(prob, allowed)
    lab = red.strategies_to_labels(start)
    if lab is None:
        return None
    polished = red.labels_to_strategies(local_search(red.mrf, lab))
    if _within(prob, _memory_fraction(prob, polished)):
        return polished, prob.energy(polished)
    return _repair_within_budget(prob, allowed, list(start))


ROW_STEPS = 8
"""MRF solves at most spent finding a multiplier that keeps the recomputation row (by four each)."""
BISECTION_STEPS = 2
"""Then solves halving towards the smallest such multiplier (the mix of options is read off
after, `_best_option`, so a coarse multiplier suffices)."""


def _priced_activations(prob: Problem, lam: float) -> Problem:
    """`prob` with `lam` µs per byte of the row: kept activations on the recomputation edges,
    model states on the parameter groups."""
    edges = [dataclasses.replace(e, cost=e.cost + lam * e.memory) if e.kind == "recompute" and e.memory is not None
             else e for e in prob.edges]
    unary = list(prob.unary)
    for g in prob.param_groups:
        unary[g] = unary[g] + lam * prob.recompute.row.state_factor * prob.param_bytes[g]
    return dataclasses.replace(prob, edges=edges, unary=unary)


def _solve_with_row(prob: Problem, solve: Any) -> Solution:
    """The recomputation choice's memory row by a multiplier on kept activation bytes (the
    paper's treatment of the parameter budget, §4.3): double it until the plan keeps the
    row, then bisect; the best plan that keeps it, by the true objective."""
    sol = solve(prob)
    if row_holds(prob, sol.labels):
        return sol
    lo, hi, lam = 0.0, None, max(sol.objective, 1.0) / max(prob.recompute.row.limit, 1.0)
    best: Solution | None = None

    def attempt(lam: float) -> bool:
        nonlocal best
        found = solve(_priced_activations(prob, lam))
        if not row_holds(prob, found.labels):
            return False
        objective = prob.energy(found.labels)
        if best is None or objective < best.objective:
            best = dataclasses.replace(found, objective=objective)
        return True

    for _ in range(ROW_STEPS):  # doubling (by four) until the row holds
        if attempt(lam):
            hi = lam
            break
        lo, lam = lam, lam * 4
    if hi is None or best is None:
        raise PlanningError("the MRF found no plan whose kept activations and model states fit the memory row")
    for _ in range(BISECTION_STEPS):  # then bisection: a smaller multiplier recomputes less
        lam = (lo + hi) / 2
        if attempt(lam):
            hi = lam
        else:
            lo = lam
    log.info("mrf: recomputation row kept with a multiplier of %.3g µs/byte", hi)
    return _best_option(prob, best)


def _best_option(prob: Problem, sol: Solution) -> Solution:
    """The plan's placements with the recomputation option that is fastest within the row.
    A multiplier prices the k-th option's bytes and time alike for every k, so it lands on
    an end of a run of mixes (all blocks kept, all per-op): the mix between is read off here."""
    g, labels = prob.recompute.group, list(sol.labels)
    best, best_e = labels[g], sol.objective
    for a in range(len(prob.recompute.options)):
        labels[g] = a
        if row_holds(prob, labels):
            e = prob.energy(labels)
            if e < best_e - 1e-9 * max(1.0, abs(best_e)):
                best, best_e = a, e
    labels[g] = best
    return dataclasses.replace(sol, labels=labels, objective=best_e)


def solve_problem_mrf(prob: Problem, *, max_sweeps: int = 1000, bisection_steps: int = 12,
                      time_budget: float | None = 60.0, start: list[int] | None = None,
                      effort: MRFEffort = MRFEffort()) -> Solution:
    """Solve `prob` as a pairwise MRF (paper §4.3), honouring the parameter-memory budget
    (and the recomputation choice's memory row, when the problem has one). `start` (a
    neighbouring plan's strategies, a warm start) is improved by local search too; the
    better of the two plans is returned."""
    if prob.recompute is not None and prob.recompute.limited:
        return _solve_with_row(prob, lambda p: _solve_unrowed(p, max_sweeps, bisection_steps, time_budget, start,
                                                              effort))
    return _solve_unrowed(prob, max_sweeps, bisection_steps, time_budget, start, effort)


def _solve_unrowed(prob: Problem, max_sweeps: int, bisection_steps: int, time_budget: float | None,
                   start: list[int] | None, effort: MRFEffort = MRFEffort()) -> Solution:
    t0 = time.perf_counter()
    run = _Runner(prob, repeated_layer_groups(prob), max_sweeps, time_budget, effort)
    base = [a.copy() for a in prob.allowed]
    masks = _param_masks(prob)
    min_frac = _min_param_fraction(prob, masks)
    tight = prob.memory_high is not None and min_frac >= prob.memory_high * (1 - 1e-9)
    if prob.memory_high is not None and min_frac > prob.memory_high * (1 + 1e-9):
        raise PlanningError(f"parameters need at least {min_frac:.4g} of their bytes per device, "
                            f"above high={prob.memory_high:.4g}")
    allowed = _sharded_only(prob, base, masks) if tight or not prob.param_groups else base
    if tight or not prob.param_groups:
        # fully sharded parameters (paper §4.3): storage is fixed, the rest is a pure MRF
        labels, obj = run(allowed, polish=True)
        how = "parameters fully sharded"
    else:
        labels, obj = run(base, polish=True)
        how = "memory budget not binding"
        frac = _memory_fraction(prob, labels)
        if not _within(prob, frac):
            over = prob.memory_high is not None and frac > prob.memory_high
            best = _lagrangian(prob, run, base, masks, over, obj, bisection_steps)
            labels, obj = _repair_within_budget(prob, base, best[0])
            how = "memory budget by Lagrangian bisection + budgeted local search"
    warm = _from_start(prob, allowed, start) if start is not None else None
    if warm is not None:
        log.info("mrf: warm start %.1f µs against %.1f µs", warm[1], obj)
        if _improves(warm[1], obj):
            labels, obj = warm
    seconds = time.perf_counter() - t0
    n_labels = int(sum(a.sum() for a in prob.allowed))
    log.info("mrf: objective %.1f µs (%s), %d groups, %.2fs", obj, how, prob.num_groups, seconds)
    return Solution(labels, obj, "mrf", "approximate", seconds, n_labels, len(prob.edges))
