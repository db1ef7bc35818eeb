"""The recomputation choice inside the solve (problem/recompute.py), on small random
problems against exhaustive enumeration: the exact ILP finds the enumerated optimum under
the memory row, the MRF's multiplier finds a plan that keeps the row, and both pick more
recomputation as the row's limit falls. Enumeration shares nothing with the solvers but
`Problem.energy` and the row's own value."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from parallel.auto.problem.placement_problem import Edge, Problem
from parallel.auto.problem.recompute import RECOMPUTE_GROUP, RecomputeChoice, RecomputeRow, row_bytes
from parallel.auto.solve.ilp import solve_ilp
from parallel.auto.solve.presolve import budget_holds
from parallel.auto.solve.problem_mrf import solve_problem_mrf

OPTIONS = [("none", "none"), ("op", "none"), ("op", "op"), ("full", "op"), ("full", "full")]


def _problem(seed: int, limit: float | None, n: int = 6, k: int = 3) -> Problem:
    """n placement groups (a chain) and the choice group; each placement group recomputes
    more and keeps fewer bytes the further down the options (as a block does), its strategy
    scaling both (a sharded op recomputes and keeps less)."""
    rng = np.random.default_rng(seed)
    unary = [rng.uniform(0, 10, k) for _ in range(n)]
    edges = []
    for g in range(n - 1):
        ca, cb = rng.integers(0, 2, k), rng.integers(0, 2, k)
        edges.append(Edge(g, g + 1, ca, cb, [], [], rng.uniform(0, 20, (2, 2))))
    level = np.arange(len(OPTIONS), dtype=float)
    for g in range(n):
        scale = rng.uniform(0.5, 2.0, k)  # per strategy: a sharded op is cheaper in both
        cost = np.outer(scale, level * rng.uniform(1, 3))
        memory = np.outer(scale, (len(OPTIONS) - level) * rng.uniform(10, 30))
        edges.append(Edge(g, n, np.arange(k), np.arange(len(OPTIONS)), [], [], cost, kind="recompute",
                          memory=memory))
    params = {0: rng.uniform(5, 20, k), 3: rng.uniform(5, 20, k)}
    names = [f"n{g}" for g in range(n)] + [RECOMPUTE_GROUP]
    choice = RecomputeChoice(n, OPTIONS, {}, RecomputeRow(limit, state_factor=2.0))
    cands = SimpleNamespace(graph=SimpleNamespace(module_of={}), mesh=SimpleNamespace(shape=(4,)))  # 1-D: the MRF
    return Problem(candidates=cands, cost_model=None, groups=[[x] for x in names],
                   group_of={x: g for g, x in enumerate(names[:-1])}, n_strategies=[k] * n + [len(OPTIONS)],
                   unary=unary + [np.zeros(len(OPTIONS))], compute={}, edges=edges,
                   allowed=[np.ones(k, dtype=bool) for _ in range(n)] + [np.ones(len(OPTIONS), dtype=bool)],
                   param_groups=sorted(params), param_bytes=params, total_param_bytes=float(sum(p.max() for p in
                                                                                                params.values())),
                   memory_low=None, memory_high=None, constraints=[], recompute=choice)


def _enumerated(prob: Problem) -> tuple[float, list[int] | None]:
    best, arg = np.inf, None
    for labels in itertools.product(*(range(k) for k in prob.n_strategies)):
        if budget_holds(prob, list(labels)):
            e = prob.energy(list(labels))
            if e < best:
                best, arg = e, list(labels)
    return best, arg


def _limits(seed: int) -> list[float]:
    """Row limits from loose (everything kept fits) to tight (only near-full recomputation)."""
    prob = _problem(seed, None)
    values = [row_bytes(prob, lab) for lab in itertools.product(*(range(k) for k in prob.n_strategies))]
    lo, hi = min(values), max(values)
    return [hi * 1.01, lo + 0.5 * (hi - lo), lo + 0.15 * (hi - lo), lo * 1.02]


@pytest.mark.parametrize("seed", range(4))
def test_ilp_finds_the_enumerated_optimum_under_the_row(seed):
    for limit in _limits(seed):
        prob = _problem(seed, limit)
        best, arg = _enumerated(prob)
        sol = solve_ilp(prob, solver="highs")
        assert sol.optimal and budget_holds(prob, sol.labels)
        assert row_bytes(prob, sol.labels) <= limit * (1 + 1e-9)
        assert sol.objective == pytest.approx(best, rel=1e-9), (limit, sol.labels, arg)


@pytest.mark.parametrize("seed", range(4))
def test_lower_limits_recompute_more_in_both_solvers(seed):
    chosen = {"ilp": [], "mrf": []}
    for limit in _limits(seed):
        prob = _problem(seed, limit)
        for name, sol in (("ilp", solve_ilp(prob, solver="highs")), ("mrf", solve_problem_mrf(prob))):
            assert row_bytes(prob, sol.labels) <= limit * (1 + 1e-9), name
            chosen[name].append(sol.labels[prob.recompute.group])
    for name, picks in chosen.items():
        assert picks[0] == 0, (name, picks)  # memory free: nothing recomputed
        assert picks == sorted(picks) and picks[-1] > picks[0], (name, picks)


def test_the_mrf_is_within_the_ilp_and_reports_the_true_objective():
    for seed in range(4):
        prob = _problem(seed, _limits(seed)[2])
        ilp, mrf = solve_ilp(prob, solver="highs"), solve_problem_mrf(prob)
        assert mrf.objective == pytest.approx(prob.energy(mrf.labels))  # not the multiplier's energy
        assert mrf.objective >= ilp.objective - 1e-6
