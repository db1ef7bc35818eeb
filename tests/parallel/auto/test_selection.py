"""The free plan checked against the DDP plan by the step simulation (parallel/auto/selection.py).

On the shipped "cpu" profile, a 2x2 mesh and the 2-block debug LLaMA with every parameter
allowed to stay replicated, the ILP's optimum (weights sharded on the first axis, priced
below DDP by its additive objective) simulates slower than the DDP plan, so the planner
returns the DDP plan and says why; the same job with the check off returns the ILP's
optimum, whose objective is lower and whose simulated step is longer. A constrained job is
never checked."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from models import build_model
from parallel.auto import selection
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.plan import Plan
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.search import presets


def _plan(constrain=None, apply: bool = False) -> Plan:
    tok = torch.zeros(8, 128, dtype=torch.long)
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        runtime = RuntimeOptions(reshard_after_forward="auto")
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, runtime=runtime,
                          planner=PlannerConfig(hardware="cpu")) as autop:
            autop.add_parameter_memory_constraint(high=1.0)  # memory is no object: replicated allowed
            if constrain is not None:
                constrain(autop)
            plan = autop.optimize_placement(verbose=False)
            if constrain is None:
                assert autop.constraints == [] and autop.memory_high == 1.0  # the check's DDP constraints taken back
            if apply:  # the planner is left as the kept plan's solve left it: it applies that plan
                pm = autop.apply_placement(plan)
                assert all(isinstance(p, DTensor) and all(isinstance(x, Replicate) for x in p.placements)
                           for p in pm.parameters())
    return plan


def _replicated(plan: Plan) -> bool:
    return set(plan.param_placements().values()) == {"(R, R)"}


@pytest.mark.slow
def test_the_ddp_plan_is_kept_where_it_simulates_faster_than_the_ilp_optimum(monkeypatch):
    chosen = _plan(apply=True)
    assert _replicated(chosen) and chosen.selection.startswith("every parameter replicated (DDP), chosen over")
    assert Plan.from_json(chosen.to_json()).selection == chosen.selection
    assert "every parameter replicated (DDP), chosen" in chosen.summary()

    monkeypatch.setattr(selection, "applies", lambda autop, plan: False)  # the ILP alone
    optimum = _plan()
    assert not _replicated(optimum) and optimum.selection == ""
    assert optimum.objective_us < chosen.objective_us  # what the ILP prefers ...
    assert optimum.timeline.step_us > chosen.timeline.step_us  # ... the step simulation does not


@pytest.mark.slow
def test_a_constrained_job_is_not_checked():
    plan = _plan(constrain=lambda autop: presets.fsdp(autop))
    assert plan.selection == "" and not _replicated(plan)
