"""runtime/loss_sync.py on a graph run for real (one gloo rank, in process): the token count
computed from the labels equals the `total_weight` of torch's `nll_loss_forward`, ignored
labels (-100) and all, so the loss and its gradient are unchanged."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from parallel.auto.runtime.loss_sync import count_loss_tokens_first


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _loss_and_grad(group, weight=None):
    def step(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits, -1)
        target = labels.view(-1)
        loss, total = torch.ops.aten.nll_loss_forward(logp, target, weight, 1, -100)
        total = funcol.all_reduce(total, "sum", group)
        grad = torch.ops.aten.nll_loss_backward(torch.ones(()), logp, target, weight, 1, -100, total)
        return loss, grad
    return step


def test_the_counted_tokens_give_the_same_loss_and_gradient(one_rank):
    torch.manual_seed(0)
    logits = torch.randn(12, 7)
    labels = torch.randint(0, 7, (3, 4))
    labels[0, :3] = -100  # ignored: 9 tokens count, not 12
    gm = make_fx(_loss_and_grad(one_rank))(logits, labels)
    expected = gm(logits, labels)
    assert count_loss_tokens_first(gm) == 1
    gm.recompile()
    nodes = list(gm.graph.nodes)
    reduce = next(n for n in nodes if getattr(n.target, "namespace", "") == "_c10d_functional"
                  and "all_reduce" in str(n.target))
    first_op = next(n for n in nodes if n.op == "call_function" and "log_softmax" in str(n.target))
    count = reduce.args[0]
    assert nodes.index(count) < nodes.index(first_op)  # counted before the forward's first op ...
    assert [a.op for a in count.args[0].args[0].all_input_nodes] == ["placeholder"]  # ... from the labels
    assert not any(n.target is operator.getitem and n.args[1] == 1 for n in nodes)  # total_weight unread
    got = gm(logits, labels)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(got[0], torch.nn.functional.cross_entropy(logits, labels.view(-1)), rtol=1e-6, atol=0)


def test_class_weights_are_left_as_traced(one_rank):
    """With class weights the count is a sum of weights, not of tokens: nothing to rewrite."""
    logits, labels = torch.randn(6, 5), torch.randint(0, 5, (6,))
    gm = make_fx(_loss_and_grad(one_rank, torch.rand(5)))(logits, labels)
    assert count_loss_tokens_first(gm) == 0
