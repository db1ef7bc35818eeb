"""The HiGHS path of the exact ILP (LP bound, rounding, reduced-cost pruning, integer
program) against exhaustive enumeration, and the parameter budget held to the byte.

Exhaustive enumeration is an observer that shares nothing with the solver but
`Problem.energy`; CBC (through pulp, another formulation build) is a second one.
"""

import itertools

import numpy as np
import pytest

from parallel.auto.problem.placement_problem import Edge, Problem
from parallel.auto.solve.ilp import solve_ilp
from parallel.auto.solve.presolve import budget_holds, prune_to_budget


def _problem(n: int, k: int, seed: int, *, params: dict[int, np.ndarray] | None = None, total: float = 0.0,
             high: float | None = None, low: float | None = None, dense: bool = False) -> Problem:
    """n groups of k strategies; a chain plus random chords (or all pairs), each edge with
    its own class maps (several strategies share a class) and some forbidden pairs."""
    rng = np.random.default_rng(seed)
    unary = [rng.uniform(0, 10, k) for _ in range(n)]
    pairs = [(g, h) for g in range(n) for h in range(g + 1, n)] if dense else (
        [(g, g + 1) for g in range(n - 1)] + [(g, h) for g in range(n) for h in range(g + 2, n) if rng.random() < 0.3])
    edges = []
    for g, h in pairs:
        ca, cb = rng.integers(0, 3, k), rng.integers(0, 3, k)
        cost = rng.uniform(0, 20, (3, 3))
        cost[rng.random((3, 3)) < 0.15] = np.inf
        cost[ca[0], cb[0]] = rng.uniform(0, 20)  # strategy 0 everywhere stays a plan: feasible
        edges.append(Edge(g, h, ca, cb, [], [], cost))
    names = [f"n{g}" for g in range(n)]
    params = params or {}
    return Problem(
        candidates=None, cost_model=None, groups=[[x] for x in names], group_of={x: g for g, x in enumerate(names)},
        n_strategies=[k] * n, unary=unary, compute={}, edges=edges, allowed=[np.ones(k, dtype=bool) for _ in range(n)],
        param_groups=sorted(params), param_bytes=params, total_param_bytes=total, memory_low=low, memory_high=high,
        constraints=[])


def _brute_force(prob: Problem) -> float:
    best = np.inf
    for labels in itertools.product(*(range(k) for k in prob.n_strategies)):
        if budget_holds(prob, list(labels)):
            best = min(best, prob.energy(list(labels)))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_highs_path_finds_the_enumerated_optimum(seed):
    prob = _problem(7, 3, seed)
    sol = solve_ilp(prob, solver="highs")
    assert sol.solver == "highs" and sol.optimal
    assert sol.objective == pytest.approx(_brute_force(prob), rel=1e-9)
    assert sol.objective == pytest.approx(prob.energy(sol.labels), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_highs_path_keeps_a_loose_budget_and_finds_the_optimum(seed):
    """Budget between fully sharded and replicated: a knapsack row stays in the program."""
    rng = np.random.default_rng(100 + seed)
    params = {g: rng.choice([1.0, 2.0, 4.0, 8.0], 3) * 1e6 for g in (0, 2, 3, 5)}
    total = sum(float(b.max()) for b in params.values())
    least = sum(float(b.min()) for b in params.values())
    prob = _problem(7, 3, seed, params=params, total=total, high=(least + total) / 2 / total, low=least * 1.2 / total)
    assert prune_to_budget(prob)[1], "this budget must leave a row for the solver"
    expected = _brute_force(prob)
    sol = solve_ilp(prob, solver="highs")
    assert sol.optimal and budget_holds(prob, sol.labels)
    assert sol.objective == pytest.approx(expected, rel=1e-9)
    assert solve_ilp(prob, solver="cbc").objective == pytest.approx(expected, rel=1e-9)


def _over_by_a_tolerance() -> Problem:
    """Two parameter groups whose cheaper strategies are 950 and 900 bytes over their
    least: each alone fits the budget's 1,000 spare bytes, both do not. On 10 GB of
    parameters the 850 bytes too many are 8.5e-8 of the total, inside a solver's default
    feasibility tolerance (1e-7) of a row written in fractions of the total (how LLaMA 3
    8B on 4x8 came to keep a 2 kB norm weight unsharded under a fully sharded budget)."""
    total = 1e10
    q = total / 4
    params = {0: np.array([q, q + 950.0, q + 950.0]), 1: np.array([q, q + 900.0, q + 900.0])}
    prob = _problem(3, 3, 0, params=params, total=total, high=(2 * q + 1000.0) / total)
    prob.unary[0][:] = [10.0, 0.0, 0.0]  # each group's over-budget strategies are the cheap ones
    prob.unary[1][:] = [10.0, 0.0, 0.0]
    return prob


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_the_budget_holds_to_the_byte_not_to_the_solver_tolerance(backend):
    prob = _over_by_a_tolerance()
    sol = solve_ilp(prob, solver=backend)
    used = sum(prob.param_bytes[g][sol.labels[g]] for g in prob.param_groups)
    assert used <= prob.memory_high * prob.total_param_bytes + 1e-9 * prob.total_param_bytes
    assert sorted(int(sol.labels[g] == 0) for g in (0, 1)) == [0, 1]  # exactly one group pays for the other
    assert sol.objective == pytest.approx(_brute_force(prob), rel=1e-12)


def test_a_fully_sharded_budget_leaves_only_the_least_bytes_and_no_row():
    params = {0: np.array([1.0, 4.0, 1.0]) * 1e6, 2: np.array([2.0, 2.0, 8.0]) * 1e6}
    total = 12e6
    prob = _problem(4, 3, 3, params=params, total=total, high=3e6 / total)
    pruned, row = prune_to_budget(prob)
    assert not row
    assert pruned.allowed[0].tolist() == [True, False, True] and pruned.allowed[2].tolist() == [True, True, False]
    sol = solve_ilp(prob, solver="highs")
    assert sol.objective == pytest.approx(_brute_force(prob), rel=1e-9)


def test_reduced_cost_pruning_keeps_the_optimum_of_a_hard_problem():
    """All pairs linked: the LP bound is loose (the incumbent is well above it), so
    strategies are pruned by reduced cost and the integer program decides."""
    prob = _problem(8, 3, 7, dense=True)
    sol = solve_ilp(prob, solver="highs")
    assert sol.optimal
    assert sol.objective == pytest.approx(_brute_force(prob), rel=1e-9)
