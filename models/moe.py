"""Mixture-of-Experts layer: top-k router, grouped routed experts, shared experts.

FQNs (inside a block, prefix ``layers.i.moe``)::

    router.gate            Linear(dim, E), no bias
    experts.{w1,w3}        Parameter [E, hidden, dim]
    experts.w2             Parameter [E, dim, hidden]
    shared_experts.{w1,w2,w3}   SwiGLU FeedForward(dim, hidden * n_shared)  (optional)

Data flow of ``MoE.forward(x [B, S, D])`` on T = B*S tokens, K = top_k, E experts::

    top_scores [T, K] fp32, selected [T, K] int64, num_tokens_per_expert [E] int64
        = self.router(x_flat)
    y_routed [T, D] = self.dispatch(x_flat, top_scores, selected, num_tokens_per_expert)
    y = y_routed + self.shared_experts(x_flat)

Token dispatch seams (for expert-parallel recipes and the planner's ``local_map``)
-----------------------------------------------------------------------------------
There are two nested, replaceable seams; pick the one that fits the recipe.

1. ``moe.experts.forward(x_sorted, num_tokens_per_expert) -> out_sorted`` (narrow seam,
   TorchTitan's choice). ``x_sorted [N, D]`` holds the N = T*K token-slots grouped by
   expert in ascending expert order: rows ``[0, c0)`` go to expert 0, ``[c0, c0+c1)`` to
   expert 1, ... where ``c = num_tokens_per_expert`` (``int64 [E_local]``, sum ≤ N; rows
   past the sum are padding and come back as zeros). It returns ``[N, D]`` in the same
   row order, *unweighted* by router scores. The experts use ``self.w1.shape[0]`` as their
   expert count, so an EP recipe can shard ``w1/w2/w3`` on dim 0 (``Shard(0)``; DTensor
   weights are ``to_local()``-ed here) and wrap this module with an input hook that
   all-to-alls the rows/counts to the ranks owning the experts (and re-sorts them by
   local expert), plus an output hook that all-to-alls the results back to the original
   row order. Nothing outside ``experts`` has to change.

2. ``moe.dispatch(x, top_scores, selected, num_tokens_per_expert) -> y [T, D]`` (wide
   seam: permutation + experts + weighted un-permutation). Replace it by assigning an
   instance attribute, e.g. ``moe.dispatch = my_dispatch`` (a callable with the same
   signature, no ``self``), or wrap it in ``local_map``. The default permutes with a
   stable ``argsort`` of the expert ids, so the result is deterministic. By default it
   calls ``self.routed`` (:class:`RoutedDispatch`: :func:`routed_dispatch` with the expert
   weights as inputs), the module the auto planner traces as its ``moe_dispatch`` local_map
   region (parallel/auto/regions/moe_dispatch.py); a recipe that hooks ``experts`` (EP) sets
   ``experts_seam = True`` so the dispatch goes through seam 1 instead.

Expert computation: ``F.grouped_mm`` when the activations are bf16 (its CPU kernel
and its meta/fake kernel in torch 2.13 require bf16 and 16-byte aligned strides — then it
also traces under FakeTensorMode), otherwise a Python loop over experts on contiguous
slices (needs ``num_tokens_per_expert.tolist()``, i.e. real tensors; under FakeTensorMode
in fp32 the planner traces the ``moe_dispatch`` region instead, shaped by balanced routing).
No load-balancing loss (not needed for the debug runs); routing is plain top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .layers import INIT_STD, FeedForward, trunc_normal_


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts from softmax(gate(x)).

    ``route_norm`` renormalises the K scores to sum to one; ``route_scale`` multiplies
    them (DeepSeek's ``routed_scaling_factor``). Returns fp32 scores.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        route_scale: float = 1.0,
        route_norm: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.route_scale, self.route_norm = route_scale, route_norm
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, D]`` -> ``top_scores [T, K]``, ``selected [T, K]``, ``counts [E]``."""
        scores = F.softmax(self.gate(x).float(), dim=-1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=-1)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            top_scores = top_scores * self.route_scale
        # scatter_add (not bincount) keeps the output shape static for tracing.
        flat = selected.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        return top_scores, selected, counts

    def init_weights(self) -> None:
        trunc_normal_(self.gate.weight, INIT_STD)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as 3D weights; see the module docstring for the seam."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(
        self, x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """``x_sorted [N, D]`` grouped by expert, ``num_tokens_per_expert [E_local]`` -> ``[N, D]``."""
        return run_experts(x_sorted, num_tokens_per_expert, self.w1, self.w2, self.w3)

    def init_weights(self, out_std: float) -> None:
        trunc_normal_(self.w1, INIT_STD)
        trunc_normal_(self.w2, out_std)
        trunc_normal_(self.w3, out_std)


