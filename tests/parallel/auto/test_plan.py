"""Plan: save -> load identical, refusal on another model/mesh, explain, costs_for_node."""

import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.plan import Plan, PlanMismatchError

WQ = "layers.0.attention.wq.weight"


@pytest.fixture(scope="module")
def setup():
    model = build_model("llama3", "debug", device="meta", n_layers=1)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        inputs = lambda: (torch.zeros(8, 128, dtype=torch.long),) * 2  # noqa: E731
        with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="h100")) as autop:
            plan = autop.optimize_placement(verbose=False)
        yield model, mesh, plan


def test_save_load_identical(setup, tmp_path):
    model, mesh, plan = setup
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = Plan.load(str(path), model=model, mesh=mesh)
    assert loaded.nodes == plan.nodes
    assert loaded.objective_us == plan.objective_us
    assert loaded.param_placements() == plan.param_placements()
    assert len(plan.diff(loaded)) == 0
    d = json.loads(path.read_text())
    assert d["mesh_shape"] == [4] and d["mesh_axis_names"] == ["dp"] and d["hardware"] == "h100"
    assert d["torch_version"] == torch.__version__ and d["fingerprint"] == plan.fingerprint
    assert loaded.summary() == plan.summary()


def test_load_refuses_other_model_or_mesh(setup, tmp_path):
    model, mesh, plan = setup
    path = tmp_path / "plan.json"
    plan.save(str(path))
    other = build_model("llama3", "debug", device="meta", n_layers=2)
    with pytest.raises(PlanMismatchError, match="different model"):
        Plan.load(str(path), model=other)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(PlanMismatchError, match=r"mesh \(4,\)"):
        Plan.load(str(path), mesh=mesh2)


def test_breakdown_and_summary(setup):
    _, _, plan = setup
    assert plan.objective_us == pytest.approx(plan.compute_us + sum(plan.comm_us.values()), rel=1e-6)
    assert all("@dp" in k for k in plan.comm_us)
    s = plan.summary()
    assert "layers.0:" in s and "attention.wq:" in s and "on dp" in s
    assert set(plan.timings) >= {"trace", "candidates", "build", "solve"}


def test_explain_and_costs_for_node(setup):
    _, _, plan = setup
    rows = plan.costs_for_node(WQ)
    assert sum(r["chosen"] for r in rows) == 1
    chosen = next(r for r in rows if r["chosen"])
    # with the neighbours fixed, the chosen placement is the cheapest allowed one within the
    # parameter-memory budget (fully sharded by default): holding more of the weight is cheaper
    fits = [r["total_us"] for r in rows if r["allowed"] and r["param_bytes"] <= chosen["param_bytes"]]
    assert chosen["total_us"] <= min(fits) + 1e-6
    text = plan.explain(WQ)
    assert "chosen:" in text and "alt" in text and WQ in text
    mm = next(n for n in plan.nodes.values() if n.target == "aten.mm.default")
    assert "compute" in plan.explain(mm.name)


def test_loaded_plan_has_no_costs(setup, tmp_path):
    _, _, plan = setup
    path = tmp_path / "p.json"
    plan.save(str(path))
    with pytest.raises(RuntimeError, match="in-memory"):
        Plan.load(str(path)).explain(WQ)
