"""An eager step graph sums gradient contributions in place where nothing else can see the
summand (`reinplace_adds`), as autograd's engine does, and only there: inputs, values read
again, broadcast or type-promoted summands and hidden views keep their out-of-place add, and
the graph computes what it computed before."""

from __future__ import annotations

import torch

from parallel import _torch as T
from parallel.auto.runtime.step_graph import reinplace_adds

aten = torch.ops.aten


def _step(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    fresh = aten.add.Tensor(aten.mul.Tensor(x, 2.0), aten.mul.Tensor(x, 3.0))  # both summands fresh
    onto_fresh = aten.add.Tensor(x, aten.mul.Tensor(x, 4.0))  # the input stays; its fresh partner takes it
    inputs_only = aten.add.Tensor(x, x)
    broadcast = aten.add.Tensor(aten.mul.Tensor(bias, 5.0), x)  # the fresh summand is smaller than the sum
    read_again = aten.mul.Tensor(x, 6.0)
    kept = aten.add.Tensor(read_again, x)
    promoted = aten.add.Tensor(aten._to_copy.default(aten.mul.Tensor(x, 7.0), dtype=torch.bfloat16), x)
    base = aten.mul.Tensor(x, 8.0)
    hidden_view = aten.add.Tensor(aten._unsafe_view.default(base, [12]), aten.view.default(x, [12]))
    return fresh, onto_fresh, inputs_only, broadcast, read_again, kept, promoted, base, hidden_view


def test_only_summands_nothing_else_reads_are_written_and_the_results_are_unchanged():
    x, bias = torch.randn(3, 4), torch.randn(4)
    want = _step(x, bias)
    gm = T.trace_fake(_step)(x, bias)
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert len(adds) == 7

    assert reinplace_adds(gm) == 2
    T.generate_code(gm)
    in_place = [adds.index(n) for n in adds if n.target is aten.add_.Tensor]
    assert in_place == [0, 1]  # `fresh`, `onto_fresh`; the other five still allocate their sum
    onto_fresh = adds[1]
    assert onto_fresh.args[0].target is aten.mul.Tensor  # written: the fresh product, not the input

    x_before = x.clone()
    got = gm(x, bias)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(x, x_before)  # the input was not written
