"""Node roles as data: the trace records what each placeholder and output is (NodeRole), the
plan carries it per node (JSON "role"), and a plan saved before roles gets them from its labels."""

import torch
from torch import nn

from parallel.auto.plan import NodePlan
from parallel.auto.trace.joint import (
    BUFFER,
    CONSTANT,
    GRAD_INPUT,
    GRAD_PARAM,
    INPUT,
    OUTPUT,
    PARAM,
    TANGENT,
    NodeRole,
    trace_joint,
)


def test_labels_come_from_roles_and_back():
    for role in (NodeRole(PARAM, "layers.0.w"), NodeRole(BUFFER, "freqs"), NodeRole(INPUT, 1),
                 NodeRole(GRAD_PARAM, "layers.0.w"), NodeRole(GRAD_INPUT, 0), NodeRole(OUTPUT, 0),
                 NodeRole(CONSTANT, "_tensor_constant0"), NodeRole(TANGENT, "PlainAOTOutput(idx=0)")):
        assert NodeRole.from_label(role.label()) == role
        assert NodeRole.from_json(role.to_json()) == role
    assert NodeRole(GRAD_PARAM, "w").label() == "grad of param w" and NodeRole(INPUT, 0).label() == "input 0"
    assert NodeRole.from_label("") is None


def test_a_plan_node_without_a_role_gets_it_from_its_label_once():
    d = NodePlan("p", "placeholder", "placeholder", "param layers.0.w", "fwd", "", 0, [], [], ["(R)"],
                 role=NodeRole(PARAM, "layers.0.w")).to_json()
    assert d["role"] == {"kind": PARAM, "of": "layers.0.w"}
    assert NodePlan.from_json(d).role == NodeRole(PARAM, "layers.0.w")
    del d["role"]  # a plan file written before roles
    assert NodePlan.from_json(d).role == NodeRole(PARAM, "layers.0.w")


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return (self.lin(x) * self.scale).sum()


def test_trace_records_the_role_of_every_placeholder_and_output():
    jg = trace_joint(_Tiny(), (torch.randn(2, 4),))
    assert jg.roles[jg.params["lin.weight"].name] == NodeRole(PARAM, "lin.weight")
    assert jg.roles[jg.buffers["scale"].name] == NodeRole(BUFFER, "scale")
    assert jg.roles[jg.inputs[0].name] == NodeRole(INPUT, 0)
    assert {s.role for s in jg.slots if s.kind == GRAD_PARAM} == {NodeRole(GRAD_PARAM, "lin.weight"),
                                                                  NodeRole(GRAD_PARAM, "lin.bias")}
    assert jg.labels[jg.params["lin.weight"].name] == "param lin.weight"
