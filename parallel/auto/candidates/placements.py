"""Placement vocabulary shared by every stage: keys, strings, shapes, menus.

A tensor's placement on a D-dim mesh is a D-tuple of Replicate / Shard(d) / Partial; a
strategy of an op is its output placement(s) plus one input placement per tensor input.
The helpers here are the ONE definition of each: the strategy key, the plan's placement
strings (and parsing them back), the local (per-device) shape, even divisibility, the
enumeration of all placements of a tensor, and a node's menu.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from parallel import _torch as T

Placements = tuple  # tuple[Placement, ...], one entry per mesh axis

def shard_dim(p: Placement) -> int | None:
    """Tensor dim a placement shards (Shard, _StridedShard, any shard-like), else None."""
    return classify(p)[0]


_CLASSES: dict[Placement, tuple[int | None, bool, bool]] = {}


def classify(p: Placement) -> tuple[int | None, bool, bool]:
    """(shard dim or None, is partial, is replicate), memoised per placement: a failing
    ``isinstance`` on torch 2.13's C++-backed placement types costs ~1.5 µs, and planning
    asks tens of millions of times."""
    hit = _CLASSES.get(p)
    if hit is None:
        if isinstance(p, Shard):
            dim = p.dim
        elif p.is_shard() or isinstance(p, T.StridedShard):
            dim = getattr(p, "dim", None)
        else:
            dim = None
        hit = _CLASSES[p] = (dim, isinstance(p, Partial) or p.is_partial(),
                             isinstance(p, Replicate) or p.is_replicate())
    return hit


def normalize(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """Make negative shard dims positive so Shard(-1) == Shard(ndim-1)."""
    out = []
    for p in placements:
        d = shard_dim(p)
        if d is not None and d < 0:
            if isinstance(p, Shard) and type(p) is Shard:
                p = Shard(d + ndim)
            else:  # _StridedShard and friends
                try:
                    p = type(p)(d + ndim, split_factor=p.split_factor)  # type: ignore[attr-defined]
                except Exception:  # pragma: no cover
                    pass
        out.append(p)
    return tuple(out)


def bucket_shard_dim(src: tuple, dst: tuple) -> int | None:
    """The one tensor dim the Shard placements of src and dst split (0 if none), else None
    (a flat-buffer collective moves that dim to the front)."""
    dims = {p.dim for p in src + dst if isinstance(p, Shard)}
    if any(isinstance(p, Shard) and type(p) is not Shard for p in src + dst):
        return None  # _StridedShard
    if len(dims) > 1:
        return None
    return dims.pop() if dims else 0


def _as_dim0(placements: tuple) -> tuple:
    return tuple(Shard(0) if isinstance(p, Shard) else p for p in placements)


def join_buckets(blocks: Iterable[tuple[Hashable, list, int]], cap_bytes: int) -> list[tuple[Hashable, list]]:
    """DDP's bucket rule (`bucket_cap_mb`) for the gradient reductions of consecutive blocks:
    `blocks` as (group, members in forward order, bytes) in the order the backward produces
    them (last block first); each joins the open bucket of its group (collectives of one
    kind and dtype) until that bucket holds `cap_bytes`. Returns (group, members in forward
    order) per bucket. The runtime reduces by it (runtime/runner.py) and the planner prices
    by it (problem/formulation.py), so both count the same collectives. `cap_bytes` 0: one
    bucket per block."""
    merged: list[tuple[Hashable, list]] = []
    open_bucket: dict[Hashable, tuple[list, int]] = {}  # group -> (members, bytes)
    for group, members, nbytes in blocks:
        held, size = open_bucket.pop(group, ([], 0))
        held, size = members + held, size + nbytes
        if size >= cap_bytes:
            merged.append((group, held))
        else:
            open_bucket[group] = (held, size)
    merged.extend((g, held) for g, (held, _) in open_bucket.items())
    return merged


def bucket_key(src: tuple, dst: tuple) -> tuple | None:
    """Normalised (src, dst) when a flat-buffer collective can do src -> dst, else None.

    Per mesh axis: (S(d) -> R) gathers, or (P(sum) -> S(d) | R) reductions, or unchanged
    R / S(d); one tensor dim d per tensor (moved to the front in the buffer); gathers and
    reductions are not mixed; at least one axis changes.
    """
    d = bucket_shard_dim(src, dst)
    if d is None:
        return None
    a_, b_ = _as_dim0(src), _as_dim0(dst)
    changed = gather = reduce = False
    for a, b in zip(a_, b_):
        if a == b and isinstance(a, (Replicate, Shard)) and not isinstance(a, Partial):
            continue
        if isinstance(a, Shard) and isinstance(b, Replicate):
            gather = changed = True
        elif type(a) is Partial and a.reduce_op == "sum" and isinstance(b, (Replicate, Shard)):
            reduce = changed = True
        else:
            return None
    if not changed or (gather and reduce):
        return None
    return (a_, b_)


def split_axis(src: tuple, dst: tuple) -> int | None:
    """The mesh axis whose collective splits or joins a tensor (a gather S -> R, a reduction
    P -> S) when it is the only axis that shards it on either side, else None."""
    axes = {ax for ax, p in enumerate(src + dst) if isinstance(p, Shard)}
    axes = {ax % len(src) for ax in axes}
    if len(axes) != 1:
        return None
    ax = axes.pop()
    return ax if isinstance(src[ax], Shard) != isinstance(dst[ax], Shard) else None


def flat_bucket_key(shape: Sequence[int], src: tuple, dst: tuple, mesh_shape: Sequence[int]) -> tuple | None:
    """`bucket_key` for a tensor of global `shape`. An uneven split joins a flat buffer only
    where one mesh axis splits it (`split_axis`: its shards are padded to equal chunks);
    any other uneven one is left to DTensor's own collective (None)."""
    key = bucket_key(src, dst)
    if key is None or (evenly_divisible(shape, src, mesh_shape) and evenly_divisible(shape, dst, mesh_shape)):
        return key
    ok = split_axis(src, dst) is not None and fills_every_rank(shape, src, mesh_shape) and fills_every_rank(
        shape, dst, mesh_shape)
    return key if ok else None


