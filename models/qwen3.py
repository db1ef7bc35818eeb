"""Qwen3 (dense): LLaMA-style decoder with explicit ``head_dim`` (≠ dim / n_heads),
per-head RMSNorm on q and k applied before RoPE, untied output projection."""

from __future__ import annotations

from dataclasses import dataclass

from .llama3 import Llama3Args, Llama3Model


@dataclass
class Qwen3Args(Llama3Args):
    """Qwen3 hyper-parameters (``head_dim`` is explicit; ``qk_norm`` on)."""

    dim: int = 5120
    n_layers: int = 64
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    ffn_hidden_dim: int = 25600
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 4096
    qk_norm: bool = True


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # head_dim 64 != 256 / 8 on purpose, to exercise the general path.
    "debug": Qwen3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, vocab_size=256,
        ffn_hidden_dim=768, max_seq_len=2048,
    ),
    "32B": Qwen3Args(),
}


class Qwen3Model(Llama3Model):
    """Same FQNs as LLaMA 3 plus ``layers.i.attention.{q_norm,k_norm}`` (weight [head_dim])."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)
