"""Causal attention as a local_map region: context parallelism in auto mode.

The models' `SDPA` module (LLaMA 3, Qwen3, DeepSeek-V3's MLA: q, k, v of [B, H, S, D] after
RoPE and the GQA repeat) is marked `local_map_region = "causal_attention"`. Its options per
mesh axis: the batch (dim 0), the heads (dim 1), or the sequence (dim 2) of q, k, v and the
output, where K and V are all-gathered over that axis inside the region (the backward
gathers them again and reduce-scatters their gradients) -- the all-gather-KV context
parallelism of parallel/recipes/cp.py, on any axis or several.

The sequence may arrive in the load-balanced CP order (`RegionContext.load_balance` = n:
the trainer reorders tokens, labels and RoPE positions so that contiguous shards over n
ranks are cp_chunk_ids' chunks r and 2n-1-r); the local function then knows each local
query's and each gathered key's true position, so every option is exact in any order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from parallel import _torch as T
from parallel.auto.regions.declaration import Option, Region
from parallel.auto.regions.layout import RegionContext
from parallel.auto.regions.ops import declare
from parallel.recipes.cp import cp_positions

NAME = "causal_attention"
SEQUENCE = "sequence"
MASK_ROWS = 256
"""Query rows per masked attention call: the kernel expands a boolean mask to the query's
dtype, rows x keys, so long runs are cut to keep that buffer small (at seq 4096: 4 MiB)."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The region's plain function: causal SDPA (what `models.layers.SDPA` computes)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sequence_order(seq_len: int, load_balance: int) -> list[int]:
    """True position of each index of a sequence laid out in the load-balanced CP order for
    `load_balance` ranks (identity for 1)."""
    if load_balance <= 1:
        return list(range(seq_len))
    return torch.cat([cp_positions(seq_len, r, load_balance) for r in range(load_balance)]).tolist()


def _runs(positions: list[int], max_rows: int | None = None) -> list[tuple[int, int, int]]:
    """(first local row, end local row, first position) of each run of consecutive positions;
    runs not starting at position 0 are cut to at most `max_rows` rows (masked calls)."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            step = (i - start) if (max_rows is None or positions[start] == 0) else max_rows
            for a in range(start, i, step):
                out.append((a, min(a + step, i), positions[a]))
            start = i
    return out


def local_causal_attention(ctx: RegionContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of this rank's queries: K/V gathered over the sequence axes (mesh
    order: axis a splits before axis b, so b is gathered first), put into true position
    order, and each run of consecutive query positions attends to the keys up to its end."""
    seq = ctx.axes_with(SEQUENCE)
    n = math.prod(a.size for a in seq)
    rank = 0
    for a in seq:
        rank = rank * a.size + a.rank
    for a in reversed(seq):
        k = T.all_gather_single_autograd(k.contiguous(), 2, a.group)
        v = T.all_gather_single_autograd(v.contiguous(), 2, a.group)
    s_loc = q.shape[2]
    order = sequence_order(s_loc * n, ctx.load_balance)
    if ctx.load_balance > 1:
        inverse = torch.empty(len(order), dtype=torch.long, device=q.device)
        inverse[torch.tensor(order, device=q.device)] = torch.arange(len(order), device=q.device)
        k, v = k.index_select(2, inverse), v.index_select(2, inverse)
    outs = []
    for i0, i1, p0 in _runs(order[rank * s_loc:(rank + 1) * s_loc], MASK_ROWS):
        end = p0 + (i1 - i0)
        qc = q[:, :, i0:i1]
        if p0 == 0:
            outs.append(F.scaled_dot_product_attention(qc, k[:, :, :end], v[:, :, :end], is_causal=True))
            continue
        kpos = torch.arange(end, device=q.device)
        qpos = torch.arange(p0, end, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        outs.append(F.scaled_dot_product_attention(qc, k[:, :, :end], v[:, :, :end], attn_mask=mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _options() -> list[Option]:
    return [Option("batch", (Shard(0),) * 3, (Shard(0),)),
            Option("heads", (Shard(1),) * 3, (Shard(1),)),
            Option(SEQUENCE, (Shard(2),) * 3, (Shard(2),), gather=(1, 2))]


REGION = declare(Region(NAME, _options(), fn=causal_attention, local_fn=local_causal_attention))


def load_balanced_batch(tokens: torch.Tensor, labels: torch.Tensor,
                        load_balance: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [B, S] batch in the load-balanced CP order for `load_balance` ranks, and the RoPE
    positions [S] that follow it (the model's `forward(tokens, positions)`). The mean loss
    over all tokens does not depend on their order."""
    order = torch.tensor(sequence_order(tokens.shape[1], load_balance), device=tokens.device)
    return tokens.index_select(1, order), labels.index_select(1, order), order
