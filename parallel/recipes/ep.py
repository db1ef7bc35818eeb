"""Expert parallel (EP) for MoE layers: experts sharded over the ``ep`` mesh axis, tokens
sent to their experts and back with all-to-all (works on gloo).

Reusable core (the ``local_map`` contract for MoE dispatch will wrap it):

:func:`expert_parallel_dispatch` ``(x_sorted, num_tokens_per_expert, expert_fn, mesh, axis) -> y_sorted``

* ``x_sorted [N, dim]``: this rank's routed token copies, sorted by *global* expert id;
* ``num_tokens_per_expert [E]``: how many rows of ``x_sorted`` go to each global expert;
* ``expert_fn(x, counts_local) -> y``: runs this rank's ``E / ep`` local experts on rows
  sorted by local expert id (``counts_local [E/ep]``);
* returns ``y_sorted [N, dim_out]`` in the same row order as ``x_sorted``.

Steps: (1) all-to-all the per-expert counts, (2) all-to-all the token rows with split sizes
(rows for experts ``[r*E/ep, (r+1)*E/ep)`` go to ep rank ``r``), (3) regroup the received
rows (source-rank major) into local-expert-major order, (4) run the local experts,
(5) undo (3) and (2). Router, top-k weighting and shared experts stay outside: they run
on every rank's own tokens, so the dispatch is a drop-in for a grouped-experts call.
Global expert ``g`` lives on ep rank ``g // (E/ep)`` as local expert ``g % (E/ep)``,
i.e. the expert weights ``[E, ...]`` are ``Shard(0)`` over the ep axis.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["all_to_all_single_autograd", "expert_parallel_dispatch", "validate_ep"]


class _AllToAllSingle(torch.autograd.Function):
    """Differentiable ``dist.all_to_all_single`` on dim 0 with split sizes (public c10d API)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        gin = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(gin, grad, output_split_sizes=ctx.in_splits,
                               input_split_sizes=ctx.out_splits, group=ctx.group)
        return gin, None, None, None


def all_to_all_single_autograd(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                               group) -> torch.Tensor:
    """All-to-all rows of ``x``: send ``in_splits[r]`` rows to rank ``r``, receive ``out_splits[r]``."""
    return _AllToAllSingle.apply(x, list(out_splits), list(in_splits), group)


def validate_ep(num_experts: int, ep_size: int) -> None:
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(f"expert_parallel_degree={ep_size} does not divide the number of "
                         f"experts ({num_experts})")


def _ep_group(mesh: DeviceMesh, axis: Optional[str]):
    sub = mesh if axis is None or mesh.mesh_dim_names is None or (
        mesh.ndim == 1 and mesh.mesh_dim_names[0] == axis) else mesh[axis]
    return sub, sub.get_group(), sub.size()


def _regroup_index(counts: torch.Tensor) -> torch.Tensor:
    """``counts [ep, E_loc]`` of received rows (source-rank major); return the permutation
    that sorts the rows local-expert major (``rows[idx]`` is expert-major)."""
    ep, e_loc = counts.shape
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(ep, e_loc)
    seg_starts = starts.t().reshape(-1)  # expert-major order of segments
    seg_lens = counts.t().reshape(-1)
    total = int(seg_lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=counts.device)
    seg_offsets = seg_lens.cumsum(0) - seg_lens
    seg_id = torch.repeat_interleave(torch.arange(seg_lens.numel(), device=counts.device), seg_lens)
    within = torch.arange(total, device=counts.device) - seg_offsets[seg_id]
    return seg_starts[seg_id] + within


def expert_parallel_dispatch(x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                             expert_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             mesh: DeviceMesh, axis: Optional[str] = "ep") -> torch.Tensor:
    """Send expert-sorted rows to the ep rank owning each expert, run ``expert_fn`` there,
    and bring the results back in the original row order (differentiable w.r.t. ``x_sorted``
    and whatever ``expert_fn`` uses). See the module docstring for the contract."""
    sub, group, ep = _ep_group(mesh, axis)
    E = num_tokens_per_expert.numel()
    validate_ep(E, ep)
    if ep == 1:
        return expert_fn(x_sorted, num_tokens_per_expert)
    e_loc = E // ep
    counts = num_tokens_per_expert.detach().to(torch.long).contiguous()
    # (1) counts: recv[s, j] = rows source rank s sends to my local expert j
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    recv = recv.view(ep, e_loc)
    send_splits = counts.view(ep, e_loc).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    # (2) tokens out
    x_recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)
    # (3) regroup source-major -> expert-major
    idx = _regroup_index(recv)
    x_local = x_recv.index_select(0, idx)
    # (4) local experts
    y_local = expert_fn(x_local, recv.sum(0))
    # (5) undo the regroup, send back
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    y_recv = y_local.index_select(0, inv)
    return all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)
