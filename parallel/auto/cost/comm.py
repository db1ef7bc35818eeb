"""Communication cost: which collectives a redistribution needs, and what each costs on
the link of *its* mesh axis.

Model (NCCL-style, n = group size on the axis, S = bytes of the tensor gathered on that
axis, i.e. the nccl-tests "size"):

* all-gather / reduce-scatter (ring):  t = α + (n−1)·β + S·(n−1)/n / busBW
* all-reduce, ring:                     t = α + 2(n−1)·β + 2·S·(n−1)/n / busBW_ar
* all-reduce, tree (only across nodes): t = α + 2·⌈log2 n⌉·β + S / (busBW_ar · tree_factor)
  the cheaper of the two is taken (tree wins for small messages on many nodes)
* all-to-all: ``bytes`` is the per-rank buffer L (each rank keeps 1/n of it):
                                        t = α + (n−1)·β + L·(n−1)/n / busBW_a2a
* n = 1 → 0.

α is the link's fixed latency (launch + sync), β its per-step latency.

Mesh axis → link: ranks are laid out row-major over the mesh, so the last axis holds
contiguous ranks. An axis is intra-node when size(axis) · Π size(inner axes) ≤
gpus_per_node; it then uses the intra-node bus bandwidth of its collective kind, scaled
by the profile's ``group_size_factor`` for small groups (NVSwitch rings of 2 GPUs reach
~530 GB/s vs ~390 at 8). Otherwise its groups span nodes and the NIC bounds the ring: bandwidth is
min(intra bus bandwidth, m · NIC bandwidth) where m is the number of the group's members
that share a node (each GPU has its own NIC, rail-optimised), latency is inter-node. So a
pure inter-node axis (m = 1) runs at NIC speed; an axis that only partly spans nodes
(e.g. size 4 with inner product 4 on 8/node, m = 2) is treated as inter-node bound too,
just with m NICs per node.

The redistribution decomposition mirrors DTensor's greedy ``redistribute`` (one mesh axis
at a time; nested/misaligned shards on a tensor dim are first replicated from the
innermost axis outwards), but is pure placement arithmetic: no mesh, no process group.
A DTensorSpec's non-default ``shard_order`` is ignored (placements decide); uneven shards
are priced as the largest shard (collectives pad to it); ``_StridedShard`` counts as a
shard of its dim (so _StridedShard(d) → Shard(d) is an all-to-all).

Relayout: collectives work on dim 0 of a contiguous buffer, so gathering a shard of dim
d > 0 or scattering onto one also moves the whole tensor once more in memory. An all-gather
chunks the gathered buffer and concatenates the chunks on dim d (DTensor's
`_maybe_view_chunk_cat`; our bucketed gathers move dim d back, runtime/redistribute.py),
unless every dim before d has local size 1 (the chunks are then in place: a view). A
reduce-scatter first concatenates the chunks of dim d on dim 0 (functional collectives'
`reduce_scatter_single`; our buckets move dim d to the front). `transition_template`
carries that tensor dim and `relayout_bytes` gives the bytes the copy moves; the cost model
prices it at memory bandwidth, so plans that differ only in which dim a weight is sharded
on no longer tie.
"""
from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from torch.distributed.tensor.placement_types import Placement, Replicate

from parallel.auto.candidates.placements import classify, normalize

from .hardware import COLLECTIVE_KINDS, HardwareProfile

__all__ = [
    "AxisLink",
    "Collective",
    "RedistributionNotAllowed",
    "Step",
    "axis_links",
    "collective_time",
    "decompose_redistribution",
    "placement_ids",
    "relayout_bytes",
    "step_bytes",
    "transition_template",
    "summarize_collectives",
]


class RedistributionNotAllowed(ValueError):
    """src → dst needs a transition DTensor refuses (Replicate/Shard → Partial)."""


