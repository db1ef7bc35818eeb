"""Candidates from DTensor's rules: paper Table 1, placeholders, attention, coverage."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from models import build_model, cross_entropy_loss
from parallel._torch import fake_world
from parallel.auto.candidates.placements import tensor_placements
from parallel.auto.candidates.strategies import build_candidates
from parallel.auto.trace.joint import trace_joint

R, P = Replicate(), Partial()


def S(d):
    return Shard(d)


class _XW(nn.Module):
    """Y = X W with W stored as [K, N] like the paper."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(16, 32))

    def forward(self, x):
        return (x @ self.w).sum()


@pytest.fixture(scope="module")
def mesh2d():
    with fake_world(4):
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_table1_strategies_for_xw_on_2d_mesh(mesh2d):
    with torch.device("meta"):
        m = _XW()
    jg = trace_joint(m, (torch.empty(8, 16, device="meta"),))
    cands = build_candidates(jg, mesh2d)
    w = jg.params["w"]
    fwd_mm = next(n for n in jg.gm.graph.nodes if n.target is torch.ops.aten.mm.default and w in n.args)
    c = cands[fwd_mm.name]
    triples = {(s.input_specs[0].placements, s.input_specs[1].placements, s.output_specs.placements) for s in c.specs}
    table1 = {
        "DP / FSDP (after all-gather of W)": ((S(0), S(0)), (R, R), (S(0), S(0))),
        "Col-TP": ((R, R), (R, S(1)), (R, S(1))),
        "Row-TP": ((R, S(1)), (R, S(0)), (R, P)),
        "FSDP+TP (W gathered on dp)": ((S(0), R), (R, S(1)), (S(0), S(1))),
    }
    for name, t in table1.items():
        assert t in triples, name
    stored = {s.output_specs.placements for s in cands[w.name].specs}
    # stored weight placements of Table 1: DP (R,R), FSDP (S0,S0), Col (R,S1), Row (R,S0), FSDP+TP (S0,S1)
    for p in [(R, R), (S(0), S(0)), (R, S(1)), (R, S(0)), (S(0), S(1))]:
        assert p in stored
    assert cands.coverage.ok


def test_placeholder_placements_divide_evenly():
    pls = tensor_placements((6, 8), (4,))
    assert (Shard(1),) in pls and (Shard(0),) not in pls and (Replicate(),) in pls
    pls2 = tensor_placements((8, 4), (2, 4))
    assert (Shard(0), Shard(0)) in pls2 and (Shard(1), Shard(1)) not in pls2


@pytest.mark.parametrize("name,kw", [("llama3", {}), ("qwen3", {}), ("deepseek_v3", {"n_dense_layers": 3})])
def test_coverage_dense_models(mesh2d, name, kw):
    model = build_model(name, "debug", device="meta", n_layers=2 if name != "deepseek_v3" else 3, **kw)
    toks = torch.zeros(4, 32, dtype=torch.long)
    jg = trace_joint(model, (toks, toks), lambda m, t, labels: cross_entropy_loss(m(t), labels))
    cands = build_candidates(jg, mesh2d)
    assert cands.coverage.ok, str(cands.coverage)
    # attention has our batch/head rule: more than the replicate strategy
    att = [c for c in cands.nodes.values() if c.node is not None and "flash_attention_for_cpu" in str(c.node.target)]
    assert att, "no CPU flash-attention node in the graph: the models' attention path changed"
    assert all(len(c.specs) > 1 for c in att)
    # identical ops share one enumeration
    assert cands.unique_keys < sum(1 for n in jg.gm.graph.nodes if n.op == "call_function")


def test_cpu_attention_flops_registered():
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from parallel._torch import register_planner_ops

    register_planner_ops()
    q = torch.randn(2, 4, 16, 8)
    with FlopCounterMode(display=False) as fc:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert fc.get_total_flops() == 2 * (2 * 2 * 4 * 16 * 16 * 8)  # QK^T and AV


def test_make_spec_returns_independent_copies(mesh2d):
    """Specs are copied from a template (a DTensorSpec costs ~14 µs to build): equal to a new
    one, shard order included, and setting a field of one leaves the others alone."""
    from parallel import _torch as T
    from parallel.auto.candidates.enumeration import make_spec, tensor_meta

    meta = tensor_meta(torch.empty(8, 6, device="meta"))
    a, b = make_spec(mesh2d, (S(0), S(1)), meta), make_spec(mesh2d, [S(0), S(1)], meta)
    fresh = T.DTensorSpec(mesh2d, (S(0), S(1)), tensor_meta=meta)
    assert a is not b and a == b == fresh and hash(a) == hash(fresh)
    assert a.shard_order == fresh.shard_order and a.placements == (S(0), S(1))
    b.tensor_meta = tensor_meta(torch.empty(4, 6, device="meta"))
    assert a.tensor_meta.shape == (8, 6) and make_spec(mesh2d, (S(0), S(1)), meta).tensor_meta.shape == (8, 6)
    assert b != a and hash(b) != hash(a)