def run_experts(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The experts ``w1/w2/w3 [E_local, ...]`` on rows ``x [N, D]`` grouped by expert (counts ``[E_local]``)."""
    w1, w2, w3 = _local(w1), _local(w2), _local(w3)
    if _can_grouped_mm(x, w1, w2):
        return _experts_grouped_mm(x, counts, w1, w2, w3)
    return _experts_loop(x, counts, w1, w2, w3)


def sort_by_expert(selected: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the stable permutation of the ``T*K`` token-slots that groups them by
    expert, and the slots per expert ``[num_experts]``; slot ``order[i]`` is token ``order[i] // K``."""
    flat = selected.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), counts


def routed_dispatch(
    x: torch.Tensor,
    top_scores: torch.Tensor,
    selected: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """The wide seam as a function of tensors only: sort the token-slots by expert, run the
    experts, scatter-add the score-weighted results. ``x [T, D]`` -> ``[T, D]``."""
    order, counts = sort_by_expert(selected, w1.shape[0])
    token_idx = order // selected.shape[1]
    out = run_experts(x[token_idx], counts, w1, w2, w3)
    out = out * top_scores.flatten()[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add(0, token_idx, out.to(x.dtype))


class RoutedDispatch(nn.Module):
    """:func:`routed_dispatch` as a parameter-free module whose inputs include the expert
    weights: the planner traces it as its ``moe_dispatch`` local_map region (``local_map_region``,
    declared in parallel/auto/regions/moe_dispatch.py) and so places the experts (EP or dense)."""

    local_map_region = "moe_dispatch"

    def forward(self, x: torch.Tensor, top_scores: torch.Tensor, selected: torch.Tensor,
                w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        return routed_dispatch(x, top_scores, selected, w1, w2, w3)


def _can_grouped_mm(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    # torch 2.13 CPU + meta kernels: bf16 only, 16-byte aligned strides (dims % 8 == 0).
    return (
        x.dtype == torch.bfloat16
        and w1.dtype == torch.bfloat16
        and w1.shape[1] % 8 == 0
        and w1.shape[2] % 8 == 0
    )


def _experts_grouped_mm(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(F.grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * F.grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    out = F.grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    # rows past offs[-1] (padding) are left uninitialised (may be NaN): select, not multiply.
    valid = torch.arange(x.shape[0], device=x.device) < offs[-1]
    return torch.where(valid[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _experts_loop(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    sizes = counts.tolist()
    pad = x.shape[0] - sum(sizes)
    chunks = torch.split(x, sizes + [pad], dim=0)
    outs = []
    for e, xe in enumerate(chunks[:-1]):
        h = F.silu(xe @ w1[e].transpose(0, 1)) * (xe @ w3[e].transpose(0, 1))
        outs.append(h @ w2[e].transpose(0, 1))
    outs.append(torch.zeros_like(chunks[-1]))
    return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Routed experts (top-k of ``num_experts``) + optional always-on shared experts."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        num_shared_experts: int = 0,
        route_scale: float = 1.0,
        route_norm: bool = False,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, route_scale, route_norm)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.routed = RoutedDispatch()
        self.experts_seam = False  # True: dispatch calls self.experts (a recipe hooks it)
        self.shared_experts = (
            FeedForward(dim, hidden_dim * num_shared_experts) if num_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x_flat = x.reshape(bs * slen, dim)
        top_scores, selected, counts = self.router(x_flat)
        y = self.dispatch(x_flat, top_scores, selected, counts)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_flat)
        return y.reshape(bs, slen, dim)

    def dispatch(
        self,
        x: torch.Tensor,
        top_scores: torch.Tensor,
        selected: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        """Local dispatch: sort token-slots by expert, run ``self.experts``, scatter-add
        the score-weighted results back. ``x [T, D]`` -> ``[T, D]``. Replaceable seam.

        Unless a recipe hooks ``self.experts`` (the narrow seam: the EP recipe sets
        ``experts_seam``) this is ``self.routed`` (:class:`RoutedDispatch`, the same numbers),
        the region the planner places."""
        ex = self.experts
        if not self.experts_seam:
            return self.routed(x, top_scores, selected, ex.w1, ex.w2, ex.w3)
        order = torch.argsort(selected.flatten(), stable=True)  # [T*K]
        token_idx = order // self.top_k
        x_sorted = x[token_idx]
        out = self.experts(x_sorted, num_tokens_per_expert)
        out = out * top_scores.flatten()[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add(0, token_idx, out.to(x.dtype))

    def init_weights(self, out_std: float) -> None:
        self.router.init_weights()
        self.experts.init_weights(out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)
