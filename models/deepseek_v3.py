"""DeepSeek-V3 decoder: Multi-head Latent Attention (MLA, optional q LoRA) + MoE feed-forward.

Implemented as published: the router's score function (softmax | sigmoid), group-limited
routing (expert groups, groups kept), normalised and scaled top-k weights, aux-loss-free
balancing (expert bias updated from the token counts after each optimizer step), the
sequence-wise auxiliary loss as an option (models/moe.py), YaRN RoPE scaling with its
softmax mscale, q LoRA. Flavors: ``debug`` (CPU-sized, V3's routing), ``16B`` (shaped like
DeepSeek-V2-Lite: softmax, no groups, no q LoRA), ``671B`` (DeepSeek-V3's published dims).
Left out: multi-token prediction (MTP; an HF checkpoint's MTP layer is skipped on load) and
FP8 training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .layers import (
    INIT_STD,
    SDPA,
    ArgError,
    DecoderBase,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    YaRN,
    apply_rope,
    depth_init_std,
    trunc_normal_,
)
from .moe import MoE, check_routing


@dataclass
class DeepSeekV3Args:
    """Hyper-parameters. ``q_lora_rank = 0`` means a plain ``wq`` projection."""

    dim: int = 2048
    n_layers: int = 27
    n_dense_layers: int = 1
    n_heads: int = 16
    vocab_size: int = 102400
    inter_dim: int = 10944  # dense-layer FFN hidden
    moe_inter_dim: int = 1408  # per-expert hidden
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_activated_experts: int = 6
    route_scale: float = 1.0
    route_norm: bool = False
    score_func: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3)
    n_expert_groups: int = 1  # group-limited routing: equal groups of experts (1: none)
    n_limited_groups: int = 1  # a token chooses among the experts of its best groups
    load_balance_coeff: Optional[float] = None  # None: no expert bias; 0: bias kept as loaded
    moe_aux_loss_coeff: float = 0.0  # sequence-wise balance loss weight (0: off)
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    # YaRN RoPE scaling (HF rope_type "yarn"); factor 0: none
    rope_scaling_factor: float = 0.0
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0

    def __post_init__(self) -> None:
        check_routing(self.n_routed_experts, self.n_activated_experts, self.score_func, self.n_expert_groups,
                      self.n_limited_groups, self.route_scale, self.load_balance_coeff)
        if not self.moe_aux_loss_coeff >= 0:
            raise ArgError("moe_aux_loss_coeff", self.moe_aux_loss_coeff, "must be >= 0 (0: off; DeepSeek-V3 used "
                           "0.0001)")
        if self.q_lora_rank < 0:
            raise ArgError("q_lora_rank", self.q_lora_rank, "must be >= 0 (0: a plain wq projection)")
        if self.rope_scaling_factor and not self.rope_scaling_factor >= 1:
            raise ArgError("rope_scaling_factor", self.rope_scaling_factor, "YaRN's factor must be >= 1 (0: no "
                           "scaling)")
        if self.rope_original_max_seq_len < 1:
            raise ArgError("rope_original_max_seq_len", self.rope_original_max_seq_len, "must be >= 1")

    def rope_scaling(self) -> Optional[YaRN]:
        """YaRN for `RotaryEmbedding` (None when unscaled)."""
        if not self.rope_scaling_factor:
            return None
        return YaRN(self.rope_scaling_factor, self.rope_original_max_seq_len, self.rope_beta_fast,
                    self.rope_beta_slow, self.rope_mscale, self.rope_mscale_all_dim)

    @property
    def qk_head_dim(self) -> int:
        """Query/key head size: the non-rotary part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def override(self, **kw: object) -> DeepSeekV3Args:
        """A copy with ``kw`` replaced (nothing is derived, unlike Llama3Args)."""
        return dataclasses.replace(self, **kw)

    # ---- parameter / FLOP accounting (analytic; tests check it against the module) ----
    def attention_params(self) -> int:
        """Parameters of one MLA attention plus the block's two norms."""
        h, d = self.n_heads, self.dim
        q = (
            d * h * self.qk_head_dim
            if self.q_lora_rank == 0
            else d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        )
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d + 2 * d  # + wo + two block norms

    def _moe_params(self, n_experts: int) -> int:
        per_expert = 3 * self.dim * self.moe_inter_dim
        shared = 3 * self.dim * self.moe_inter_dim * self.n_shared_experts
        return n_experts * per_expert + shared + self.dim * self.n_routed_experts

    def _total(self, n_experts: int, exclude_embedding: bool) -> int:
        n_moe = self.n_layers - self.n_dense_layers
        n = self.n_layers * self.attention_params()
        n += self.n_dense_layers * 3 * self.dim * self.inter_dim
        n += n_moe * self._moe_params(n_experts)
        n += self.dim + self.vocab_size * self.dim  # final norm + output
        return n if exclude_embedding else n + self.vocab_size * self.dim

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Total parameters (every routed expert); ``exclude_embedding`` drops ``tok_embeddings``."""
        return self._total(self.n_routed_experts, exclude_embedding)

    def active_params(self, exclude_embedding: bool = True) -> int:
        """Parameters touched per token: only ``n_activated_experts`` routed experts."""
        return self._total(self.n_activated_experts, exclude_embedding)

    def flops_per_token(self, seq_len: int) -> float:
        """``6 N_active + 12 L H head_dim S`` with head_dim = mean of qk and v head dims
        (QK^T uses qk_head_dim, AV uses v_head_dim). Embedding excluded, output kept."""
        attn = 6 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        return float(6 * self.active_params() + attn)


DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # CPU-sized, with V3's routing (no expert bias: auto-mode jobs use it; set load_balance_coeff for one)
    "debug": DeepSeekV3Args(
        dim=256, n_layers=3, n_dense_layers=1, n_heads=8, vocab_size=256, inter_dim=768,
        moe_inter_dim=256, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        score_func="sigmoid", n_expert_groups=4, n_limited_groups=2, route_norm=True, route_scale=2.5,
        q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, max_seq_len=2048,
    ),
    # DeepSeek-V2-Lite shape (15.7B total, ~2.4B active).
    "16B": DeepSeekV3Args(),
    # DeepSeek-V3 as published (671B total, 37B active; without its MTP module); 163840 = 40 x 4096 positions
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, vocab_size=129280, inter_dim=18432,
        moe_inter_dim=2048, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8,
        score_func="sigmoid", n_expert_groups=8, n_limited_groups=4, route_scale=2.5, route_norm=True,
        load_balance_coeff=1e-3, moe_aux_loss_coeff=1e-4, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, max_seq_len=163840,
        rope_scaling_factor=40.0, rope_original_max_seq_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
        rope_mscale=1.0, rope_mscale_all_dim=1.0,
    ),
}


class MLAttention(nn.Module):
    """Multi-head Latent Attention (no KV cache; training form).

    q: ``wq`` or ``wq_b(q_norm(wq_a x))`` -> [nope | rope] per head.
    kv: ``wkv_a x`` -> [latent (kv_lora_rank) | k_rope (shared by all heads)];
    ``wkv_b(kv_norm(latent))`` -> [k_nope | v] per head. RoPE only on the rope parts.
    q/k head dim is ``qk_nope + qk_rope`` (192), v head dim ``v_head_dim`` (128).
    ``F.scaled_dot_product_attention`` on CPU in torch 2.13 *accepts* a smaller v head dim,
    but then silently takes the math path (bmm + softmax, materialising the [S, S] scores,
    and different ATen ops from the other models). So v is zero-padded to the q/k head dim
    before ``sdpa`` and the output sliced back: the fused
    ``_scaled_dot_product_flash_attention_for_cpu`` kernel is used (O(S) memory, one op
    the planner has a sharding rule for) and the ``sdpa`` seam always sees equal head dims.
    The padded columns of the output are exactly zero and get no gradient.
    Scale = 1/sqrt(qk_head_dim) (the SDPA default) x YaRN's mscale^2 (``q_scale``, 1 without
    YaRN), applied to q so that every ``sdpa`` replacement (ring attention) sees it.
    """

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        d, h = args.dim, args.n_heads
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        )
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(d, h * args.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, h * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, d, bias=False)
        self.sdpa = SDPA()
        yarn = args.rope_scaling()
        self.q_scale = yarn.softmax_scale() if yarn is not None else 1.0

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.nope + self.rope_dim)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1)

        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)  # [B, S, 1, rope]
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, seqlen, -1, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        if self.q_scale != 1.0:
            q = q * self.q_scale
        pad = q.shape[-1] - self.v_dim
        if pad > 0:  # see class docstring: keep SDPA on the fused (flash) CPU kernel
            v = F.pad(v, (0, pad))
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out[..., : self.v_dim]
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        if self.q_lora_rank == 0:
            trunc_normal_(self.wq.weight, INIT_STD)
        else:
            trunc_normal_(self.wq_a.weight, INIT_STD)
            self.q_norm.init_weights()
            trunc_normal_(self.wq_b.weight, INIT_STD)
        trunc_normal_(self.wkv_a.weight, INIT_STD)
        self.kv_norm.init_weights()
        trunc_normal_(self.wkv_b.weight, INIT_STD)
        trunc_normal_(self.wo.weight, out_std)


class DeepSeekV3Block(nn.Module):
    """Pre-norm block; layers ``< n_dense_layers`` have ``feed_forward``, the rest ``moe``."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = MLAttention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(
                args.dim,
                args.moe_inter_dim,
                args.n_routed_experts,
                args.n_activated_experts,
                args.n_shared_experts,
                args.route_scale,
                args.route_norm,
                score_func=args.score_func,
                n_groups=args.n_expert_groups,
                n_limited_groups=args.n_limited_groups,
                load_balance_coeff=args.load_balance_coeff,
                aux_loss_coeff=args.moe_aux_loss_coeff,
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        std = depth_init_std(self.layer_id)
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(std)


class DeepSeekV3Model(DecoderBase):
    """FQNs: tok_embeddings, rope.{cos,sin} [max_seq_len, qk_rope_head_dim],
    layers.i.{attention_norm, attention.{wq | wq_a,q_norm,wq_b}, attention.{wkv_a,kv_norm,
    wkv_b,wo,sdpa}, ffn_norm, feed_forward.{w1,w2,w3} | moe.{router.gate, experts.{w1,w2,w3},
    shared_experts.{w1,w2,w3}, expert_bias (buffer, with load_balance_coeff)}}, norm, output."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling())
        self.layers = nn.ModuleList(DeepSeekV3Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
