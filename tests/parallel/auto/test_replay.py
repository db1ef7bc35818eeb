"""Replaying a plan at another input shape: the same placements, priced on the new graph."""


import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from models import build_model
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.plan.replay import replay_labels

pytestmark = pytest.mark.slow  # plans the debug LLaMA on a fake 2x2 (~20-35 s setup)

PL = (Shard(0), Replicate())


def _autop(model, mesh, seq, solver="ilp", time_limit=600.0):
    toks = torch.zeros(4, seq, dtype=torch.long)
    # placements and objectives are asserted here, not the peak: no memory estimate
    autop = AutoParallel(model, (toks, toks.clone()), mesh, loss_fn=lm_loss,
                         planner=PlannerConfig(hardware="h100", solver=solver, time_limit=time_limit,
                                               memory_estimate=False))
    return autop


def _placements(plan):
    return {n: (p.input_placements, p.output_placements) for n, p in plan.nodes.items()}


@pytest.fixture(scope="module")
def plans():
    model = build_model("llama3", "debug", device="meta", n_layers=1, max_seq_len=1024)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # the plan replayed needs not be optimal (only `fresh`, the ILP's at 1024, is compared as
        # an optimum): the MRF with a 1 s budget, ~2 s instead of the ILP's ~12 s
        with _autop(model, mesh, 32, solver="mrf", time_limit=1.0) as autop:
            autop.add_input_constraints([PL, PL])
            p0 = autop.optimize_placement(verbose=False)
            same = autop.replay_placement(p0)
        with _autop(model, mesh, 1024) as autop:
            autop.add_input_constraints([PL, PL])
            fresh = autop.optimize_placement(verbose=False)
            replay = autop.replay_placement(p0)
            labels = replay_labels(autop.problem, p0)
            energy = autop.problem.energy(labels)
            broken = Plan.from_json(p0.to_json())  # a copy, as a file would hold it
            name = next(n for n, p in broken.nodes.items() if p.kind == "op")
            broken.nodes[name].output_placements = ["(S(7), S(7))"]
            with pytest.raises(PlanMismatchError, match=f"plan node {name}.*re-plan for this shape"):
                autop.replay_placement(broken)
        yield model, mesh, p0, same, fresh, replay, energy


def test_replay_at_the_same_shape_is_the_plan(plans):
    _, _, p0, same, _, _, _ = plans
    assert _placements(same) == _placements(p0)
    assert same.objective_us == pytest.approx(p0.objective_us, rel=1e-9)
    assert same.solver == "replay" and same.input_shapes == p0.input_shapes


def test_replay_at_another_shape_keeps_placements_and_reprices(plans):
    _, _, p0, _, fresh, replay, energy = plans
    assert _placements(replay) == _placements(p0)
    assert replay.input_shapes == [[[4, 1024], "torch.int64"]] * 2 == fresh.input_shapes
    assert replay.objective_us == pytest.approx(energy, rel=1e-9)
    assert replay.objective_us > p0.objective_us * 1.2  # 32x the tokens, priced on the new graph
    assert fresh.objective_us <= replay.objective_us * (1 + 1e-9)  # the ILP's optimum is no worse
    assert len(replay.diff(fresh)) == len(p0.diff(fresh))


def test_a_plan_is_refused_at_another_shape_with_the_way_out(plans):
    model, mesh, p0, _, _, _, _ = plans
    with pytest.raises(PlanMismatchError, match="re-plan for this shape.*replay_placement"):
        p0.check_compatible(model=model, mesh=mesh, input_shapes=[[[4, 1024], "torch.int64"]] * 2)
