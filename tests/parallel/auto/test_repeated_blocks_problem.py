"""Repeated blocks: identical layers share one decision (content hashing, fwd/bwd never mixed)."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import fake_world, lm_loss
from parallel.auto.candidates.strategies import build_candidates
from parallel.auto.cost import CostModel
from parallel.auto.problem.formulation import build_problem
from parallel.auto.problem.repeated_blocks import find_repeated_blocks, layer_instance, menu_of
from parallel.auto.trace.joint import trace_joint


@pytest.fixture(scope="module")
def cands():
    model = build_model("llama3", "debug", device="meta", n_layers=3)
    jg = trace_joint(model, (torch.zeros(4, 32, dtype=torch.long),) * 2, lm_loss)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        yield build_candidates(jg, mesh)


def test_copies_share_content_phase_and_menu(cands):
    cl = find_repeated_blocks(cands)
    jg = cands.graph
    assert cl.num_instances == 3
    assert cl.copies
    for members in cl.copies:
        assert len({layer_instance(cands, n) for n in members}) == len(members)  # one copy per layer
        assert len({jg.phase[n] for n in members}) == 1  # forward and backward never mixed
        first = cands.nodes[members[0]]
        for n in members[1:]:
            c = cands.nodes[n]
            assert c.kind == first.kind and c.key == first.key
            assert menu_of(c) == menu_of(first)
    # every node of every layer has its copies in the other two layers
    in_layers = [n for n, c in cands.nodes.items() if c.kind != "slot" and layer_instance(cands, n)]
    copied = {n for m in cl.copies for n in m}
    assert set(in_layers) <= copied
    assert all(len(m) == 3 for m in cl.copies)


def test_decisions_remaining_are_reported(cands, caplog):
    cm = CostModel("h100", (2,), ("dp",))
    caplog.set_level("INFO", logger="parallel.auto.problem.placement_problem")
    prob = build_problem(cands, cm, memory_high=0.5)
    flat = build_problem(cands, cm, memory_high=0.5, repeated_blocks=False)
    assert prob.num_groups < flat.num_groups
    msg = next(r.getMessage() for r in caplog.records if "decisions" in r.getMessage())
    assert f"{len(cands.nodes):,} nodes -> {prob.num_groups:,} decisions" in msg
    # adding a layer adds no decision: the problem size with repeated blocks is independent of depth
    jg = cands.graph
    wq = [jg.params[f"layers.{i}.attention.wq.weight"].name for i in range(3)]
    assert len({prob.group_of[n] for n in wq}) == 1


class _Stack(nn.Module):
    """Three 'layers' of which only two are identical (the middle one is wider)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False),
                                     nn.Linear(64, 64, bias=False)])
        self.layers[1] = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()


def test_different_layers_are_not_copies():
    with torch.device("meta"):
        m = _Stack()
    jg = trace_joint(m, (torch.empty(32, 64, device="meta"),))
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        cands = build_candidates(jg, mesh)
    cl = find_repeated_blocks(cands)
    copied = {n for m in cl.copies for n in m}
    odd = [n for n, c in cands.nodes.items() if c.kind == "placeholder" and layer_instance(cands, n) == "layers.1"]
    odd += [n for n, c in cands.nodes.items() if c.kind == "op" and layer_instance(cands, n) == "layers.1"
            and "mm" in str(c.node.target)]
    assert odd and not (set(odd) & copied)  # the odd layer's weights and matmuls stay alone
    w0, w2 = jg.params["layers.0.weight"].name, jg.params["layers.2.weight"].name
    assert any(w0 in m and w2 in m for m in cl.copies)  # the identical ones share a decision
