"""LLaMA 3 (dense decoder with GQA and RoPE). Qwen3 reuses this with per-head q/k norm."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from .layers import DecoderBase, RMSNorm, RotaryEmbedding, TransformerBlock


@dataclass
class Llama3Args:
    """Hyper-parameters; ``head_dim = 0`` means ``dim // n_heads``."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 0
    vocab_size: int = 128256
    ffn_hidden_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    qk_norm: bool = False
    # LLaMA 3.1 RoPE scaling (HF rope_type "llama3"); factor 0: none
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads

    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """(factor, low, high, original length) for `RotaryEmbedding`, None when unscaled."""
        if self.rope_scaling_factor <= 0:
            return None
        return (self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_seq_len)

    def override(self, **kw: object) -> Llama3Args:
        """``dataclasses.replace`` that re-derives ``head_dim`` when it was derived and
        ``dim``/``n_heads`` change (so ``dim=512`` on the debug flavor stays consistent)."""
        derived = self.head_dim == self.dim // self.n_heads and type(self).head_dim == 0
        if derived and "head_dim" not in kw and ("dim" in kw or "n_heads" in kw):
            kw["head_dim"] = 0
        return dataclasses.replace(self, **kw)

    # ---- parameter / FLOP accounting (analytic; tests check it against the module) ----
    def layer_params(self) -> int:
        """Parameters of one block: attention (+ q/k norms), SwiGLU FFN, two norms."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * (2 * q + 2 * kv) + (2 * self.head_dim if self.qk_norm else 0)
        return attn + 3 * self.dim * self.ffn_hidden_dim + 2 * self.dim

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Total parameters; ``exclude_embedding`` drops ``tok_embeddings`` only."""
        emb = self.vocab_size * self.dim
        n = self.n_layers * self.layer_params() + self.dim + self.vocab_size * self.dim
        return n if exclude_embedding else n + emb

    def active_params(self, exclude_embedding: bool = True) -> int:
        """Parameters touched per token (all of them: a dense model)."""
        return self.num_params(exclude_embedding)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 N_active + 12 L H head_dim S``.

        ``N_active`` excludes the token embedding (a lookup, no matmul) but keeps the
        output projection. The second term is causal-agnostic attention (QK^T and AV).
        """
        attn = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return float(6 * self.active_params() + attn)


LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    # Byte-level vocab; 8 heads / 4 kv heads so TP degrees 2 and 4 divide both.
    "debug": Llama3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
        ffn_hidden_dim=768, max_seq_len=2048,
    ),
    "8B": Llama3Args(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        ffn_hidden_dim=14336, rope_theta=500000.0,
    ),
    "70B": Llama3Args(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        ffn_hidden_dim=28672, rope_theta=500000.0,
    ),
    # LLaMA 3.1 405B as published (Meta's params.json): 126 layers, RoPE scaled x8 from 8192
    "405B": Llama3Args(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
        ffn_hidden_dim=53248, rope_theta=500000.0, max_seq_len=131072, rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192,
    ),
}


class Llama3Model(DecoderBase):
    """FQNs: tok_embeddings, rope.{cos,sin} (buffers), layers.i.{attention_norm,
    attention.{wq,wk,wv,wo,sdpa}, ffn_norm, feed_forward.{w1,w2,w3}}, norm, output."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling())
        self.layers = nn.ModuleList(
            TransformerBlock(
                layer_id=i,
                dim=args.dim,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads,
                head_dim=args.head_dim,
                ffn_hidden_dim=args.ffn_hidden_dim,
                norm_eps=args.norm_eps,
                qk_norm=args.qk_norm,
            )
            for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