@dataclass(frozen=True)
class AxisLink:
    """The link one mesh axis communicates over (derived from the profile + mesh shape)."""

    axis: int
    name: str
    size: int
    intra_node: bool
    members_per_node: int  # ranks of one group of this axis that share a node
    bus_bandwidth_gbps: Mapping[str, float]  # per collective kind
    latency_us: float
    hop_latency_us: float
    allow_tree: bool  # tree all-reduce is an option only across nodes
    tree_bandwidth_factor: float = 0.45

    def describe(self) -> str:
        where = "intra-node" if self.intra_node else f"inter-node ({self.members_per_node}/node)"
        bw = self.bus_bandwidth_gbps
        return (f"axis {self.axis} '{self.name}' size {self.size}: {where}, AG {bw['all_gather']:g} "
                f"AR {bw['all_reduce']:g} A2A {bw['all_to_all']:g} GB/s, α {self.latency_us:g} µs "
                f"β {self.hop_latency_us:g} µs")


@dataclass(frozen=True)
class Collective:
    """One collective of a redistribution. ``bytes``: nccl-tests size (gathered tensor for
    all-gather/reduce-scatter/all-reduce, per-rank buffer for all-to-all, local output for
    a "local" chunk); ``algorithm``: "ring", "tree", "pairwise" or "local"."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all" | "local"
    mesh_axis: int
    axis_name: str
    bytes: int
    time_us: float
    algorithm: str = "ring"


@dataclass(frozen=True)
class Step:
    """One per-axis transition of a redistribution (before it is costed)."""

    mesh_axis: int
    src: Placement
    dst: Placement
    kind: str | None  # a collective kind, "local", or None when not allowed
    bytes: int
    relayout_bytes: int = 0  # the local copy a gather/scatter on a dim > 0 needs (module doc)


# ------------------------------------------------------------------ mesh axis → link
def axis_links(hw: HardwareProfile, mesh_shape: Sequence[int],
               mesh_axis_names: Sequence[str] | None = None) -> list[AxisLink]:
    """Link per mesh axis for a row-major rank layout (innermost axis = contiguous ranks)."""
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be non-empty positive sizes, got {mesh_shape!r}")
    names = tuple(mesh_axis_names) if mesh_axis_names is not None else tuple(f"axis{i}" for i in range(len(shape)))
    if len(names) != len(shape):
        raise ValueError(f"mesh_axis_names {names!r} do not match mesh_shape {shape!r}")
    gpn = hw.gpus_per_node
    links: list[AxisLink] = []
    for i, n in enumerate(shape):
        inner = math.prod(shape[i + 1:])
        intra = n * inner <= gpn or n == 1
        if intra:
            intra_bw = {k: hw.intra_node.bandwidth(k, n) for k in COLLECTIVE_KINDS}
            links.append(AxisLink(i, names[i], n, True, n, intra_bw, hw.intra_node.latency_us,
                                  hw.intra_node.hop_latency_us, False, hw.tree_bandwidth_factor))
        else:
            members = max(1, gpn // inner) if inner < gpn else 1
            nic = members * hw.inter_node.bandwidth_gbps
            bw = {k: min(hw.intra_node.bus_bandwidth_gbps[k], nic) for k in COLLECTIVE_KINDS}
            links.append(AxisLink(i, names[i], n, False, members, bw, hw.inter_node.latency_us,
                                  hw.inter_node.hop_latency_us, True, hw.tree_bandwidth_factor))
    return links


# ------------------------------------------------------------------ one collective
def _us(nbytes: float, gbps: float) -> float:
    """Microseconds to move nbytes at gbps GB/s (1e9 B/s)."""
    return nbytes / (gbps * 1e3)


def collective_time(kind: str, nbytes: float, link: AxisLink, latency_scale: float = 1.0) -> tuple[float, str]:
    """(µs, algorithm) of one collective of ``nbytes`` (see module doc) on ``link``.
    `latency_scale`: the share of the latency this tensor pays (1/k when k tensors share
    one bucketed collective: latency once, bytes summed)."""
    n = link.size
    if kind == "local":
        return 0.0, "local"
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    if n <= 1 or nbytes <= 0:
        return 0.0, "ring"
    a, b = link.latency_us * latency_scale, link.hop_latency_us * latency_scale
    bw = link.bus_bandwidth_gbps[kind]
    frac = (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return a + (n - 1) * b + _us(nbytes * frac, bw), "ring"
    if kind == "all_to_all":
        return a + (n - 1) * b + _us(nbytes * frac, bw), "pairwise"
    ring = a + 2 * (n - 1) * b + _us(2 * nbytes * frac, bw)
    if link.allow_tree:
        tree = a + 2 * math.ceil(math.log2(n)) * b + _us(nbytes, bw * link.tree_bandwidth_factor)
        if tree < ring:
            return tree, "tree"
    return ring, "ring"


def decompose_redistribution(src: Sequence[Placement], dst: Sequence[Placement],
                             shape: Sequence[int], itemsize: int,
                             mesh_shape: Sequence[int]) -> list[Step]:
    """The per-axis steps (kind + bytes) to go from ``src`` to ``dst`` placements of a
    tensor of global ``shape``. A step with ``kind=None`` is not allowed (→ inf cost)."""
    if len(src) != len(mesh_shape) or len(dst) != len(mesh_shape):
        raise ValueError(f"placements {tuple(src)} -> {tuple(dst)} do not match a "
                         f"{len(mesh_shape)}-D mesh {tuple(mesh_shape)}")
    ndim = len(shape)
    s_ids, d_ids = placement_ids(src, ndim), placement_ids(dst, ndim)
    cur = list(s_ids)
    out: list[Step] = []
    for ax, kind, divisors, via_replicate, dim in transition_template(s_ids, d_ids, ndim, tuple(mesh_shape)):
        t = _REPLICATE_ID if via_replicate else d_ids[ax]
        out.append(Step(ax, _PLACEMENTS[cur[ax]], _PLACEMENTS[t], kind, step_bytes(shape, divisors, itemsize),
                        relayout_bytes(kind, shape, divisors, itemsize, dim)))
        cur[ax] = t
    return out


def _local_shape(shape: Sequence[int], divisors: Sequence[tuple[int, int]]) -> list[int]:
    """The tensor's local shape after a template step's (dim, axis size) divisions (the
    largest shard of an uneven split)."""
    local = list(shape)
    for d, size in divisors:
        local[d] = -(-local[d] // size)
    return local


def step_bytes(shape: Sequence[int], divisors: Sequence[tuple[int, int]], itemsize: int) -> int:
    """Bytes a template step moves: the tensor's local size after its (dim, axis size) divisions."""
    return math.prod(_local_shape(shape, divisors)) * itemsize


