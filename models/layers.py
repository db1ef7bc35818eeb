"""Building blocks shared by the models: RMSNorm, RoPE, attention (SDPA seam), SwiGLU.

Single-device code only. Parallel recipes and the planner rely on the module/parameter
names (FQNs) defined here, so keep them stable:

    attention.{wq,wk,wv,wo}        Linear, no bias
    attention.{q_norm,k_norm}      per-head RMSNorm (Qwen3 only, ``qk_norm=True``)
    attention.sdpa                 ``SDPA`` module: forward(q, k, v) on [B, H, S, head_dim]
    feed_forward.{w1,w2,w3}        SwiGLU: w2(silu(w1 x) * w3 x)

Layout conventions: activations are ``[B, S, ...]``; head views use ``view(B, S, -1, hd)``
so that a tensor-parallel recipe that shards the projections sees its local head count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Std of the truncated-normal init used for most Linear weights (TorchTitan default).
INIT_STD = 0.02


class ArgError(ValueError):
    """A model argument the model's shape cannot take. ``keys``: the argument, then the ones it
    conflicts with (a job's config names the first of them it sets); ``fix`` says what to do."""

    def __init__(self, keys: str | tuple[str, ...], value: object, fix: str) -> None:
        self.keys = (keys,) if isinstance(keys, str) else tuple(keys)
        self.value, self.fix = value, fix
        super().__init__(f"{self.keys[0]} = {value!r}: {fix}")


def trunc_normal_(t: torch.Tensor, std: float) -> None:
    """Truncated normal N(0, std) clipped to [-3 std, 3 std], by inverse CDF.

    Not ``nn.init.trunc_normal_``: in torch 2.13 that one uses rejection sampling with
    ``.item()``/``.any()``, which fails under FakeTensorMode (the planner materialises
    models there) and draws a data-dependent amount of randomness. This form uses a
    fixed number of elementwise ops, so it is deterministic and traceable.
    """
    lo = (1.0 + math.erf(-3.0 / math.sqrt(2.0))) / 2.0  # CDF(-3)

    def draw(x: torch.Tensor) -> None:
        x.uniform_(2 * lo - 1, 1 - 2 * lo)  # symmetric: CDF(3) = 1 - CDF(-3)
        x.erfinv_()
        x.mul_(std * math.sqrt(2.0))
        x.clamp_(min=-3 * std, max=3 * std)

    with torch.no_grad():
        draw_like_cpu(t, draw)


def normal_(t: torch.Tensor, std: float = 1.0) -> None:
    """N(0, std), drawn as on the CPU whatever the device (see `draw_like_cpu`)."""
    with torch.no_grad():
        draw_like_cpu(t, lambda x: x.normal_(0.0, std))


def draw_like_cpu(t: torch.Tensor, draw: Callable[[torch.Tensor], None]) -> None:
    """Fill `t` in place with `draw`, from the CPU generator when `t` lives on an accelerator.

    Why: CUDA's generator gives other numbers than the CPU's for the same seed, so a GPU
    job would start from other weights than the CPU run it is checked against. Drawing the
    full tensor on the CPU (and keeping this rank's shard of a DTensor) makes the init the
    same on every device and mesh, at the price of drawing every weight on every rank's CPU.
    """
    if t.device.type in ("cpu", "meta"):
        draw(t)
        return
    full = torch.empty(t.shape, dtype=t.dtype)
    draw(full)
    if isinstance(t, DTensor):  # onto the shard's own device (cuda:i) first: distribute_tensor then keeps it there
        full = full.to(t.to_local().device)
        local = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()
        t.to_local().copy_(local)
    else:
        t.copy_(full)


def depth_init_std(layer_id: int) -> float:
    """Output projections of deeper layers start smaller (TorchTitan ``depth_init``)."""
    return INIT_STD / math.sqrt(2 * (layer_id + 1))


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale; uses ``F.rms_norm`` (decomposes cleanly when traced)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


# --------------------------------------------------------------------------------------
# Rotary position embedding (rotate-half form, real cos/sin tables — no complex tensors,
# so DTensor sharding rules and FakeTensor tracing handle it like any other tensor op).
# --------------------------------------------------------------------------------------


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: tuple[float, float, float, int]) -> torch.Tensor:
    """LLaMA 3.1's RoPE scaling (HF ``rope_type = "llama3"``): wavelengths longer than the
    original context / ``low`` are divided by ``factor``, shorter than context / ``high``
    kept, those between interpolated smoothly. ``scaling = (factor, low, high, original_len)``."""
    factor, low, high, old_len = scaling
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class YaRN:
    """YaRN RoPE scaling (HF ``rope_type = "yarn"``, DeepSeek-V3's long context): frequencies
    rotating fewer than ``beta_slow`` times over the original context are divided by
    ``factor``, those rotating more than ``beta_fast`` times kept, a linear ramp between (over
    whole dimension indices, as HF's default ``truncate``). The tables are multiplied by
    `table_scale` (HF's ``attention_factor``) and MLA's softmax scale by `softmax_scale` (from
    ``mscale_all_dim``): 1 and (0.1 ln 40 + 1)^2 = 1.87 for DeepSeek-V3 (factor 40, mscales 1)."""

    factor: float
    original_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def inv_freq(self, inv_freq: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
        """The scaled inverse frequencies of ``inv_freq [head_dim / 2]``."""
        def dim_of(rotations: float) -> float:  # the dimension index that rotates this often in the context
            return head_dim * math.log(self.original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dim_of(self.beta_fast)), 0)
        high = min(math.ceil(dim_of(self.beta_slow)), head_dim - 1)
        high = high + 0.001 if high == low else high
        idx = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)
        ramp = ((idx - low) / (high - low)).clamp(0, 1)  # 0: kept (fast), 1: interpolated (slow)
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)

    @staticmethod
    def _m(factor: float, mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    def table_scale(self) -> float:
        """The factor on cos/sin (scales the rotary dims' part of q.k by its square)."""
        if self.mscale and self.mscale_all_dim:
            return self._m(self.factor, self.mscale) / self._m(self.factor, self.mscale_all_dim)
        return self._m(self.factor)

    def softmax_scale(self) -> float:
        """The factor on the attention's softmax scale (MLA: every q/k dim)."""
        return self._m(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


RopeScaling = Union[tuple[float, float, float, int], YaRN]
"""LLaMA 3.1's (factor, low, high, original length), or `YaRN`."""


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``cos, sin`` of shape ``[max_seq_len, head_dim]`` for rotate-half RoPE
    (``scaling``: LLaMA 3.1's, see `llama3_scaled_inv_freq`, or `YaRN`)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    scale = 1.0
    if isinstance(scaling, YaRN):
        inv_freq, scale = scaling.inv_freq(inv_freq, head_dim, theta), scaling.table_scale()
    elif scaling is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, scaling)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [S, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, head_dim]
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim: RoPE's rotation in the half-split layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, H, D]`` by position tables ``cos/sin [S, D]``."""
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Holds the non-persistent ``cos``/``sin`` buffers ``[max_seq_len, head_dim]``.

    One instance per model (FQN ``rope``); ``forward`` returns the rows for the requested
    positions (``None`` = ``0..seq_len-1``). Non-persistent: checkpoints do not contain
    them and ``init_weights`` recomputes them after ``to_empty``.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.scaling = head_dim, max_seq_len, theta, scaling
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        device = buffer_device if buffer_device is not None else self.cos.device
        cos, sin = rope_tables(self.head_dim, self.max_seq_len, self.theta, device, self.scaling)
        self.cos = cos
        self.sin = sin

    def forward(
        self, seq_len: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            return self.cos[:seq_len], self.sin[:seq_len]
        return self.cos[positions], self.sin[positions]


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------


class SDPA(nn.Module):
    """Causal scaled-dot-product attention on ``[B, H, S, head_dim]`` tensors.

    This is the seam a context-parallel recipe replaces (e.g. with ring attention): it
    owns no parameters, takes ``q, k, v`` after RoPE and GQA repetition, and returns
    ``[B, H, S, v_head_dim]``. The softmax scale is the SDPA default, ``1/sqrt(q.size(-1))``.
    In this project q, k and v always share one head dim (MLA zero-pads v, see
    ``models/deepseek_v3.py``), so CPU runs the fused flash kernel.

    ``local_map_region`` names the local_map region this module is for the auto planner
    (``parallel/auto/regions/cp_attention.py`` declares its placements: batch, heads, or the
    sequence with K/V gathered, i.e. context parallelism); outside the planner it is a
    plain attribute.
    """

    local_map_region = "causal_attention"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """GQA: repeat each kv head ``n_rep`` times along dim 2 of ``[B, S, H_kv, D]``."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE, optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        assert n_heads % n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps)
            self.k_norm = RMSNorm(head_dim, norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        self.sdpa = SDPA()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 instead of n_heads: a TP-sharded wq yields only the local heads.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:  # Qwen3: normalise each head before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k = repeat_kv(k, self.n_rep)
        v = repeat_kv(v, self.n_rep)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2).reshape(bs, seqlen, -1)
        return self.wo(out)

    def init_weights(self, out_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, INIT_STD)
        trunc_normal_(self.wo.weight, out_std)
        if self.q_norm is not None:
            self.q_norm.init_weights()
            self.k_norm.init_weights()


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        trunc_normal_(self.w1.weight, INIT_STD)
        trunc_normal_(self.w2.weight, out_std)
        trunc_normal_(self.w3.weight, out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(
        self,
        layer_id: int,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        ffn_hidden_dim: int,
        norm_eps: float = 1e-6,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = Attention(dim, n_heads, n_kv_heads, head_dim, qk_norm, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.feed_forward = FeedForward(dim, ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        std = depth_init_std(self.layer_id)
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std)
        self.feed_forward.init_weights(std)


class DecoderBase(nn.Module):
    """Shared skeleton: ``tok_embeddings -> layers -> norm -> output`` plus ``rope``.

    Subclasses register, in this order, ``tok_embeddings, rope, layers, norm, output``
    and set ``self.args``; this class supplies the
    forward pass and deterministic ``init_weights`` (embeddings N(0,1), output
    trunc-normal with std ``dim**-0.5``, TorchTitan defaults).
    """

    args: object
    repeated_blocks = "layers"
    """The list of blocks whose forward depends only on its inputs and own parameters (not on
    its index or on how many there are): the planner traces two and copies the rest."""
    tok_embeddings: nn.Embedding | None
    rope: RotaryEmbedding
    layers: nn.ModuleList | nn.ModuleDict
    norm: RMSNorm | None
    output: nn.Linear | None

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``tokens [B, S]`` (``positions [S]`` optional, e.g. a CP shard) -> logits ``[B, S, V]``."""
        cos, sin = self.rope(tokens.shape[1], positions)
        # a pipeline stage (parallel/recipes/pp.py) holds some blocks, as a ModuleDict keyed by their
        # index, and None for the embedding / norm and output it does not hold: its input is then the
        # previous stage's hidden state, its output the hidden state
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.blocks():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks in order (``layers``: a ModuleList, or a pipeline stage's ModuleDict)."""
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Deterministic init (given ``torch.manual_seed``); also recomputes RoPE buffers.

        Works after ``model.to_empty(device=...)``. The RNG is consumed in a fixed order
        (embeddings, layers in order, norm, output), so meta-built and CPU-built models
        with the same seed end up identical.
        """
        self.rope.init_weights(buffer_device)
        if self.tok_embeddings is not None:
            normal_(self.tok_embeddings.weight)
        for layer in self.blocks():
            layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None:
            trunc_normal_(self.output.weight, self.output.weight.shape[1]**-0.5)
