"""The loss's all-reduces off the step's critical path: no barrier between forward and backward.

A mean cross-entropy over a batch sharded across ranks divides by the number of tokens
counted on *every* rank: DTensor's `nll_loss_forward` strategy returns that count
(`total_weight`) as a Partial sum, and the plan all-reduces it before `nll_loss_backward`
reads it; the loss itself is all-reduced for the step's output. Traced as is, the count is
an output of the forward's last op and the backward's seed is `ones_like` of the reduced
loss, so the backward waits for both all-reduces: a barrier of all ranks between forward
and backward, which torch's DDP (each rank's own mean, the gradients averaged) does not
have. Two rewrites remove it:

  * without class weights the count is `(labels != ignore_index).sum()`, known before the
    forward runs: it is computed from the labels right after the graph's inputs, so the
    overlap pass (runtime/schedule.py) starts its all-reduce there and the backward finds
    it done (`count_loss_tokens_first`);
  * the seed is `ones` of the loss's shape, which needs no value of the loss, so the loss's
    all-reduce is waited for by the step's output only (`seed_backward_without_waiting`).
    The seed is marked `BACKWARD_SEED` in its meta: where the step simulation
    (cost/simulate.py) starts the backward.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from parallel import _torch as T
from parallel.auto.cost.simulate import BACKWARD_SEED
from parallel.auto.losses import NLL_FORWARD, is_mean_nll_without_weights

_ONES_LIKE = torch.ops.aten.ones_like.default
WHOLE_VIEWS = {"view", "_unsafe_view", "reshape", "flatten"}  # the same elements, another shape


def _feeds_output(x: Any, outputs: set) -> bool:
    """`x` is a value the graph outputs, itself or as a reshaping."""
    return isinstance(x, fx.Node) and (x in outputs or any(
        u in outputs and u.op == "call_function" and T.op_name(u.target) in WHOLE_VIEWS for u in x.users))


def _labels_source(target: fx.Node) -> fx.Node:
    """The graph input `target` is a reshaping of (same elements), else `target` itself."""
    n = target
    while n.op == "call_function" and isinstance(n.target, T.OpOverload) and T.op_name(n.target) in WHOLE_VIEWS:
        n = n.args[0]
    return n if n.op == "placeholder" else target


def _total_weight(n: fx.Node) -> fx.Node | None:
    """The getitem of `n`'s `total_weight` output that a collective reads, when `n` is a mean
    `nll_loss_forward` without class weights; else None."""
    if not is_mean_nll_without_weights(n):
        return None
    for u in n.users:
        if u.target is operator.getitem and u.args[1] == 1 and any(
                getattr(c.target, "namespace", "") == "_c10d_functional" for c in u.users):
            return u
    return None


def loss_off_the_critical_path(gm: Any) -> int:
    """Both rewrites on a step graph; returns how many nodes they replaced (the caller
    regenerates the code)."""
    return count_loss_tokens_first(gm) + seed_backward_without_waiting(gm)


def seed_backward_without_waiting(gm: Any) -> int:
    """Replace `ones_like(x)` of a value the graph outputs (the loss) by `ones` of its shape, dtype and
    device, marked `BACKWARD_SEED`. Returns how many."""
    graph = gm.graph
    outputs = set(graph.output_node().all_input_nodes)
    changed = 0
    for n in list(graph.find_nodes(op="call_function", target=_ONES_LIKE)):
        val = n.meta.get("val")
        if not n.args or not _feeds_output(n.args[0], outputs) or not isinstance(val, torch.Tensor) \
                or not val.is_contiguous():
            continue
        with graph.inserting_before(n):
            seed = graph.call_function(torch.ops.aten.ones.default, (list(val.shape),),
                                       {"dtype": val.dtype, "device": val.device})
        seed.meta.update(n.meta)
        seed.meta[BACKWARD_SEED] = True
        n.replace_all_uses_with(seed)
        graph.erase_node(n)
        changed += 1
    return changed


def count_loss_tokens_first(gm: Any) -> int:
    """Rewrite every all-reduced `total_weight` of a mean `nll_loss_forward` into a count of
    the labels computed after the graph's last input. Returns how many; the caller
    regenerates the code."""
    graph = gm.graph
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    changed = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not NLL_FORWARD:
            continue
        weight = _total_weight(n)
        if weight is None:
            continue
        labels, ignore_index = _labels_source(n.args[1]), n.args[4]
        dtype = weight.meta["val"].dtype
        where = last_input if labels.op == "placeholder" else labels
        with graph.inserting_after(where):
            kept = graph.call_function(torch.ops.aten.ne.Scalar, (labels, ignore_index))
        with graph.inserting_after(kept):
            count = graph.call_function(torch.ops.aten.sum.default, (kept,))
        with graph.inserting_after(count):
            as_weight = graph.call_function(torch.ops.aten._to_copy.default, (count,), {"dtype": dtype})
        val = labels.meta["val"].ne(ignore_index)  # fake tensors: shapes and dtypes only
        kept.meta["val"] = val
        count.meta["val"] = val.sum()
        as_weight.meta["val"] = count.meta["val"].to(dtype)
        weight.replace_all_uses_with(as_weight)
        graph.erase_node(weight)
        changed += 1
    return changed