def relayout_bytes(kind: str | None, shape: Sequence[int], divisors: Sequence[tuple[int, int]], itemsize: int,
                   dim: int | None) -> int:
    """Bytes of the local copy a template step needs (see the module doc): the step's
    tensor when it scatters onto tensor dim `dim` > 0, or gathers it and some dim before it
    has a local size above 1; else 0."""
    if dim is None or dim <= 0:
        return 0
    local = _local_shape(shape, divisors)
    if kind == "all_gather" and math.prod(local[:dim]) <= 1:
        return 0
    return math.prod(local) * itemsize


# Placements interned as small ints: the template below runs ~10^5-10^6 times on 3-4-D
# meshes, and hashing / isinstance on torch 2.13's placement types dominate otherwise.
_IDS: dict[tuple[Placement, int], int] = {}
_PLACEMENTS: list[Placement] = []
_INFO: list[tuple[int | None, bool, bool]] = []  # per id: (shard dim, is partial, is replicate)


def _placement_id(p: Placement, ndim: int) -> int:
    key = (p, ndim)
    i = _IDS.get(key)
    if i is None:
        q = normalize((p,), ndim)[0]
        j = _IDS.get((q, -1))  # one id per normalised placement, whatever ndim it came from
        if j is None:
            j = _IDS[(q, -1)] = len(_PLACEMENTS)
            _PLACEMENTS.append(q)
            _INFO.append(classify(q))
        i = _IDS[key] = j
    return i


def placement_ids(placements: Sequence[Placement], ndim: int) -> tuple[int, ...]:
    """Interned ids of (normalised) placements: equal ids ⇔ equal placements."""
    return tuple(_placement_id(p, ndim) for p in placements)


