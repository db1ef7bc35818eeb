"""Redistribution on the runtime path: Partial targets, and bucketed (flat-buffer) collectives.

DTensor's `redistribute` does one tensor at a time and refuses X -> Partial; the plan
runtime needs both (a Replicate value entering an op that expects Partial; one
collective per placement group instead of one per parameter, as FSDP does).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from parallel import _torch as T
from parallel.auto.candidates.placements import bucket_key, bucket_shard_dim, rank_local_shape, split_axis


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def redistribute(x: DTensor, mesh: DeviceMesh, target: tuple) -> DTensor:
    """`x` with placements `target`, including Partial targets.

    DTensor's public `redistribute` refuses X -> Partial; plans use it (e.g. a Replicate
    value entering an op that expects Partial, P(sum) -> P(avg)). Partial targets are
    reached with local math only: P(sum) <-> P(avg) rescale by the axis size, a
    Replicate value is partitioned (`Partial`'s own partition of a value), anything else is first
    made Replicate on that axis (all-reduce / all-gather).
    """
    cur = tuple(x.placements)
    if cur == target:
        return x
    ones = [ax for ax, (c, t) in enumerate(zip(cur, target)) if c != t and mesh.size(ax) == 1]
    if ones:  # on a mesh axis of one rank every placement holds the same local values: relabel
        cur = tuple(target[ax] if ax in ones else c for ax, c in enumerate(cur))
        x = DTensor.from_local(x.to_local(), mesh, cur, run_check=False, shape=x.shape, stride=x.stride())
        if cur == target:
            return x
    if not any(isinstance(p, Partial) for p in target):
        return x.redistribute(mesh, target)
    inter = list(target)
    scale = 1.0
    relabel = list(cur)
    for ax, (c, t) in enumerate(zip(cur, target)):
        if not isinstance(t, Partial):
            continue
        if c == t:
            continue
        if (isinstance(c, Partial) and type(t) is Partial
                and c.reduce_op in ("sum", "avg") and t.reduce_op in ("sum", "avg")):
            n = mesh.size(ax)
            if c.reduce_op == "sum" and t.reduce_op == "avg":
                scale *= n
            elif c.reduce_op == "avg" and t.reduce_op == "sum":
                scale /= n
            relabel[ax] = t  # same partial values, relabelled after scaling
            inter[ax] = t
        else:
            inter[ax] = Replicate()
    if relabel != list(cur):
        local = x.to_local()
        if scale != 1.0:
            local = local * scale
        x = DTensor.from_local(local, mesh, relabel, run_check=False, shape=x.shape, stride=x.stride())
    if tuple(x.placements) != tuple(inter):
        x = x.redistribute(mesh, tuple(inter))
    if tuple(inter) == tuple(target):
        return x
    local = x.to_local()
    for ax, (i, t) in enumerate(zip(inter, target)):
        if isinstance(i, Replicate) and isinstance(t, Partial):
            local = T.partition_value(t, local, mesh, ax)
    return DTensor.from_local(local, mesh, target, run_check=False, shape=x.shape, stride=x.stride())


def _n_chunks(placements: tuple, mesh: DeviceMesh) -> int:
    k = 1
    for ax, p in enumerate(placements):
        if isinstance(p, Shard):
            k *= mesh.size(ax)
    return k


def bucketed_redistribute(items: list[DTensor], targets: list[tuple], mesh: DeviceMesh) -> list[DTensor]:
    """Redistribute tensors sharing one `bucket_key` with ONE collective per mesh axis on a
    flat buffer (FSDP-style bucketing) instead of one per tensor.

    Each tensor's sharded dim is moved to the front; the buffer is laid out chunk-major
    (chunk r of every tensor, then chunk r+1, ...) so that DTensor's own Shard(0) of the
    buffer coincides with every tensor's shards.
    """
    src, dst = bucket_key(tuple(items[0].placements), targets[0])
    k_src, k_dst = _n_chunks(src, mesh), _n_chunks(dst, mesh)
    # the finest split has max(k_src, k_dst) chunks; this rank's source local tensor holds q
    # of them (q > 1 only when reducing onto a finer shard)
    q = k_dst // k_src if k_dst > k_src else 1
    dims = [bucket_shard_dim(tuple(x.placements), t) for x, t in zip(items, targets)]
    uneven = [_uneven_rows(x, t, d, mesh) for x, t, d in zip(items, targets, dims)]
    moved = [_pad_rows(x.to_local().movedim(d, 0) if d else x.to_local(), u, k_src > 1)
             for x, d, u in zip(items, dims, uneven)]
    parts = [m.contiguous().reshape(q, -1) for m in moved]
    widths = [pt.shape[1] for pt in parts]
    buf = torch.cat(parts, dim=1).reshape(-1)  # [q blocks of L], block b = chunk b of every tensor
    L = sum(widths)
    dt = DTensor.from_local(buf, mesh, src, run_check=False, shape=(buf.numel() * k_src,), stride=(1,))
    blocks = redistribute(dt, mesh, dst).to_local().reshape(-1, L)
    res = []
    off = 0
    for x, t, d, m, w, u in zip(items, targets, dims, moved, widths, uneven):
        piece = blocks[:, off:off + w].reshape(-1, *m.shape[1:])
        off += w
        if u is not None:  # drop the padding: past the tensor's rows (gathered), past this shard's (reduced)
            piece = piece[:x.shape[d] if k_dst == 1 else u[2]]
        if d:
            piece = piece.movedim(0, d).contiguous()
        res.append(DTensor.from_local(piece, mesh, t, run_check=False, shape=x.shape,
                                      stride=contiguous_stride(tuple(x.shape))))
    return res


def _uneven_rows(x: DTensor, target: tuple, dim: int, mesh: DeviceMesh) -> tuple[int, int, int] | None:
    """(chunks k, rows per padded chunk c, this rank's rows) where the one mesh axis that
    splits or joins `x` (`split_axis`) does not divide its `dim`; None where it does. DTensor
    splits as torch.chunk does: ceil rows on the first ranks, what is left on the last."""
    ax = split_axis(tuple(x.placements), target)
    rows = x.shape[dim]
    if ax is None or rows % mesh.size(ax) == 0:
        return None
    k = mesh.size(ax)
    mine = rank_local_shape((rows,), (Shard(0),), (k,), (mesh.get_local_rank(ax),))[0]
    return k, -(-rows // k), mine


def _pad_rows(local: torch.Tensor, uneven: tuple[int, int, int] | None, gathering: bool) -> torch.Tensor:
    """`local` (its bucket dim first) padded with zero rows to equal chunks: this rank's shard
    to c rows before a gather, the whole tensor to k x c rows before a reduction. A rank
    whose shard is full pads with no rows: every rank's step graph holds the same ops, so
    the overlap pass orders every rank's collectives alike."""
    if uneven is None:
        return local
    k, c, _ = uneven
    want = c if gathering else k * c
    return torch.cat([local, local.new_zeros(want - local.shape[0], *local.shape[1:])])


def local_shard(full: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> torch.Tensor:
    """This rank's local shard of a global tensor (no communication)."""
    dt = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return dt.redistribute(mesh, placements).to_local()
