"""Tracing: labelled joint graph from a meta model, no real memory."""

import torch
from torch import nn

from models import build_model, cross_entropy_loss
from parallel.auto.trace.joint import BWD, FWD, trace_joint


def lm_loss(model, tokens, labels):
    return cross_entropy_loss(model(tokens), labels)


def _tokens(b, s):
    return torch.zeros(b, s, dtype=torch.long)


def test_trace_llama_debug_labels_and_pairs():
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    jg = trace_joint(model, (_tokens(4, 32), _tokens(4, 32)), lm_loss)
    fqns = {n for n, _ in model.named_parameters()}
    assert set(jg.params) == fqns
    # every parameter gets a gradient and it has the parameter's shape
    for fqn, g in jg.param_grads.items():
        assert g is not None, fqn
        assert g.meta["val"].shape == jg.params[fqn].meta["val"].shape
        assert jg.phase[g.name] == BWD
    assert len(jg.inputs) == 2 and [n.meta["val"].shape for n in jg.inputs] == [torch.Size([4, 32])] * 2
    assert jg.input_grads == {0: None, 1: None}  # integer tokens have no gradient
    assert len(jg.output_tangents) == 1 and jg.output_tangents[0][0] == 0
    assert jg.slots[0].kind == "output" and jg.slots[0].node.meta["val"].ndim == 0
    assert jg.labels[jg.params["layers.0.attention.wq.weight"].name] == "param layers.0.attention.wq.weight"
    mms = [n for n in jg.gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert {jg.phase[n.name] for n in mms} == {FWD, BWD}
    # nodes know the module they come from (used for repeated blocks and reports)
    assert any(m.startswith("layers.1.attention") for m in jg.module_of.values())
    # the user's module stays on meta
    assert all(p.device.type == "meta" for p in model.parameters())
    assert set(jg.buffers) == {n for n, _ in model.named_buffers()}


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def test_trace_float_input_gets_grad_and_model_without_loss_fn():
    with torch.device("meta"):
        m = _MLP()
    jg = trace_joint(m, (torch.empty(8, 16, device="meta", requires_grad=True),))
    assert set(jg.params) == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert all(g is not None for g in jg.param_grads.values())
    assert jg.fingerprint and len(jg.fingerprint) == 16


def test_trace_rejects_non_scalar_output():
    with torch.device("meta"):
        m = nn.Linear(4, 4)
    try:
        trace_joint(m, (torch.empty(2, 4, device="meta"),))
    except ValueError as e:
        assert "scalar loss" in str(e)
    else:
        raise AssertionError("expected ValueError")
