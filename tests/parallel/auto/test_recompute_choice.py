"""[activation_checkpoint] mode = "auto": the planner chooses each block's recomputation in
its solve. On the 4-block debug LLaMA (a fake world of 4): with memory free nothing is
recomputed; as the memory limit falls the plan recomputes more, and the memory estimate of
every plan it returns (the step graph torch's partitioner cuts, an observer the row does not
share) fits the limit; below what full recomputation needs, MemoryLimitError names the
parts with every block recomputed. The choice survives the plan's JSON and a replay."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import AutoParallel, MemoryLimitError, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.plan import Plan
from parallel.auto.runtime import RuntimeOptions

pytestmark = pytest.mark.slow

WEIGHT = {"none": 0, "op": 1, "full": 2}


def _plan(limit_gib: float | None, tmp_path=None) -> Plan:
    tok = torch.zeros(8, 256, dtype=torch.long)
    model = build_model("llama3", "debug", device="meta", n_layers=4)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss,
                          planner=PlannerConfig(hardware="cpu", memory_limit_gib=limit_gib),
                          runtime=RuntimeOptions(ac_mode="auto")) as autop:
            plan = autop.optimize_placement(verbose=False)
            if tmp_path is not None:  # saved, loaded and replayed on the same graph: same choice
                plan.save(str(tmp_path / "plan.json"))
                loaded = Plan.load(str(tmp_path / "plan.json"))
                assert loaded.recompute == plan.recompute
                replayed = autop.replay_placement(loaded)
                assert replayed.recompute["blocks"] == plan.recompute["blocks"]
                assert replayed.objective_us == pytest.approx(plan.objective_us, rel=1e-9)
        if tmp_path is not None:  # a new planner (the replan flow) prices the plan's own choice
            with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="cpu"),
                              runtime=RuntimeOptions(ac_mode="auto")) as fresh:
                replayed = fresh.replay_placement(Plan.load(str(tmp_path / "plan.json")))
            assert replayed.recompute["blocks"] == plan.recompute["blocks"]
            assert replayed.objective_us == pytest.approx(plan.objective_us, rel=1e-9)
        return plan


def test_more_recomputation_as_the_limit_falls(tmp_path):
    free = _plan(None)
    assert free.recompute == {}  # every plan fits: the choice is not even posed
    plans = [_plan(limit) for limit in (0.050, 0.040)] + [_plan(0.036, tmp_path)]
    levels = [sum(WEIGHT[c] for c in p.recompute["blocks"]) for p in plans]
    assert levels == sorted(levels) and levels[-1] > levels[0] > 0, [p.recompute["summary"] for p in plans]
    for p, limit in zip(plans, (0.050, 0.040, 0.036)):
        assert p.memory.fits and p.memory.peak_bytes <= limit * 2**30
        assert p.recompute["recompute_us"] > 0
    # recomputing costs time: the objective grows as the limit falls (the same placements menu)
    objectives = [free.objective_us] + [p.objective_us for p in plans]
    assert objectives == sorted(objectives)
    assert "activation checkpointing chosen in the solve" in plans[-1].summary()


def test_no_plan_even_with_every_block_recomputed_names_the_parts():
    with pytest.raises(MemoryLimitError, match="with every block recomputed") as e:
        _plan(0.012)
    assert e.value.estimate is not None and "activations" in str(e.value)
