"""Mixture-of-Experts layer: top-k router, grouped routed experts, shared experts.

FQNs (inside a block, prefix ``layers.i.moe``)::

    router.gate            Linear(dim, E), no bias
    expert_bias            buffer [E] fp32, persistent (only with load_balance_coeff)
    tokens_per_expert      buffer [E] int64, not persistent (likewise)
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
Routing (`TokenChoiceTopKRouter`): softmax or sigmoid scores, optional group-limited choice
and expert bias (DeepSeek-V3), normalised and scaled top-k weights; softmax and plain top-k
by default. Balancing: DeepSeek-V3's aux-loss-free expert bias and, as an option, its
sequence-wise auxiliary loss (see `MoE`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .layers import INIT_STD, ArgError, FeedForward, trunc_normal_

SCORE_FUNCS = ("softmax", "sigmoid")


def check_routing(num_experts: int, top_k: int, score_func: str = "softmax", n_groups: int = 1,
                  n_limited_groups: int = 1, route_scale: float = 1.0,
                  load_balance_coeff: Optional[float] = None, keys: Optional[dict[str, str]] = None) -> None:
    """Raise `ArgError` for routing options the layer's shape cannot take (before any work).
    ``keys``: the argument names the caller uses (default: DeepSeek-V3's ``n_routed_experts``, ...)."""
    k = {"num_experts": "n_routed_experts", "top_k": "n_activated_experts", "score_func": "score_func",
         "n_groups": "n_expert_groups", "n_limited_groups": "n_limited_groups", "route_scale": "route_scale",
         "load_balance_coeff": "load_balance_coeff", **(keys or {})}
    if score_func not in SCORE_FUNCS:
        raise ArgError(k["score_func"], score_func, f"must be one of {', '.join(map(repr, SCORE_FUNCS))}")
    if n_groups < 1 or num_experts % n_groups:
        raise ArgError((k["n_groups"], k["num_experts"]), n_groups,
                       f"must divide {k['num_experts']} = {num_experts} (equal groups of experts); set a divisor "
                       f"of {num_experts}, or 1 for no groups")
    if n_groups > 1 and num_experts // n_groups < 2:
        raise ArgError((k["n_groups"], k["num_experts"]), n_groups,
                       f"leaves {num_experts // n_groups} expert per group; a group is scored by its two best "
                       f"experts, so each needs >= 2: set at most {num_experts // 2}")
    if not 1 <= n_limited_groups <= n_groups:
        raise ArgError((k["n_limited_groups"], k["n_groups"]), n_limited_groups,
                       f"groups kept must be between 1 and {k['n_groups']} = {n_groups}")
    kept = n_limited_groups * (num_experts // n_groups)
    if not 1 <= top_k <= kept:
        raise ArgError((k["top_k"], k["n_limited_groups"], k["n_groups"], k["num_experts"]), top_k,
                       f"must be between 1 and the {kept} experts of the kept groups ({k['n_limited_groups']} = "
                       f"{n_limited_groups} of {n_groups} groups of {num_experts // n_groups}); lower it or keep "
                       "more groups")
    if not route_scale > 0:
        raise ArgError(k["route_scale"], route_scale, "must be > 0 (1.0: the weights as scored)")
    if load_balance_coeff is not None and not load_balance_coeff >= 0:
        raise ArgError(k["load_balance_coeff"], load_balance_coeff,
                       "must be >= 0 (0: the expert bias is kept as it is; DeepSeek-V3 used 0.001)")


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts by score: ``softmax`` or ``sigmoid`` of gate(x).

    Group-limited routing (``n_groups > 1``, DeepSeek-V3): the experts form equal groups, a
    group scores the sum of its two best expert scores, and a token chooses only among the
    experts of its ``n_limited_groups`` best groups (bounds the nodes a token is sent to).
    ``expert_bias`` (aux-loss-free balancing) is added to the scores for these choices only:
    the weights are the unbiased scores of the chosen experts. ``route_norm`` renormalises the
    K weights to sum to one; ``route_scale`` multiplies them (``routed_scaling_factor``).
    Returns fp32 weights.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        route_scale: float = 1.0,
        route_norm: bool = False,
        *,
        score_func: str = "softmax",
        n_groups: int = 1,
        n_limited_groups: int = 1,
    ) -> None:
        super().__init__()
        check_routing(num_experts, top_k, score_func, n_groups, n_limited_groups, route_scale,
                      keys={"num_experts": "num_experts", "top_k": "top_k", "n_groups": "n_groups"})
        self.num_experts, self.top_k = num_experts, top_k
        self.route_scale, self.route_norm = route_scale, route_norm
        self.score_func, self.n_groups, self.n_limited_groups = score_func, n_groups, n_limited_groups
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, D]`` -> ``top_scores [T, K]``, ``selected [T, K]``, ``counts [E]``."""
        scores = self.scores(x)
        if expert_bias is None and self.n_groups == 1:
            top_scores, selected = torch.topk(scores, k=self.top_k, dim=-1)
        else:
            selected = torch.topk(self.choice_scores(scores, expert_bias), k=self.top_k, dim=-1).indices
            top_scores = scores.gather(1, selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            top_scores = top_scores * self.route_scale
        # scatter_add (not bincount) keeps the output shape static for tracing.
        flat = selected.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        return top_scores, selected, counts

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert's fp32 score ``[T, E]``: softmax or sigmoid of the gate's logits."""
        logits = self.gate(x).float()
        return F.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)

    def choice_scores(self, scores: torch.Tensor, expert_bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The scores experts are chosen by: + ``expert_bias``, and -inf outside the kept groups."""
        choice = scores if expert_bias is None else scores + expert_bias.float()
        if self.n_groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.n_groups, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = group_scores.topk(self.n_limited_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def init_weights(self) -> None:
        trunc_normal_(self.gate.weight, INIT_STD)


def sequence_balance_loss(scores: torch.Tensor, selected: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, the mean over the ``batch`` sequences of
    ``sum_i f_i P_i``: ``f_i`` = E / (K S) x the token-slots of the sequence routed to expert i,
    ``P_i`` = the sequence's mean of expert i's score normalised over the experts.
    ``scores [B*S, E]`` (unbiased), ``selected [B*S, K]``."""
    t, e = scores.shape
    s, k = t // batch, selected.shape[1]
    p = (scores / scores.sum(dim=-1, keepdim=True)).view(batch, s, e).mean(dim=1)  # [B, E]
    slots = selected.reshape(batch, s * k)
    f = torch.zeros(batch, e, dtype=scores.dtype, device=scores.device)
    f = f.scatter_add(1, slots, torch.ones_like(slots, dtype=scores.dtype)) * (e / (k * s))
    return (f * p).sum(dim=-1).mean()


class AuxLossGrad(torch.autograd.Function):
    """``y`` unchanged forward; backward also sends the gradient ``scale`` into ``aux``: an
    auxiliary loss trains what it depends on without being added to the model's output
    (DeepSeek's way), so the loss the trainer computes and logs stays the language-model loss."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


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
    # unbind, not w[e]: indexing's backward writes each expert's gradient into a zeroed
    # [E, ...] buffer and adds those up (E full-size fills and adds a weight); unbind's stacks once
    w1s, w2s, w3s = w1.unbind(0), w2.unbind(0), w3.unbind(0)
    outs = []
    for e, xe in enumerate(chunks[:-1]):
        h = F.silu(xe @ w1s[e].transpose(0, 1)) * (xe @ w3s[e].transpose(0, 1))
        outs.append(h @ w2s[e].transpose(0, 1))
    outs.append(torch.zeros_like(chunks[-1]))
    return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Routed experts (top-k of ``num_experts``) + optional always-on shared experts.

    Balancing (DeepSeek-V3): ``load_balance_coeff`` not None registers ``expert_bias`` (a
    persistent fp32 buffer, outside the gradient; only the router's choices see it) and the
    ``tokens_per_expert`` counter (non-persistent) that training forwards add to when the
    coefficient is > 0; after each optimizer step the trainer sums the counters over all ranks
    and calls `update_expert_bias` (0: the bias is kept as loaded). Activation checkpointing
    recomputes the forward and so counts every token twice: every expert alike, so the sign the
    update takes is unchanged. ``aux_loss_coeff`` > 0 adds the sequence-wise balance loss
    (`sequence_balance_loss`) through the gradient only (`AuxLossGrad`): the returned output and
    the logged loss are the model's own.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        num_shared_experts: int = 0,
        route_scale: float = 1.0,
        route_norm: bool = False,
        *,
        score_func: str = "softmax",
        n_groups: int = 1,
        n_limited_groups: int = 1,
        load_balance_coeff: Optional[float] = None,
        aux_loss_coeff: float = 0.0,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, route_scale, route_norm, score_func=score_func,
                                            n_groups=n_groups, n_limited_groups=n_limited_groups)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.routed = RoutedDispatch()
        self.experts_seam = False  # True: dispatch calls self.experts (a recipe hooks it)
        self.shared_experts = (
            FeedForward(dim, hidden_dim * num_shared_experts) if num_shared_experts > 0 else None
        )
        self.load_balance_coeff, self.aux_loss_coeff = load_balance_coeff, aux_loss_coeff
        self.aux_grad_scale = 1.0  # the trainer sets 1 / micro-batches: the aux loss is a mean like the loss
        with_bias = load_balance_coeff is not None
        self.register_buffer("expert_bias", torch.zeros(num_experts) if with_bias else None, persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64) if with_bias else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x_flat = x.reshape(bs * slen, dim)
        top_scores, selected, counts = self.router(x_flat, self.expert_bias)
        if self.load_balance_coeff and self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        y = self.dispatch(x_flat, top_scores, selected, counts)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_flat)
        if self.aux_loss_coeff and self.training and torch.is_grad_enabled():
            aux = sequence_balance_loss(self.router.scores(x_flat), selected, bs)
            y = AuxLossGrad.apply(y, aux, self.aux_loss_coeff * self.aux_grad_scale)
        return y.reshape(bs, slen, dim)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's aux-loss-free balancing step from ``counts [E]`` (token-slots per expert,
        summed over the ranks): ``bias += coeff * sign(mean - count)`` (an overloaded expert gets
        chosen less, an idle one more), then the counter restarts."""
        c = counts.to(torch.float32)
        step = self.load_balance_coeff * torch.sign(c.mean() - c)
        self.expert_bias.add_(step.to(self.expert_bias.dtype))
        self.tokens_per_expert.zero_()

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
        if self.expert_bias is not None:
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)
