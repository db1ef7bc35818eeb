"""Qwen3-MoE: Qwen3 attention (GQA, explicit ``head_dim``, per-head q/k RMSNorm before RoPE)
with a routed-experts feed-forward in every layer (models/moe.py's `MoE`).

Routing as in Hugging Face's ``Qwen3MoeSparseMoeBlock``: softmax over all experts, top-k,
then (``norm_topk_prob``, our ``route_norm``) the k scores renormalised to sum to one; no
shared expert, no routing scale. Not implemented (an HF config that uses them is refused
by models/hf.py): dense layers between MoE layers (``decoder_sparse_step`` > 1,
``mlp_only_layers``), sliding-window attention, the router's auxiliary load-balancing loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import Attention, DecoderBase, RMSNorm, RotaryEmbedding, depth_init_std
from .moe import MoE
from .qwen3 import Qwen3Args


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    """Qwen3 hyper-parameters plus the experts'. ``ffn_hidden_dim`` must stay 0: no layer has
    a dense FFN (HF's ``intermediate_size`` only sizes the dense layers we do not implement)."""

    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    ffn_hidden_dim: int = 0
    moe_inter_dim: int = 768  # per-expert hidden (HF moe_intermediate_size)
    n_routed_experts: int = 128  # HF num_experts
    n_activated_experts: int = 8  # HF num_experts_per_tok
    route_norm: bool = True  # HF norm_topk_prob
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ffn_hidden_dim:
            raise ValueError(f"ffn_hidden_dim = {self.ffn_hidden_dim}: qwen3_moe has no dense FFN (every layer "
                             "is MoE); set moe_inter_dim for the experts' hidden size instead")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            raise ValueError(f"n_activated_experts = {self.n_activated_experts}: must be in 1..n_routed_experts "
                             f"({self.n_routed_experts})")

    # ---- parameter / FLOP accounting (analytic; tests check it against the module) ----
    def _layer(self, n_experts: int) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * (2 * q + 2 * kv) + 2 * self.head_dim  # + q/k norms
        moe = n_experts * 3 * self.dim * self.moe_inter_dim + self.dim * self.n_routed_experts  # + router
        return attn + moe + 2 * self.dim  # + the block's two norms

    def layer_params(self) -> int:
        """Parameters of one block: attention (+ q/k norms), router, every expert, two norms."""
        return self._layer(self.n_routed_experts)

    def active_params(self, exclude_embedding: bool = True) -> int:
        """Parameters touched per token: the router and only ``n_activated_experts`` experts."""
        n = self.n_layers * self._layer(self.n_activated_experts) + self.dim + self.vocab_size * self.dim
        return n if exclude_embedding else n + self.vocab_size * self.dim


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    # head_dim 64 != 256 / 8 as in qwen3's debug; 8 experts so that EP degrees 2, 4, 8 divide them.
    "debug": Qwen3MoeArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=256, moe_inter_dim=128,
        n_routed_experts=8, n_activated_experts=2, max_seq_len=2048,
    ),
    # Hugging Face Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json
    "30B-A3B": Qwen3MoeArgs(),
    "235B-A22B": Qwen3MoeArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, moe_inter_dim=1536),
}


class Qwen3MoeBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + moe(norm(h))``."""

    def __init__(self, layer_id: int, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, True, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args.dim, args.moe_inter_dim, args.n_routed_experts, args.n_activated_experts,
                       num_shared_experts=0, route_norm=args.route_norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self) -> None:
        std = depth_init_std(self.layer_id)
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std)
        self.moe.init_weights(std)


class Qwen3MoeModel(DecoderBase):
    """FQNs: tok_embeddings, rope.{cos,sin}, layers.i.{attention_norm, attention.{wq,wk,wv,wo,
    q_norm,k_norm,sdpa}, ffn_norm, moe.{router.gate, experts.{w1,w2,w3}}}, norm, output."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling())
        self.layers = nn.ModuleList(Qwen3MoeBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
