"""AutoParallel(graph=...): a trace made once is planned on other meshes (what sweeps do)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from models import build_model
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig

ARGS = dict(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128)


def _inputs(b, s):
    return tuple(torch.zeros(b, s, dtype=torch.long, device="meta") for _ in range(2))


def _plan(model, mesh, inputs, graph=None):
    with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, graph=graph,
                      planner=PlannerConfig(hardware="h100")) as autop:
        p = tuple(Shard(0) if n.startswith("dp") else Replicate() for n in mesh.mesh_dim_names)
        autop.add_input_constraints([p, p])
        return autop.optimize_placement(verbose=False), autop.graph


def test_given_graph_plans_like_a_fresh_trace_and_wrong_shapes_are_refused():
    model = build_model("llama3", "debug", device="meta", **ARGS)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
        fresh, graph = _plan(model, mesh, _inputs(4, 32))
        other = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        reused, g2 = _plan(model, other, _inputs(4, 32), graph=graph)  # another mesh, same global batch
        again, _ = _plan(model, mesh, _inputs(4, 32), graph=graph)
        with pytest.raises(ValueError, match=r"traced for inputs .*\[4, 32\].*not \[\[8, 32\], \[8, 32\]\]"):
            _plan(model, mesh, _inputs(8, 32), graph=graph)
    assert g2 is graph and reused.timings["trace"] == 0.0 and fresh.timings["trace"] > 0
    assert again.objective_us == pytest.approx(fresh.objective_us)
    assert again.param_placements() == fresh.param_placements()
    assert reused.mesh_axis_names == ["tp"]
