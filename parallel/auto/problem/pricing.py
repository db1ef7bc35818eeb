"""Prices of every strategy and edge of a Problem, from the cost model.

Compute: each OP strategy runs on the local shapes its placements give (cached per op key
and menu: copies of a layer share them). Redistribution: one matrix per (tensor, producer
placement classes, consumer placement classes), priced in arrays from `MATRIX_PAIRS` pairs
on (`cost/comm_matrix.py`: a 4-D mesh has ~10^6 pairs), pair by pair on interned placement
ids below that (`cost/comm.transition_template`); both give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import Replicate

from parallel.auto.candidates.placements import flat_bucket_key, local_shape
from parallel.auto.candidates.strategies import OP, Candidates, NodeCandidates
from parallel.auto.cost.comm import placement_ids
from parallel.auto.cost.model import CostModel
from parallel.auto.regions import region_cost, region_of


@dataclass(frozen=True)
class EdgeRole:
    """What the runtime does with the tensor crossing an edge (cost/model.RuntimeSchedule):
    "param": a parameter on its way to an op (bucketed, prefetched; `repeat` 2 when the
    backward gathers it again); "grad": a gradient reduced into its parameter's placement
    (bucketed, overlapped, in the reduce dtype); "loss": the mean loss or its token count,
    scalars reduced beside the step's compute (runtime/loss_sync.py: started a whole forward
    or backward before they are waited for), free when the runtime overlaps;
    "act": anything else (issued where needed). `bucket`: tensors sharing its bucketed
    collective."""

    kind: str = "act"
    bucket: int = 1
    repeat: int = 1


ACTIVATION = EdgeRole()
LOSS = EdgeRole("loss")
MATRIX_PAIRS = 64  # from this many placement pairs an edge is priced in arrays (comm_matrix)


def comm_dtype(dtype: torch.dtype, mp_dtype: torch.dtype | None) -> torch.dtype:
    if mp_dtype is not None and dtype.is_floating_point and dtype.itemsize > mp_dtype.itemsize:
        return mp_dtype
    return dtype


def _map_args(fn: Any, a: Any) -> Any:
    """`fn` applied to the leaves of an FX node's args (lists, tuples, dicts of them): what
    pytree's tree_map does, at a fifth of its cost on the ~10^5 strategies of a 3-D mesh."""
    if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        out = [_map_args(fn, x) for x in a]
        return out if isinstance(a, list) else tuple(out)
    if isinstance(a, dict):
        return {k: _map_args(fn, v) for k, v in a.items()}
    return fn(a)


def _scaled(costs: np.ndarray | float, mult: float) -> np.ndarray | float:
    """`costs` x `mult`; with `mult` 0 (a transition the runtime hides entirely) free, unless
    it cannot be done: inf stays inf (inf * 0 would be NaN, which poisons the solvers' minima)."""
    return costs * mult if mult != 0.0 else np.where(np.isinf(costs), costs, 0.0)