def rank_local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int],
                     coordinate: Sequence[int]) -> tuple[int, ...]:
    """The local shape of the rank at `coordinate` on the mesh: DTensor's torch.chunk split,
    nested in mesh-axis order (ceil rows on the first ranks, fewer or none on the last)."""
    local = list(shape)
    for size, p, at in zip(mesh_shape, placements, coordinate):
        if isinstance(p, Shard) and not isinstance(p, T.StridedShard):
            rows = -(-local[p.dim] // size)
            local[p.dim] = max(0, min(rows, local[p.dim] - at * rows))
    return tuple(local)


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
                skip_axis: int | None = None) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape`` placed by ``placements`` (ceil:
    uneven shards are priced as the largest one, which collectives pad to), ignoring the
    sharding on ``skip_axis`` (= the tensor gathered on that axis)."""
    local = list(shape)
    for d, size in _divisors(placements, len(local), mesh_shape, skip_axis):
        local[d] = -(-local[d] // size)
    return tuple(local)


def _divisors(placements: Sequence[Placement], ndim: int, mesh_shape: Sequence[int],
              skip_axis: int | None) -> tuple[tuple[int, int], ...]:
    """(tensor dim, mesh-axis size) for each sharded axis, in axis order, as local_shape applies them."""
    out = []
    for i, p in enumerate(placements):
        if i == skip_axis:
            continue
        d = shard_dim(p)
        if d is not None:
            d = d + ndim if d < 0 else d
            if 0 <= d < ndim:
                out.append((d, mesh_shape[i]))
    return tuple(out)


def shard_factor(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """Number of pieces a tensor is cut into (product of the sizes of its sharded axes)."""
    f = 1
    for size, p in zip(mesh_shape, placements):
        if shard_dim(p) is not None:
            f *= size
    return f


def evenly_divisible(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    """True if every Shard in `placements` splits its dim evenly (in mesh-axis order);
    strided shards are never even here (the planner leaves them out)."""
    local = list(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, T.StridedShard):
            return False
        if isinstance(p, Shard):
            if p.dim >= len(local) or local[p.dim] % size != 0:
                return False
            local[p.dim] //= size
    return True


def fills_every_rank(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    """True if every Shard in `placements` leaves each rank a non-empty shard, evenly or not
    (DTensor's torch.chunk split, nested in mesh-axis order: the first ranks hold ceil rows,
    the last what is left); strided shards never."""
    shards = [p for p in placements if isinstance(p, Shard)]
    if any(isinstance(p, T.StridedShard) or p.dim >= len(shape) for p in shards):
        return False
    # the smallest shard is the last rank's on every axis
    last = rank_local_shape(shape, placements, mesh_shape, [size - 1 for size in mesh_shape])
    return all(last[p.dim] > 0 for p in shards)


def tensor_placements(shape: Sequence[int], mesh_shape: Sequence[int], *, partial: bool = False,
                      uneven: bool = False) -> list[Placements]:
    """Every placement tuple (Replicate / Shard(d) [/ Partial]) whose shards divide evenly;
    `uneven`: also those whose shards differ by rank but leave none empty (FSDP2's split of a
    weight whose rows a mesh axis does not divide)."""
    per_axis: list[Placement] = [Replicate()] + [Shard(d) for d in range(len(shape))]
    if partial:
        per_axis.append(Partial())
    fits = fills_every_rank if uneven else evenly_divisible
    return [tuple(c) for c in itertools.product(per_axis, repeat=len(mesh_shape))
            if fits(tuple(shape), c, mesh_shape)]


def output_placements(outs: Any) -> Any:
    """The placements of an OpSpec's output spec(s): a tuple per output (None where an
    output is not a tensor) for multi-output ops, else one tuple."""
    if isinstance(outs, tuple):
        return tuple(x.placements if x is not None else None for x in outs)
    return outs.placements


def strategy_key(spec: Any) -> tuple:
    """(output placements, input placements per tensor input) of an OpSpec: what identifies
    a strategy across menus, meshes and saved plans."""
    return (output_placements(spec.output_specs), tuple(i.placements for i in (spec.input_specs or [])))


def menu_of(c: Any) -> tuple:
    """A node's candidates as strategy keys, in menu order."""
    return tuple(strategy_key(s) for s in c.specs)


