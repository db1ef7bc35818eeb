"""Ops nothing reads leave the step graph, and only those: torch 2.11's trace of a plan kept
DTensor's own shape propagation (an `embedding` of uninitialised host tensors, an RMSNorm
over one), which failed on a GPU with IndexError. Writes that something else still sees,
random ops and collectives stay."""

from __future__ import annotations

import torch
import torch.fx as fx

from parallel.auto.runtime.step_graph import drop_dead_nodes

aten = torch.ops.aten


def _graph() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    g = fx.Graph()
    w, tok, acc = g.placeholder("w"), g.placeholder("tok"), g.placeholder("acc")
    nodes: dict[str, fx.Node] = {}

    def op(name, target, *args, **kwargs):
        nodes[name] = g.call_function(target, args, kwargs)
        return nodes[name]

    # what 2.11 left: an embedding of uninitialised tensors, an RMSNorm chain with an in-place add
    junk_w = op("junk_w", aten.empty_strided.default, [16, 4], [4, 1], dtype=torch.float32)
    junk_tok = op("junk_tok", aten.empty_strided.default, [2, 3], [3, 1], dtype=torch.int64)
    op("junk_emb", aten.embedding.default, junk_w, junk_tok)
    junk_x = op("junk_x", aten.empty_strided.default, [2, 3, 4], [12, 4, 1], dtype=torch.float32)
    mean = op("junk_mean", aten.mean.dim, op("junk_pow", aten.pow.Tensor_Scalar, junk_x, 2), [2], True)
    op("junk_mul", aten.mul.Tensor, junk_x, op("junk_rsqrt", aten.rsqrt.default, op("junk_add_", aten.add_.Scalar,
                                                                                     mean, 1e-5)))
    # the step itself
    emb = op("emb", aten.embedding.default, w, tok)
    scaled = op("scaled", aten.mul.Tensor, emb, 2.0)
    op("bump_", aten.add_.Scalar, scaled, 1.0)  # in place, result unused, but `scaled` is read below
    op("into_acc_", aten.add_.Tensor, acc, emb)  # writes an input
    op("rand", aten.rand.default, [3])  # advances the generator
    parts = op("split", aten.split.Tensor, scaled, 2, 2)
    op("unused_part", __import__("operator").getitem, parts, 1)
    g.output((op("sum", aten.sum.default, scaled),))
    return fx.GraphModule(torch.nn.Module(), g), nodes


def test_only_unread_pure_ops_go_and_the_step_computes_the_same():
    gm, nodes = _graph()
    removed = drop_dead_nodes(gm)
    gm.recompile()
    left = {k for k, n in nodes.items() if n in gm.graph.nodes}
    junk = {k for k in nodes if k.startswith("junk")}
    assert not junk & left, f"unread ops kept: {sorted(junk & left)}"
    assert left == {"emb", "scaled", "bump_", "into_acc_", "rand", "sum"}
    assert removed == len(junk) + 2

    w, tok = torch.randn(16, 4), torch.tensor([[1, 2, 3], [4, 5, 15]])
    acc = torch.zeros(2, 3, 4)
    (total,) = gm(w, tok, acc)
    emb = torch.nn.functional.embedding(tok, w)
    torch.testing.assert_close(total, (emb * 2 + 1).sum())  # the in-place bump still counted
    torch.testing.assert_close(acc, emb)  # the input was written


def test_collectives_stay_though_nothing_reads_them():
    """Every rank must run the same collectives: one whose result is unused is not dropped."""
    g = fx.Graph()
    x = g.placeholder("x")
    reduced = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    g.call_function(aten.mul.Tensor, (reduced, 2.0))  # unread: goes
    g.output((x,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert drop_dead_nodes(gm) == 1
    assert reduced in gm.graph.nodes
