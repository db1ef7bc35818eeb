"""Context parallel (CP): causal attention over a sequence sharded on the ``cp`` mesh axis.

Works on CPU + gloo (torch's own ``context_parallel`` helpers assume CUDA kernels).

Layout ("load balanced", the default): the global sequence of length S is cut into
``2*cp`` equal chunks; cp rank ``r`` holds chunks ``r`` and ``2*cp-1-r`` (concatenated, in
that order). Under a causal mask chunk ``j`` attends to ``(j+1)`` chunks of keys, so every
rank attends to ``2*cp+1`` chunks in total: equal work. Without load balancing rank ``r``
holds the contiguous chunk ``r``.

Algorithm (all-gather KV): K and V are all-gathered along the sequence over the cp axis
(a differentiable DTensor redistribution: all-gather forward, reduce-scatter backward),
put back into global order, and each local query chunk attends to the keys up to its own
end with the mask ``key_pos <= query_pos``. Memory per rank is the full K/V of one
layer; the work per rank is exactly balanced.

Public pieces (reusable; the ``local_map`` contract will wrap :func:`context_parallel_attention`):

* :func:`cp_chunk_ids` / :func:`cp_positions` -- the layout.
* :func:`shard_sequence` / :func:`cp_shard_batch` -- shard a batch for CP (the trainer calls it).
* :func:`context_parallel_attention` -- ``(q, k, v, mesh, axis) -> out`` on sequence shards.
* :class:`ContextParallelSDPA` + :func:`apply_cp` -- the recipe: replace every
  ``layers.i.attention.sdpa`` module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from parallel.mesh import CP, submesh

from .errors import RecipeError

__all__ = [
    "cp_chunk_ids",
    "cp_positions",
    "shard_sequence",
    "cp_shard_batch",
    "context_parallel_attention",
    "ContextParallelSDPA",
    "apply_cp",
    "validate_cp",
]


# ----------------------------------------------------------------------------- layout
def cp_chunk_ids(cp_rank: int, cp_size: int, load_balance: bool = True) -> list[int]:
    """Global chunk ids held by ``cp_rank`` (chunks are ``S / n_chunks`` tokens long)."""
    if load_balance:
        return [cp_rank, 2 * cp_size - 1 - cp_rank]
    return [cp_rank]


def _n_chunks(cp_size: int, load_balance: bool) -> int:
    return 2 * cp_size if load_balance else cp_size


def validate_cp(seq_len: int, cp_size: int, load_balance: bool = True) -> None:
    """Raise :class:`RecipeError` if ``seq_len`` cannot be sharded over ``cp_size`` ranks."""
    n = _n_chunks(cp_size, load_balance)
    if cp_size < 1 or seq_len % n != 0:
        chunks = f"2 x the degree: {n} load-balanced chunks" if load_balance else "the degree"
        raise RecipeError("context_parallel_degree", cp_size,
                          f"does not divide the sequence: seq_len = {seq_len} must be a multiple of {n} "
                          f"({chunks}); change [training] seq_len or the degree")


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool = True,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (LongTensor ``[seq_len // cp_size]``) of the tokens held by ``cp_rank``."""
    validate_cp(seq_len, cp_size, load_balance)
    c = seq_len // _n_chunks(cp_size, load_balance)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in cp_chunk_ids(cp_rank, cp_size, load_balance)])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1,
                   load_balance: bool = True) -> torch.Tensor:
    """Take the local sequence shard of a global tensor along ``dim``."""
    validate_cp(x.shape[dim], cp_size, load_balance)
    chunks = x.chunk(_n_chunks(cp_size, load_balance), dim=dim)
    return torch.cat([chunks[i] for i in cp_chunk_ids(cp_rank, cp_size, load_balance)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """Inverse of :func:`shard_sequence` given every rank's shard (rank order); for tests/debug."""
    cp = len(shards)
    n = _n_chunks(cp, load_balance)
    pieces: list[torch.Tensor | None] = [None] * n
    for r, s in enumerate(shards):
        ids = cp_chunk_ids(r, cp, load_balance)
        for i, p in zip(ids, s.chunk(len(ids), dim=dim)):
            pieces[i] = p
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


def cp_shard_batch(tokens: torch.Tensor, labels: torch.Tensor, mesh: DeviceMesh,
                   axis: str = CP, load_balance: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shard a ``[B, S]`` batch for CP: returns ``(tokens_local, labels_local, positions_local)``.

    ``positions_local`` is what the model's ``forward(tokens, positions)`` needs so that RoPE
    follows the sharded sequence. Each rank then computes the mean loss over its local
    tokens; since every rank holds the same number of tokens, averaging the gradients over
    the cp axis (FSDP over ``dp_shard x cp``) reproduces the global mean.
    """
    cp_mesh = submesh(mesh, axis)
    r, n = cp_mesh.get_local_rank(), cp_mesh.size()
    S = tokens.shape[1]
    return (shard_sequence(tokens, r, n, 1, load_balance),
            shard_sequence(labels, r, n, 1, load_balance),
            cp_positions(S, r, n, load_balance, device=tokens.device))


# ----------------------------------------------------------------------------- attention
def _all_gather_seq(x: torch.Tensor, cp_mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Differentiable all-gather of ``x`` along ``dim`` over the 1-D ``cp_mesh``.

    Forward: all-gather. Backward: reduce-scatter (each rank's grad for the full tensor is a
    partial contribution), expressed with public DTensor API so it is traceable, works on
    fake process groups and is counted by ``CommDebugMode``.
    """
    d = DTensor.from_local(x.contiguous(), cp_mesh, [Shard(dim)], run_check=False)
    return d.redistribute(cp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _causal_chunk_attention(q_chunks, k, v, ends: list[int], scale):
    """Attention of each query chunk (ending at global position ``end``) to keys ``[0, end)``."""
    outs = []
    for qc, end in zip(q_chunks, ends):
        kp = torch.arange(end, device=qc.device)
        qpos = torch.arange(end - qc.shape[-2], end, device=qc.device)
        mask = kp[None, :] <= qpos[:, None]
        outs.append(F.scaled_dot_product_attention(
            qc, k[..., :end, :], v[..., :end, :], attn_mask=mask, scale=scale))
    return outs


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               mesh: DeviceMesh, axis: str | None = CP, *,
                               load_balance: bool = True, scale: float | None = None) -> torch.Tensor:
    """Causal attention on sequence shards: ``q, k, v, out`` are ``[B, H, S_local, D]``.

    The shards follow :func:`cp_chunk_ids` (rank ``r`` of the ``axis`` sub-mesh of ``mesh``
    holds chunks ``r`` and ``2cp-1-r`` when ``load_balance``). ``k``/``v`` must already have
    as many heads as ``q`` (GQA repeat before the call). Differentiable w.r.t. q, k, v.
    Equals ``F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True)``
    restricted to the local rows.
    """
    cp_mesh = submesh(mesh, axis)
    r, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    ids = cp_chunk_ids(r, cp, load_balance)
    s_loc = q.shape[-2]
    if s_loc % len(ids) != 0 or k.shape[-2] != s_loc or v.shape[-2] != s_loc:
        raise ValueError(f"CP attention: local sequence lengths q={q.shape[-2]} k={k.shape[-2]} "
                         f"v={v.shape[-2]} must be equal and divisible by {len(ids)}")
    c = s_loc // len(ids)
    n = _n_chunks(cp, load_balance)
    # gather K/V: [B, H, cp * s_loc, D] in rank order, then reorder chunks to global order
    kg = _all_gather_seq(k, cp_mesh, k.dim() - 2)
    vg = _all_gather_seq(v, cp_mesh, v.dim() - 2)
    owner = {}
    for rr in range(cp):
        for j, cid in enumerate(cp_chunk_ids(rr, cp, load_balance)):
            owner[cid] = rr * len(ids) + j  # position of chunk cid in the gathered tensor
    if load_balance:
        order = torch.tensor([owner[i] for i in range(n)], device=q.device)
        idx = (order[:, None] * c + torch.arange(c, device=q.device)[None, :]).reshape(-1)
        kg = kg.index_select(-2, idx)
        vg = vg.index_select(-2, idx)
    q_chunks = q.split(c, dim=-2)
    ends = [(cid + 1) * c for cid in ids]
    outs = _causal_chunk_attention(q_chunks, kg, vg, ends, scale)
    return torch.cat(outs, dim=-2)


class ContextParallelSDPA(nn.Module):
    """Drop-in for a model's ``attention.sdpa`` module: ``forward(q, k, v)`` on sequence shards."""

    def __init__(self, cp_mesh: DeviceMesh, load_balance: bool = True, scale: float | None = None):
        super().__init__()
        self.cp_mesh = cp_mesh  # 1-D, sliced outside any fake mode
        self.load_balance = load_balance
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.cp_mesh, None,
                                          load_balance=self.load_balance, scale=self.scale)

    def extra_repr(self) -> str:
        return f"cp={self.cp_mesh.size()}, load_balance={self.load_balance}"


def apply_cp(model: nn.Module, mesh: DeviceMesh, axis: str = CP, load_balance: bool = True) -> nn.Module:
    """CP recipe: replace every ``*.attention.sdpa`` submodule by :class:`ContextParallelSDPA`.

    Inputs/labels must be sharded with :func:`cp_shard_batch` and ``positions`` passed to the
    model; parameters stay replicated over ``cp`` (shard/average their grads with FSDP over
    the flattened ``dp_shard x cp`` mesh, or all-reduce them).
    """
    cp_mesh = submesh(mesh, axis)
    if cp_mesh.size() == 1:
        return model
    n = 0
    for name, mod in list(model.named_modules()):
        if name.endswith("attention") and hasattr(mod, "sdpa"):
            scale = getattr(mod.sdpa, "scale", None)
            mod.sdpa = ContextParallelSDPA(cp_mesh, load_balance, scale=scale)
            n += 1
    if n == 0:
        raise ValueError("apply_cp: no '*.attention.sdpa' module found to replace")
    return model