# ------------------------------------------------------------------ words
def _word(p: Placement) -> str:
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard) and not isinstance(p, T.StridedShard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        op = getattr(p, "reduce_op", "sum")
        name = "MP" if isinstance(p, T.MaskPartial) else "P"
        return name if op == "sum" else f"{name}({op})"
    return repr(p)


def placement_str(placements: Placements) -> str:
    """'(S(0), R)': how plans, logs and errors write a placement tuple."""
    return "(" + ", ".join(_word(p) for p in placements) + ")"


def spec_placement_strs(spec: Any) -> tuple[list[str], list[str]]:
    """(output placements, input placements) of an OpSpec as the plan writes them ("-" for
    an output that is not a tensor): what a saved plan is matched against."""
    outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    return ([placement_str(o.placements) if o is not None else "-" for o in outs],
            [placement_str(i.placements) for i in (spec.input_specs or [])])


_PLACEMENT_RE = re.compile(r"MP(?:\(\w+\))?|P(?:\(\w+\))?|S\(\d+\)|R")


def placement_words(p: str) -> list[str]:
    """'(S(0), R)' -> ['S(0)', 'R']"""
    return _PLACEMENT_RE.findall(p)


def parse_placements(p: str) -> tuple:
    """Placement objects from their plan string (MaskPartial reads back as Partial)."""
    out: list[Placement] = []
    for x in placement_words(p):
        if x == "R":
            out.append(Replicate())
        elif x.startswith("S("):
            out.append(Shard(int(x[2:-1])))
        else:
            op = x[x.index("(") + 1:-1] if "(" in x else "sum"
            out.append(Partial(op))
    return tuple(out)