class StrategyPricer:
    """Compute and redistribution cost arrays for the strategies of one Candidates."""

    def __init__(self, cands: Candidates, cm: Any, mp_dtype: torch.dtype | None):
        self.cands = cands
        self.cm = cm
        self.mp_dtype = mp_dtype
        self.mesh_shape = tuple(cands.mesh.shape)
        self.compute_cache: dict[Any, np.ndarray] = {}
        self.strategy_cache: dict[tuple, float] = {}  # (op key, local inputs, local outputs) -> µs
        self.redist_cache: dict[Any, np.ndarray] = {}
        self.pair_cache: dict[tuple, float] = {}  # (shape, dtype, src id, dst id) -> µs
        self.placement_ids: dict[tuple, int] = {}
        self.id_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        self.bucketed_cache: dict[tuple[int, int, str, tuple], bool] = {}  # (src id, dst id, role kind, shape)
        # the id-based fast path prices exactly like redistribute_cost; a cost model that
        # overrides redistribute_cost is asked through it
        self.fast_pricing = (hasattr(cm, "redistribute_cost_ids") and
                             getattr(type(cm), "redistribute_cost", None) is CostModel.redistribute_cost)
        # the arrays replay CostModel's own per-pair pricing: only for a model that keeps it
        self.matrix_pricing = self.fast_pricing and all(
            getattr(type(cm), f, None) is getattr(CostModel, f)
            for f in ("redistribute_cost_ids", "relayout_cost", "redistribute_cost_matrix"))

    def compute(self, c: NodeCandidates) -> np.ndarray:
        if c.kind != OP:
            return np.zeros(len(c.specs))
        key = (c.key, id(c.specs))
        hit = self.compute_cache.get(key)
        if hit is not None:
            return hit
        node = c.node
        arr = np.zeros(len(c.specs))
        if region_of(node.target) is not None:  # a local_map region: declared collectives + FLOPs
            # the step graph keeps each region's forward for its backward (regions/tape.py)
            arr[:] = [region_cost(self.cm, node, s, self.mesh_shape, kept=True) for s in c.specs]
            self.compute_cache[key] = arr
            return arr
        for j, s in enumerate(c.specs):
            ins = tuple((local_shape(tuple(a.meta["val"].shape), spec.placements, self.mesh_shape), a.meta["val"].dtype)
                        for a, spec in zip(c.inputs, s.input_specs))
            outs = s.output_specs
            if isinstance(outs, tuple):
                out_meta = [(local_shape(tuple(o.tensor_meta.shape), o.placements, self.mesh_shape),
                             o.tensor_meta.dtype)
                            for o in outs if o is not None]
            else:
                out_meta = [(local_shape(tuple(outs.tensor_meta.shape), outs.placements, self.mesh_shape),
                             outs.tensor_meta.dtype)]
            # strategies of one op (its key: target, global shapes, literals) on the same local
            # shapes cost the same: most of a 3-D menu repeats a few local shapes
            sk = (c.key, ins, tuple(out_meta)) if c.key is not None else None
            cost = self.strategy_cache.get(sk) if sk is not None else None
            if cost is not None:
                arr[j] = cost
                continue
            local = {a.name: v for a, v in zip(c.inputs, ins)}

            def conv(a: Any) -> Any:
                if isinstance(a, torch.fx.Node):
                    if a.name in local:
                        return local[a.name]
                    return a.meta.get("val")
                return a

            args = _map_args(conv, node.args)
            kwargs = _map_args(conv, dict(node.kwargs))
            try:
                arr[j] = self.cm.compute_cost(node.target, args, local_kwargs_meta=kwargs, out_meta=out_meta)
            except Exception:  # noqa: BLE001 - cost model could not run the op: charge bytes only
                arr[j] = self.cm.compute_cost(node.target, args, flops=0.0, local_kwargs_meta=kwargs, out_meta=out_meta)
            if sk is not None:
                self.strategy_cache[sk] = arr[j]
        self.compute_cache[key] = arr
        return arr

    def _role_terms(self, dtype: torch.dtype, role: EdgeRole) -> tuple[torch.dtype, float, float, float]:
        """(dtype on the wire, latency share and cost multiplier when the runtime buckets the
        transition, cost multiplier when it does not) of an edge of this role."""
        sched = getattr(self.cm, "schedule", None)
        if sched is None or role.kind == "act":
            return comm_dtype(dtype, self.mp_dtype), 1.0, 1.0, 1.0
        cdt = comm_dtype(dtype, self.mp_dtype)
        if role.kind == "grad" and sched.reduce_dtype is not None and dtype.is_floating_point:
            cdt = sched.reduce_dtype
        share = sched.overlapped_share(self.cm.hw.comm_overlap)
        if role.kind == "loss":  # scalars: no bytes for the cores to move, their latency waited beside compute
            paid = 0.0 if sched.overlap else 1.0
            return cdt, 1.0, paid, paid
        if not sched.bucket:
            return cdt, 1.0, role.repeat * share, share
        return cdt, 1.0 / role.bucket, role.repeat * share, share

    def _bucketed(self, role: EdgeRole, src: tuple, dst: tuple, shape: tuple) -> bool:
        """Whether the runtime does src -> dst in its block's flat-buffer collective: a
        parameter gathered whole for an op (then also re-gathered in the backward when
        resharding), or a gradient reduced into its parameter's placement
        (runtime/interpreter.py, runner.py), split evenly or, unevenly, by one mesh axis
        (`flat_bucket_key`); any other transition runs on its own."""
        if role.kind == "param" and not all(isinstance(p, Replicate) for p in dst):
            return False
        return flat_bucket_key(shape, tuple(src), tuple(dst), self.mesh_shape) is not None

    def redistribution(self, shape: tuple, dtype: torch.dtype, src: list[tuple], dst: list[tuple],
                       role: EdgeRole = ACTIVATION) -> np.ndarray:
        key = (shape, dtype, tuple(src), tuple(dst), role)
        hit = self.redist_cache.get(key)
        if hit is not None:
            return hit
        cdt, bucket_scale, bucket_mult, plain_mult = self._role_terms(dtype, role)
        meta = (shape, cdt)
        sid = [self._intern(p) for p in src]
        did = [self._intern(p) for p in dst]
        by_ids = self.fast_pricing  # interned placement ids: no placement hashing in the hot loop
        if by_ids:
            ndim = len(shape)
            s_ids = [self._ids(i, p, ndim) for i, p in zip(sid, src)]
            d_ids = [self._ids(i, p, ndim) for i, p in zip(did, dst)]
            if self.matrix_pricing and len(src) * len(dst) >= MATRIX_PAIRS:
                m = self._matrix(shape, cdt, s_ids, d_ids, sid, did, src, dst, role,
                                 (bucket_scale, bucket_mult, plain_mult))
                self.redist_cache[key] = m
                return m
        m = np.empty((len(src), len(dst)))
        pairs = self.pair_cache
        for a, sp in enumerate(src):
            for b, dp in enumerate(dst):
                if sid[a] == did[b]:
                    m[a, b] = 0.0
                    continue
                bucketed = False
                if role.kind != "act":
                    bk = (sid[a], did[b], role.kind, shape)
                    bucketed = self.bucketed_cache.get(bk)
                    if bucketed is None:
                        bucketed = self.bucketed_cache[bk] = self._bucketed(role, sp, dp, shape)
                scale, mult = (bucket_scale, bucket_mult) if bucketed else (1.0, plain_mult)
                k = (shape, cdt, sid[a], did[b], scale)
                c = pairs.get(k)
                if c is None:
                    if by_ids:
                        c = self.cm.redistribute_cost_ids(s_ids[a], d_ids[b], shape, cdt.itemsize, scale)
                    else:
                        c = self.cm.redistribute_cost(sp, dp, meta)
                    pairs[k] = c
                m[a, b] = _scaled(c, mult)
        self.redist_cache[key] = m
        return m

    def _matrix(self, shape: tuple, cdt: torch.dtype, s_ids: list, d_ids: list, sid: list[int], did: list[int],
                src: list[tuple], dst: list[tuple], role: EdgeRole, terms: tuple[float, float, float]) -> np.ndarray:
        """The loop above for a whole matrix at once (cost/comm_matrix.py); same numbers."""
        bucket_scale, bucket_mult, plain_mult = terms
        s_arr, d_arr = np.array(s_ids, dtype=np.int64), np.array(d_ids, dtype=np.int64)
        m = _scaled(self.cm.redistribute_cost_matrix(s_arr, d_arr, shape, cdt.itemsize), plain_mult)
        if role.kind == "act":
            return m
        cache = self.bucketed_cache
        bucketed = np.zeros(m.shape, dtype=bool)
        for a, sp in enumerate(src):
            for b, dp in enumerate(dst):
                bk = (sid[a], did[b], role.kind, shape)
                hit = cache.get(bk)
                if hit is None:
                    hit = cache[bk] = sid[a] != did[b] and self._bucketed(role, sp, dp, shape)
                bucketed[a, b] = hit
        if bucketed.any():
            rows, cols = np.nonzero(bucketed)
            ra, ca = np.unique(rows), np.unique(cols)
            sub = self.cm.redistribute_cost_matrix(s_arr[ra], d_arr[ca], shape, cdt.itemsize, bucket_scale)
            full = np.zeros(m.shape)
            full[np.ix_(ra, ca)] = _scaled(sub, bucket_mult)
            m = np.where(bucketed, full, m)
        return m

    def _ids(self, sid: int, placements: tuple, ndim: int) -> tuple[int, ...]:
        k = (sid, ndim)
        hit = self.id_cache.get(k)
        if hit is None:
            hit = self.id_cache[k] = placement_ids(placements, ndim)
        return hit

    def _intern(self, placements: tuple) -> int:
        i = self.placement_ids.get(placements)
        if i is None:
            i = self.placement_ids[placements] = len(self.placement_ids)
        return i
