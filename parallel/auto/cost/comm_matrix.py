"""Redistribution costs of a whole matrix of placement pairs, in arrays.

The planner prices every (producer placement, consumer placement) pair of every edge:
~10^6 pairs on a 4-D mesh, each a Python walk (`comm.transition_template`) plus one
`collective_time` per step. Here the same walk runs for all pairs at once: DTensor's
greedy per-axis order (inner → outer to Replicate where a target shard is nested
differently, then outer → inner to the targets) as numpy masks over a (pairs, mesh axes)
array of interned placement ids, and each step is priced with the formulas of
`comm.collective_time` and `CostModel.relayout_cost`, in the same order of float
operations, so every entry equals `CostModel.redistribute_cost_ids` bit for bit.

Uneven shards: ceil(ceil(x/a)/b) = ceil(x/(ab)), so one division by the product of a
dim's mesh sizes gives the largest shard that `comm.step_bytes` computes step by step.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from parallel.auto.cost import comm
from parallel.auto.cost.comm import AxisLink

_NONE, _AG, _RS, _AR, _A2A, _LOCAL = range(6)  # step kinds (_NONE: not allowed → inf)
_KIND_NAMES = {_AG: "all_gather", _RS: "reduce_scatter", _AR: "all_reduce", _A2A: "all_to_all"}

_info_cache: list = [0, None, None, None]  # (ids known, shard dim, is partial, is replicate)


def _info() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per interned placement id: shard dim (-1 if none), is partial, is replicate."""
    n = len(comm._INFO)
    if _info_cache[0] != n:
        info = comm._INFO
        _info_cache[:] = [n,
                          np.array([-1 if d is None else d for d, _, _ in info], dtype=np.int64),
                          np.array([p for _, p, _ in info], dtype=bool),
                          np.array([r for _, _, r in info], dtype=bool)]
    return _info_cache[1], _info_cache[2], _info_cache[3]


def _collective_us(kind: np.ndarray, nbytes: np.ndarray, link: AxisLink, latency_scale: float) -> np.ndarray:
    """`comm.collective_time` of each (kind, bytes), for one link."""
    out = np.zeros(len(kind))
    n = link.size
    if n <= 1:
        return out
    a, b = link.latency_us * latency_scale, link.hop_latency_us * latency_scale
    frac = (n - 1) / n
    live = nbytes > 0
    for k in (_AG, _RS, _A2A):
        sel = live & (kind == k)
        if sel.any():
            bw = link.bus_bandwidth_gbps[_KIND_NAMES[k]]
            out[sel] = (a + (n - 1) * b) + (nbytes[sel] * frac) / (bw * 1e3)
    sel = live & (kind == _AR)
    if sel.any():
        bw = link.bus_bandwidth_gbps["all_reduce"]
        nb = nbytes[sel]
        t = (a + 2 * (n - 1) * b) + ((2 * nb) * frac) / (bw * 1e3)
        if link.allow_tree:
            tree = (a + 2 * math.ceil(math.log2(n)) * b) + nb / ((bw * link.tree_bandwidth_factor) * 1e3)
            t = np.where(tree < t, tree, t)
        out[sel] = t
    return out


