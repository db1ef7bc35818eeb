"""Problem: grouping (fwd/bwd pairs, repeated layers), costs, memory bounds, errors."""

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import fake_world, lm_loss
from parallel.auto.candidates.strategies import build_candidates
from parallel.auto.cost import CostModel
from parallel.auto.problem.formulation import build_problem
from parallel.auto.problem.placement_problem import Constraint, PlanningError
from parallel.auto.solve.ilp import solve_ilp
from parallel.auto.trace.joint import trace_joint


@pytest.fixture(scope="module")
def cands():
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    jg = trace_joint(model, (torch.zeros(16, 128, dtype=torch.long),) * 2, lm_loss)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        yield build_candidates(jg, mesh)


@pytest.fixture(scope="module")
def cm():
    return CostModel("h100", mesh_shape=(4,), mesh_axis_names=("dp",))


def test_groups_tie_param_grad_and_layers(cands, cm):
    prob = build_problem(cands, cm, memory_high=0.25)
    jg = cands.graph
    for fqn, node in jg.params.items():
        slot = next(s for s in jg.slots if s.kind == "grad_param" and s.of == fqn)
        assert prob.group_of[node.name] == prob.group_of[f"output[{slot.index}]"]
    g0 = prob.group_of[jg.params["layers.0.attention.wq.weight"].name]
    g1 = prob.group_of[jg.params["layers.1.attention.wq.weight"].name]
    assert g0 == g1  # repeated layers share one decision
    assert prob.group_of[jg.params["layers.0.attention.wk.weight"].name] != g0
    flat = build_problem(cands, cm, memory_high=0.25, repeated_blocks=False)
    assert flat.num_groups > prob.num_groups
    # repeated blocks restrict the search, so the unrestricted optimum is at least as good
    assert solve_ilp(flat).objective <= solve_ilp(prob).objective + 1e-6


def test_costs_are_finite_and_param_bytes_weighted(cands, cm):
    prob = build_problem(cands, cm, memory_high=None)
    assert prob.total_param_bytes == sum(cands.graph.param_bytes.values())
    for g in prob.param_groups:
        b = prob.param_bytes[g]
        assert b.max() == pytest.approx(b.min() * 4)  # replicated vs 4-way sharded
    assert all(np.isfinite(u).any() for u in prob.unary)
    assert any(not np.isfinite(e.cost).all() for e in prob.edges)  # Replicate -> Partial is refused
    labels = solve_ilp(prob).labels
    assert prob.energy(labels) == pytest.approx(solve_ilp(prob).objective)


def test_memory_bounds_conflict_is_reported(cands, cm):
    with pytest.raises(PlanningError, match="parameter memory"):
        build_problem(cands, cm, memory_low=0.9, memory_high=0.1)


def test_bad_node_constraint(cands, cm):
    with pytest.raises(PlanningError, match="no node named"):
        build_problem(cands, cm,
                      constraints=[Constraint("node", "node constraint on `nope`", node="nope", placements=())])