_REPLICATE_ID = _placement_id(Replicate(), 1)


def _greedy_moves(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int, bool]]:
    """(axis, from id, to id, via replicate) per step, in DTensor's greedy order."""
    info = _INFO
    cur = list(src)
    moves: list[tuple[int, int, int, bool]] = []
    if len(cur) == 1:
        return [(0, cur[0], dst[0], False)] if cur[0] != dst[0] else []
    # DTensor's greedy order (generate_greedy_transform_infos): when anything is sharded,
    # inner → outer first: a target shard on a tensor dim sharded differently on the
    # outer axes (nested / misaligned) is replicated first ...
    if any(info[c][0] is not None for c in cur):
        for ax in reversed(range(len(cur))):
            c, t = cur[ax], dst[ax]
            via = False
            td = info[t][0]
            if td is not None:
                cur_outer = [i for i in range(ax) if info[cur[i]][0] == td]
                dst_outer = [i for i in range(ax) if info[dst[i]][0] == td]
                if cur_outer != dst_outer:
                    t, via = _REPLICATE_ID, True
            if c != t:
                moves.append((ax, c, t, via))
                cur[ax] = t
    # ... then outer → inner to the targets
    for ax in range(len(cur)):
        if cur[ax] != dst[ax]:
            moves.append((ax, cur[ax], dst[ax], False))
            cur[ax] = dst[ax]
    return moves


@functools.lru_cache(maxsize=None)
def transition_template(src: tuple[int, ...], dst: tuple[int, ...], ndim: int,
                        mesh_shape: tuple[int, ...]
                        ) -> tuple[tuple[int, str | None, tuple[tuple[int, int], ...], bool, int | None], ...]:
    """The shape-independent part of a redistribution between placement ids: per step its
    axis, collective kind, the (tensor dim, mesh-axis size) divisions that give the bytes
    it moves, whether it goes to Replicate first (a nested shard, see below), and the
    tensor dim an all-gather or reduce-scatter works on when it is not 0 (a relayout,
    `relayout_bytes`; else None).
    Planning prices ~10^6 (src, dst, shape) triples over ~10^5 placement pairs, so this
    is computed once per pair."""
    info = _INFO
    cur = list(src)
    out = []
    for ax, c, t, via in _greedy_moves(src, dst):
        cd, cp, _ = info[c]
        td, tp, tr = info[t]
        counted, skip, dim = cur, None, None
        if cd is not None and tr:
            kind, skip, dim = "all_gather", ax, cd
        elif cd is not None and td is not None:
            kind = "all_to_all"
        elif cp and tr:
            kind = "all_reduce"
        elif cp and td is not None:
            kind, dim = "reduce_scatter", td
        elif cp and tp:
            # e.g. Partial(sum) → Partial(avg): priced as reducing it (an all-reduce)
            kind = "all_reduce"
        elif info[c][2] and td is not None:
            kind = "local"
            counted = list(cur)
            counted[ax] = t
        else:  # Replicate/Shard → Partial
            kind = None
        out.append((ax, kind, _id_divisors(counted, ndim, mesh_shape, skip), via, dim or None))
        cur[ax] = t
    return tuple(out)


def _id_divisors(ids: Sequence[int], ndim: int, mesh_shape: Sequence[int],
                 skip_axis: int | None) -> tuple[tuple[int, int], ...]:
    out = []
    for i, pid in enumerate(ids):
        d = _INFO[pid][0]
        if i != skip_axis and d is not None and 0 <= d < ndim:
            out.append((d, mesh_shape[i]))
    return tuple(out)


# ------------------------------------------------------------------ reports
def summarize_collectives(collectives: Iterable[Collective]) -> dict[tuple[str, str], dict[str, float]]:
    """Sum per (kind, axis_name): {"count", "bytes", "time_us"} — for the Plan's report."""
    acc: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0, "time_us": 0.0})
    for c in collectives:
        e = acc[(c.kind, c.axis_name)]
        e["count"] += 1
        e["bytes"] += c.bytes
        e["time_us"] += c.time_us
    return dict(sorted(acc.items()))
