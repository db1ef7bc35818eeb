"""The MoE token dispatch as a local_map region (regions/): ``moe_dispatch``.

Region: ``models.moe.routed_dispatch(x [T, D], top_scores [T, K], selected [T, K], w1, w2, w3)
-> y [T, D]`` (the experts' weights ``[E, ...]`` are inputs, so the planner places them).
The router and the shared experts stay ordinary ops around it. Options per mesh axis:

* ``expert_parallel``: tokens Shard(0), experts Shard(0) (E/n experts per rank): inside, the token-slots
  go all-to-all (with counts) to the rank owning their expert and their results come back
  (parallel/recipes/ep.py's dispatch/combine on the axis's process group). Several such
  axes nest: the experts' Shard(0) splits over the axes in mesh order, and so does the
  dispatch (first over the outer axis, then within).
* ``dense_experts``: tokens Shard(0), experts Replicate: each rank runs all experts on its own tokens;
  the experts' gradients are Partial (summed by the plan's reduction).
* ``replicated`` (always there): everything whole, each rank computes the whole region.

Planning: fake tensors carry no routing, so the region's shapes and FLOPs come from
balanced routing (every expert gets ``T*K/E`` token-slots, :func:`balanced_dispatch`), and an
``expert_parallel`` axis prices its all-to-all bytes (``T_local*K*D`` out and back) times the imbalance
factor (the cost model's ``routing_imbalance``: ``[parallelism] moe_imbalance_factor``; see the README for
the default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from models.moe import routed_dispatch, run_experts, sort_by_expert
from parallel import _torch as T
from parallel.auto.regions.declaration import Option, Region
from parallel.auto.regions.layout import RegionContext
from parallel.auto.regions.ops import declare
from parallel.recipes.ep import ep_combine_tokens, ep_dispatch_tokens

NAME = "moe_dispatch"
EP, DENSE = "expert_parallel", "dense_experts"  # option names (plan summaries show them)


def balanced_dispatch(x: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """`routed_dispatch` under balanced routing, for fake/meta tensors: the T*K token-slots
    split evenly over the E experts (one batched matmul per weight), same output shape."""
    t, k = selected.shape
    e = w1.shape[0]
    per = max(1, math.ceil(t * k / e))
    slots = x.repeat(k, 1)
    slots = torch.cat([slots, slots.new_zeros(e * per - t * k, x.shape[1])]) if e * per > t * k else slots
    xe = slots[: e * per].reshape(e, per, x.shape[1])
    h = torch.nn.functional.silu(torch.bmm(xe, w1.transpose(1, 2))) * torch.bmm(xe, w3.transpose(1, 2))
    out = torch.bmm(h, w2.transpose(1, 2)).reshape(e * per, -1)[: t * k].reshape(k, t, -1)
    return (out * top_scores.t().unsqueeze(-1).to(out.dtype)).sum(0).to(x.dtype)


def local_dispatch(ctx: RegionContext, x: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor,
                   w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """The region on this rank's shards: local tokens, this rank's experts (nested all-to-all
    over the expert-parallel axes, outer first), score-weighted scatter-add back to the local tokens."""
    ep_axes = ctx.axes_with(EP)
    n_experts = w1.shape[0] * math.prod(a.size for a in ep_axes)
    order, counts = sort_by_expert(selected, n_experts)
    token_idx = order // selected.shape[1]
    rows, states = x[token_idx], []
    for a in ep_axes:
        rows, counts, state = ep_dispatch_tokens(rows, counts, T.process_group(a.group), a.size)
        states.append(state)
    out = run_experts(rows, counts, w1, w2, w3)
    for state in reversed(states):
        out = ep_combine_tokens(out, state)
    out = out * top_scores.flatten()[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add(0, token_idx, out.to(x.dtype))


def slot_elements(shapes: Sequence[tuple[int, ...]]) -> float:
    """Elements one rank sends one way under balanced routing: its T_local*K token-slots of
    width D (the cost model prices them x its routing imbalance)."""
    (t, d), (_, k) = shapes[0], shapes[2]
    return t * k * d


def moe_region() -> Region:
    """The ``moe_dispatch`` region."""
    s0, rep, part = Shard(0), Replicate(), Partial()
    ep = Option(EP, (s0,) * 6, (s0,), exchange=slot_elements)
    dp = Option(DENSE, (s0, s0, s0, rep, rep, rep), (s0,), grads=(s0, s0, s0, part, part, part))
    return Region(NAME, [ep, dp], fn=routed_dispatch, local_fn=local_dispatch, meta_fn=balanced_dispatch)


REGION = declare(moe_region())
