"""Warm starts: a neighbouring problem's plan handed to the solvers.

The exact ILP must keep its optimum (observer: CBC, through pulp, another formulation)
and prune at least as much as it does cold; the MRF must return a plan no worse than
either its own or the start's. Problems are random dense ones (loose LP bounds, forbidden
pairs), as in test_highs_ilp.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from test_highs_ilp import _problem

from parallel.auto.solve import highs_ilp
from parallel.auto.solve.ilp import solve_ilp
from parallel.auto.solve.problem_mrf import solve_problem_mrf


def _neighbour(seed: int) -> list[int]:
    """The optimum of a nearby problem: the same structure with costs moved by up to 10 %."""
    prob = _problem(9, 4, seed, dense=True)
    rng = np.random.default_rng(1000 + seed)
    prob.unary = [u * rng.uniform(0.9, 1.1, u.shape) for u in prob.unary]
    return solve_ilp(prob, solver="highs").labels


def test_a_rounding_through_a_forbidden_pair_is_not_taken_for_the_optimum():
    """The LP's rounding of this problem uses a forbidden pair (objective inf); it used to pass
    the optimality gap test (inf - bound <= 1e-9 x inf) and come back as the "optimal" plan."""
    prob = _problem(9, 4, 11, dense=True)
    sol = solve_ilp(prob, solver="highs")
    assert np.isfinite(sol.objective) and sol.optimal
    assert sol.objective == pytest.approx(solve_ilp(prob, solver="cbc").objective, rel=1e-9)


@pytest.mark.slow
def test_the_ilp_keeps_its_optimum_and_a_good_start_prunes_at_least_as_much(monkeypatch):
    columns: list[int] = []
    real = highs_ilp._highs

    def counting(model, *, integer, **kw):
        if integer:
            columns.append(model.num_cols)
        return real(model, integer=integer, **kw)

    monkeypatch.setattr(highs_ilp, "_highs", counting)
    fewer = 0
    for seed in range(12):
        prob = _problem(9, 4, seed, dense=True)
        exact = solve_ilp(prob, solver="cbc").objective
        columns.clear()
        cold = solve_ilp(prob, solver="highs")
        cold_cols = sum(columns)
        for start in (_neighbour(seed), cold.labels, [0] * prob.num_groups):
            columns.clear()
            warm = solve_ilp(prob, solver="highs", start=start)
            assert warm.optimal and warm.objective == pytest.approx(exact, rel=1e-9), (seed, start)
            if start is cold.labels:  # the optimum as incumbent: every strategy above it is pruned
                assert sum(columns) <= cold_cols, seed
                fewer += sum(columns) < cold_cols
        assert cold.objective == pytest.approx(exact, rel=1e-9)
    assert fewer >= 1  # the start changes what the integer program is given


def test_the_mrf_returns_the_better_of_its_plan_and_the_start():
    better = 0
    for seed in range(12):
        prob = _problem(9, 4, seed, dense=True)
        prob.candidates = SimpleNamespace(graph=SimpleNamespace(module_of={}), mesh=SimpleNamespace(shape=(4,)))
        opt = solve_ilp(prob, solver="highs")
        cold = solve_problem_mrf(prob, max_sweeps=1)  # one TRW-S sweep: sometimes short of the optimum
        warm = solve_problem_mrf(prob, max_sweeps=1, start=opt.labels)
        assert warm.objective == pytest.approx(opt.objective, rel=1e-9), seed
        assert warm.objective == pytest.approx(prob.energy(warm.labels), rel=1e-12)
        better += warm.objective < cold.objective - 1e-9
        poor = solve_problem_mrf(prob, max_sweeps=1, start=[0] * prob.num_groups)
        assert poor.objective <= cold.objective + 1e-9  # a poor start never costs the MRF its own plan
    assert better >= 1  # the precondition: the start is what reached the optimum somewhere