class _Walk:
    """The greedy walk of every pair, priced step by step."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, shape: Sequence[int], itemsize: int,
                 links: Sequence[AxisLink], relayout_denominator: float, latency_scale: float):
        self.sd, self.partial, self.repl = _info()
        self.cur = src.copy()
        self.dst = dst
        self.shape = np.asarray(shape, dtype=np.int64)
        self.itemsize = itemsize
        self.links = links
        self.mesh = np.array([lk.size for lk in links], dtype=np.int64)
        self.relayout_denominator = relayout_denominator
        self.latency_scale = latency_scale
        self.total = np.zeros(len(src))

    def local_bytes(self, counted: np.ndarray, skip: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(bytes of the local tensor, per pair, counting the shards of `counted` except on
        the pairs' `skip` axis; local sizes per tensor dim)."""
        ndim = len(self.shape)
        dims = self.sd[counted]  # (P, M)
        div = np.ones((len(counted), ndim), dtype=np.int64)
        for i in range(counted.shape[1]):
            d = dims[:, i]
            ok = (d >= 0) & (d < ndim)
            if skip is not None:
                ok &= skip != i
            rows = np.nonzero(ok)[0]
            div[rows, d[rows]] *= self.mesh[i]
        local = -(-self.shape[None, :] // div)
        return local.prod(axis=1) * self.itemsize, local

    def step(self, ax: int, move: np.ndarray, target: np.ndarray) -> None:
        """Move the pairs in `move` from their current placement on `ax` to `target`."""
        rows = np.nonzero(move)[0]
        if len(rows) == 0:
            return
        sd, partial, repl = self.sd, self.partial, self.repl
        cur = self.cur[rows]
        c, t = cur[:, ax], target[rows]
        cd, td = sd[c], sd[t]
        cp, tp, tr = partial[c], partial[t], repl[t]
        kind = np.full(len(rows), _NONE)
        rest = cd < 0
        kind[rest & repl[c] & (td >= 0)] = _LOCAL
        kind[rest & cp & (tr | tp)] = _AR
        kind[rest & cp & (td >= 0)] = _RS
        kind[(cd >= 0) & (td >= 0)] = _A2A
        kind[(cd >= 0) & tr] = _AG
        is_ag = kind == _AG
        counted = cur.copy()
        loc = kind == _LOCAL
        counted[loc, ax] = t[loc]
        skip = np.where(is_ag, ax, -1)
        nbytes, local = self.local_bytes(counted, skip)
        cost = _collective_us(kind, nbytes, self.links[ax], self.latency_scale)
        self.total[rows] += cost
        # relayout: a gather of dim cd or a scatter onto dim td > 0 copies the tensor once more
        dim = np.where(is_ag, cd, np.where(kind == _RS, td, 0))
        relay = dim > 0
        if relay.any():
            cum = np.cumprod(np.concatenate([np.ones((len(rows), 1), dtype=np.int64), local], axis=1), axis=1)
            before = cum[np.arange(len(rows)), np.maximum(dim, 0)]
            relay &= ~(is_ag & (before <= 1)) & (nbytes > 0)
            if relay.any():
                us = np.zeros(len(rows))
                us[relay] = (2.0 * nbytes[relay]) / self.relayout_denominator * 1e6
                self.total[rows] += us
        bad = rows[kind == _NONE]
        self.total[bad] = math.inf
        self.cur[rows, ax] = t


def redistribution_costs(src: np.ndarray, dst: np.ndarray, shape: Sequence[int], itemsize: int,
                         links: Sequence[AxisLink], relayout_denominator: float,
                         latency_scale: float = 1.0) -> np.ndarray:
    """µs to take a tensor of global `shape` from each row of `src` to each row of `dst`
    ((A, M) and (B, M) interned placement ids, `comm.placement_ids`): an (A, B) array,
    inf where a step is not allowed. `relayout_denominator`: memory bytes/s of a local copy."""
    a_n, b_n = len(src), len(dst)
    s = np.repeat(np.asarray(src, dtype=np.int64), b_n, axis=0)
    d = np.tile(np.asarray(dst, dtype=np.int64), (a_n, 1))
    w = _Walk(s, d, shape, itemsize, links, relayout_denominator, latency_scale)
    m = s.shape[1]
    sharded = (w.sd[s] >= 0).any(axis=1)
    for ax in reversed(range(m)):  # inner → outer, only when anything is sharded
        t = d[:, ax].copy()
        td = w.sd[t]
        nested = np.zeros(len(s), dtype=bool)
        for i in range(ax):
            nested |= (w.sd[w.cur[:, i]] == td) != (w.sd[d[:, i]] == td)
        t[(td >= 0) & nested] = comm._REPLICATE_ID
        w.step(ax, sharded & (w.cur[:, ax] != t), t)
    for ax in range(m):  # then outer → inner to the targets
        w.step(ax, w.cur[:, ax] != d[:, ax], d[:, ax])
    return w.total.reshape(a_n, b_n)
