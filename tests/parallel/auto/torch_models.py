"""Models nobody here wrote, from torch itself, each with its loss inside forward (the planner
traces forward + loss + backward): torch.nn.Transformer (encoder-decoder, causal target mask
built in forward), torch.nn.TransformerEncoder with a key padding mask, a stack of
torch.nn.MultiheadAttention, and a T5-style relative position bias whose bucket table is a
plain tensor attribute (a lifted constant, `get_attr` in the joint graph); and a model of
factory ops and copies as hand-written forwards use them."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

B, S, D, HEADS, VOCAB = 8, 16, 64, 4, 16


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Seq2Seq(nn.Module):
    """torch.nn.Transformer; the causal target mask is made in forward, as torch's tutorials do
    (nn.Transformer then checks it is causal with a data-dependent read: folded at trace time)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(D, HEADS, 2, 2, 2 * D, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return _loss(self.head(self.transformer(src, tgt, tgt_mask=mask)), labels)


class PaddedEncoder(nn.Module):
    """torch.nn.TransformerEncoder with `src_key_padding_mask` (True = padding)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, padding: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _loss(self.head(self.encoder(x, src_key_padding_mask=padding)), labels)


class AttentionStack(nn.Module):
    """torch.nn.MultiheadAttention blocks (residual) + a Linear head; the first returns its
    averaged attention weights (the explicit softmax path), the second does not (SDPA)."""

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.MultiheadAttention(D, HEADS, batch_first=True) for _ in range(n_layers))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for i, attn in enumerate(self.layers):
            out, _ = attn(x, x, x, need_weights=i % 2 == 0)
            x = x + out
        return _loss(self.head(x), labels)


def relative_buckets(n: int, n_buckets: int) -> torch.Tensor:
    """T5-style bucket of every (query, key) offset: exact for small ones, logarithmic after."""
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    sign = (rel > 0).long() * (n_buckets // 2)
    dist = rel.abs()
    exact = n_buckets // 4
    far = exact + (torch.log(dist.clamp(min=1).float() / exact) / torch.log(torch.tensor(n / exact))
                   * (n_buckets // 2 - exact)).long()
    return sign + torch.where(dist < exact, dist, far.clamp(max=n_buckets // 2 - 1))


class RelativeBias(nn.Module):
    """Self-attention with a T5-style learned relative position bias. The bucket table is a
    plain tensor attribute (not a buffer): the joint graph reads it with get_attr."""

    def __init__(self, n_buckets: int = 8) -> None:
        super().__init__()
        self.buckets = relative_buckets(S, n_buckets)
        self.bias = nn.Embedding(n_buckets, HEADS)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], S, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        bias = self.bias(self.buckets).permute(2, 0, 1)  # [H, S, S]
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return _loss(self.head(x + self.out(h.transpose(1, 2).reshape(x.shape))), labels)


class FactoryOps(nn.Module):
    """What hand-written forwards do: a `torch.tensor` literal (lift_fresh_copy of a lifted
    constant), new_zeros + slice assignment (copy), full/arange/scalar_tensor, empty().fill_(),
    ones_like, an in-place copy_."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([0.5, 1.0, 1.5, 2.0] * (D // 4))
        h = self.proj(x) * scale
        z = x.new_zeros(x.shape)
        z[..., : D // 2] = h[..., : D // 2]
        offset = torch.full((D,), 0.1) + torch.arange(D) / D + torch.scalar_tensor(0.2) + torch.empty(D).fill_(0.3)
        c = h.clone()
        c.copy_(z + torch.ones_like(h) * 0.01)
        return _loss(self.head(torch.tanh(c + offset)), labels)


def inputs(name: str, step: int = 0) -> tuple[torch.Tensor, ...]:
    """The global batch of `step` for model `name` (the same draws on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, S, D, generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    if name == "seq2seq":
        return x, torch.randn(B, S, D, generator=g), labels
    if name == "padded_encoder":
        lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
        return x, torch.arange(S)[None, :] >= lengths[:, None], labels
    return x, labels


MODELS = {"seq2seq": Seq2Seq, "padded_encoder": PaddedEncoder, "attention_stack": AttentionStack,
          "relative_bias": RelativeBias, "factory_ops": FactoryOps}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()
