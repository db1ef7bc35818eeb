"""An eager step graph sums gradient contributions in place where nothing else can see the
summand (`reinplace_adds`), as autograd's engine does, and only there: inputs, values read
again, broadcast or type-promoted summands and hidden views keep their out-of-place add, and
the graph computes what it computed before. It all-reduces a bucket nothing else reads in
place (`reduce_buffers_in_place`), as DDP does, and only such a bucket; the step simulation
prices that reduction as the collective it is, without the functional one's input copy."""

from __future__ import annotations

import torch

from parallel import _torch as T
from parallel.auto.cost import CostModel
from parallel.auto.cost.compute import roofline_us
from parallel.auto.cost.simulate import simulate_step
from parallel.auto.runtime.step_graph import reduce_buffers_in_place, reinplace_adds

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


def _reductions(a: torch.Tensor, b: torch.Tensor, group: str) -> tuple[torch.Tensor, ...]:
    c10d = torch.ops._c10d_functional
    bucket = aten.view.default(aten.cat.default([aten.mul.Tensor(a, 2.0), aten.mul.Tensor(b, 3.0)]), [-1])
    reduced = c10d.wait_tensor.default(c10d.all_reduce.default(bucket, "sum", group))
    of_input = c10d.wait_tensor.default(c10d.all_reduce.default(a, "sum", group))
    kept = aten.mul.Tensor(b, 4.0)
    of_kept = c10d.wait_tensor.default(c10d.all_reduce.default(kept, "sum", group))
    return reduced, of_input, of_kept, kept


def test_only_a_bucket_nothing_else_reads_is_reduced_in_place():
    with T.fake_world(1):
        import torch.distributed as dist

        group = dist.group.WORLD.group_name
        a, b = torch.randn(3, 4), torch.randn(2, 4)
        want = _reductions(a, b, group)  # one rank: the sum is the value itself
        gm = T.trace_fake(lambda a, b: _reductions(a, b, group))(a, b)
        reductions = [n for n in gm.graph.nodes if "all_reduce" in str(n.target)]
        assert reduce_buffers_in_place(gm) == 1
        T.generate_code(gm)
        assert [str(n.target).endswith("all_reduce_.default") for n in reductions] == [True, False, False]
        a_before = a.clone()
        for g, w in zip(gm(a, b), want):
            torch.testing.assert_close(g, w)
        torch.testing.assert_close(a, a_before)
        # the step simulation prices the in-place reduction as the collective it is, and the functional
        # one of the bucket alike (the eager runtime reduces it in place); the other two copy their input
        cm = CostModel("cpu", mesh_shape=(4,))
        after = simulate_step(gm, cm, {group: cm.links[0]})
        before = simulate_step(T.trace_fake(lambda a, b: _reductions(a, b, group))(a, b), cm, {group: cm.links[0]})
        assert after.collectives == before.collectives and before.collectives["all_reduce@axis0"]["count"] == 3
        assert after.compute_us == before.compute_us
        copies = sum(roofline_us(cm.hw, 0.0, 2 * t.numel() * 4, None, op_class="elementwise") for t in (a, b))
        ops = simulate_step(T.trace_fake(lambda a, b: (aten.mul.Tensor(a, 2.0), aten.mul.Tensor(b, 3.0),
                                                       aten.mul.Tensor(b, 4.0)))(a, b), cm, {})
        assert before.compute_us >= copies + ops.compute_us * 0.99
