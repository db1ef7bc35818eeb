"""CostModel: the one object the planner asks for microseconds.

Pure data: built from a hardware profile and a mesh *shape*; it never creates a tensor on
a device, a DeviceMesh or a process group, so planning for 128 H100s runs on a laptop.
Subclass it (or duck-type its three methods) to plug in a different model.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from parallel.auto.candidates.placements import local_shape

from .comm import (
    AxisLink,
    Collective,
    RedistributionNotAllowed,
    Step,
    axis_links,
    collective_time,
    decompose_redistribution,
    placement_ids,
    relayout_bytes,
    step_bytes,
    summarize_collectives,
    transition_template,
)
from .comm_matrix import redistribution_costs
from .compute import (
    FlopCache,
    _as_shape_dtype,
    _freeze,
    _nbytes,
    _tensor_list,
    attention_efficiency,
    attention_flops,
    is_zero_cost,
    op_class,
    roofline_us,
)
from .hardware import HardwareProfile, load_hardware

__all__ = ["CostModel", "RuntimeSchedule"]

# AdamW reads and writes param, grad, exp_avg, exp_avg_sq (fp32: 32 B per parameter); the
# gradient-norm clipping reads every gradient and scales it (16 B)
DEFAULT_ROUTING_IMBALANCE = 1.25
"""MoE all-to-all bytes priced = balanced bytes x this (README "MoE dispatch")."""
OPTIMIZER_BYTES_PER_PARAM = 4 * 4 * 2 + 4 * 2 * 2

PlacementsLike = Any  # DTensorSpec | Sequence[Placement]
TensorMetaLike = Any  # TensorMeta | (shape, dtype) | torch.Tensor | None (taken from a DTensorSpec)


def _placements(x: PlacementsLike) -> tuple[Placement, ...]:
    p = getattr(x, "placements", None)
    if p is not None:
        return tuple(p)
    if isinstance(x, Placement):
        return (x,)
    return tuple(x)


@dataclass(frozen=True)
class RuntimeSchedule:
    """What the runtime does with a plan's collectives (runtime/), so the cost model prices
    that and not one collective per tensor issued where it is needed.

    bucket: the parameter gathers and gradient reductions of one block run as one flat
        collective per placement group: each tensor pays latency / (tensors in the block);
    reduce_bucket_bytes: the gradient buckets of consecutive blocks are joined until one
        holds this many bytes (RuntimeOptions.reduce_bucket_bytes; 0: one per block): a
        gradient pays latency / (tensors in its joined bucket);
    overlap: those collectives run beside compute (prefetched one block ahead, reductions
        during the rest of the backward): they cost what the cores spend driving them,
        (1 - comm_overlap) of their time, plus `exposed` of the rest that compute cannot
        always hide;
    reshard_after_forward: parameters used again by the backward are gathered again there;
    reduce_dtype: gradients are reduced in this dtype (the mixed-precision policy's).
    """

    bucket: bool = True
    overlap: bool = True
    reshard_after_forward: bool = True
    reduce_bucket_bytes: int = 25 * 2**20
    reduce_dtype: torch.dtype | None = None
    exposed: float = 0.2

    def overlapped_share(self, comm_overlap: float) -> float:
        """Share of an overlapped collective's time a step still pays."""
        if not self.overlap:
            return 1.0
        return (1.0 - comm_overlap) + comm_overlap * self.exposed


class CostModel:
    """Costs in µs for the planner: ``compute_cost`` (roofline per op on local shapes),
    ``redistribute_cost`` / ``redistribute_collectives`` (collectives per mesh axis).

    Args:
        hw: profile name ("h100", "h200", "a100", "cpu"), a path to a .toml, or a
            HardwareProfile.
        mesh_shape: sizes of the mesh axes, outermost first (row-major rank order).
        mesh_axis_names: names for reports (default "axis0", ...).
        compute_dtype: mixed precision: when set (e.g. torch.bfloat16), floating ops use
            this dtype's peak and floating tensors count at its size in memory traffic.
        links: override the per-axis links (used by ``project`` for 1-D seeding problems).
        schedule: what the runtime does with collectives (bucketing, overlap, resharding,
            reduce dtype); the default is the runtime's default.
        routing_imbalance: routed-token all-to-alls (a region option's `exchange`, e.g. MoE
            dispatch) are priced at the balanced bytes x this (the busiest rank bounds them).
        optimizer: AdamW's implementation (`[optimizer] implementation`): a calibrated
            profile's figures for it price the optimizer step (`optimizer_rate`).
    """

    def __init__(
        self,
        hw: "str | os.PathLike[str] | HardwareProfile",
        mesh_shape: Sequence[int],
        mesh_axis_names: Sequence[str] | None = None,
        *,
        compute_dtype: torch.dtype | None = None,
        links: Sequence[AxisLink] | None = None,
        schedule: RuntimeSchedule | None = None,
        routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE,
        optimizer: str = "foreach",
    ) -> None:
        if not routing_imbalance >= 1.0:
            raise ValueError(f"routing imbalance {routing_imbalance!r}: must be >= 1.0 (1.0 = perfectly balanced "
                             "routing; the busiest rank receives factor x the mean)")
        self.hw: HardwareProfile = load_hardware(hw)
        self.routing_imbalance = float(routing_imbalance)
        self.optimizer = optimizer
        self.schedule = schedule if schedule is not None else RuntimeSchedule()
        self.mesh_shape: tuple[int, ...] = tuple(int(s) for s in mesh_shape)
        self.links: list[AxisLink] = list(links) if links is not None else axis_links(
            self.hw, self.mesh_shape, mesh_axis_names)
        if len(self.links) != len(self.mesh_shape):
            raise ValueError(f"{len(self.links)} links for a {len(self.mesh_shape)}-D mesh")
        self.mesh_axis_names: tuple[str, ...] = tuple(link.name for link in self.links)
        self.compute_dtype = compute_dtype
        self.flop_cache = FlopCache.shared()
        self._redist_cache: dict[Any, tuple[Step, ...]] = {}
        self._cost_cache: dict[Any, float] = {}
        self._op_cost_cache: dict[Any, float] = {}

    @classmethod
    def from_mesh(cls, hw: "str | os.PathLike[str] | HardwareProfile", mesh: DeviceMesh, **kwargs: Any) -> "CostModel":
        """Build from a DeviceMesh (real or fake): its shape and axis names, nothing else."""
        return cls(hw, tuple(mesh.shape), getattr(mesh, "mesh_dim_names", None), **kwargs)

    # ------------------------------------------------------------------ info
    def __repr__(self) -> str:
        return (f"CostModel({self.hw.name!r}, mesh_shape={self.mesh_shape}, "
                f"mesh_axis_names={self.mesh_axis_names}, compute_dtype={self.compute_dtype})")

    def pricing_key(self) -> tuple:
        """What this model's prices depend on: two models with equal keys price every
        strategy and edge alike (a priced problem is kept and reused under it)."""
        return (repr(self.hw), self.mesh_shape, self.mesh_axis_names, str(self.compute_dtype), repr(tuple(self.links)),
                repr(self.schedule), self.routing_imbalance, self.optimizer)

    def describe(self) -> str:
        """Profile and per-axis links, for logs and plan reports."""
        return "\n".join([self.hw.summary(), *(link.describe() for link in self.links)])

    def is_intra_node(self, mesh_axis: int) -> bool:
        return self.links[mesh_axis].intra_node

    def project(self, mesh_axis: int) -> "CostModel":
        """A 1-D cost model for one axis with that axis's link (split-dimension seeding)."""
        link = self.links[mesh_axis]
        return type(self)(self.hw, (link.size,), compute_dtype=self.compute_dtype,
                          links=[replace(link, axis=0)], schedule=self.schedule,
                          routing_imbalance=self.routing_imbalance, optimizer=self.optimizer)

    # ------------------------------------------------------------------ compute
    def compute_cost(
        self,
        node_or_op: Any,
        local_args_meta: Sequence[Any] | None = None,
        flops: float | None = None,
        *,
        local_kwargs_meta: Mapping[str, Any] | None = None,
        out_meta: Any = None,
        compute_dtype: torch.dtype | None = None,
    ) -> float:
        """µs to run one op on per-device shapes.

        ``node_or_op``: an OpOverload or an fx Node (``call_function``; placeholders,
        outputs and getitem cost 0). ``local_args_meta``: the op's args with every tensor
        given by its *local* shape — a meta/fake tensor, a TensorMeta-like object or a
        ``(shape, dtype)`` pair; non-tensor args as in the graph. When omitted for an fx
        node, the node's own args (global ``meta["val"]`` shapes) are used.
        ``flops``: skip counting and use this. ``out_meta``: local outputs, if known.
        """
        op, kwargs = node_or_op, local_kwargs_meta
        if isinstance(node_or_op, torch.fx.Node):
            node = node_or_op
            if node.op != "call_function":
                return 0.0
            op = node.target
            if local_args_meta is None:
                local_args_meta = node.args
            if kwargs is None:
                kwargs = node.kwargs
        if is_zero_cost(op):
            return 0.0
        args = tuple(local_args_meta or ())
        kwargs = dict(kwargs or {})
        cdt = compute_dtype if compute_dtype is not None else self.compute_dtype
        key = (op, _freeze(args), _freeze(kwargs), flops, _freeze(out_meta), cdt)
        hit = self._op_cost_cache.get(key)
        if hit is None:
            hit = self._op_cost_cache[key] = self._compute_uncached(op, args, kwargs, flops, out_meta, cdt)
        return hit

    def _compute_uncached(self, op: Any, args: tuple, kwargs: dict, flops: float | None,
                          out_meta: Any, cdt: torch.dtype | None) -> float:
        est = None
        if flops is None or out_meta is None:
            est = self.flop_cache.estimate(op, args, kwargs)
        n_flops = float(flops) if flops is not None else est.flops  # type: ignore[union-attr]
        ins = _tensor_list(args) + _tensor_list(kwargs)
        outs = _tensor_list(out_meta) if out_meta is not None else list(est.outputs)  # type: ignore[union-attr]
        if not outs and est is not None and not est.ran and ins:
            outs = [max(ins, key=lambda t: math.prod(t[0]))]  # op failed on meta: guess
        scale_dt = cdt if (cdt is not None and cdt.is_floating_point) else None
        nbytes = _nbytes(ins, scale_dt) + _nbytes(outs, scale_dt)
        dtype = self._op_dtype(ins, outs, cdt)
        fused = attention_flops(op, args, n_flops)  # a fused attention kernel: its own efficiency
        if fused is not None:
            return roofline_us(self.hw, fused, nbytes, dtype, attention_efficiency(self.hw, op, args))
        return roofline_us(self.hw, n_flops, nbytes, dtype, op_class=op_class(op))

    def local_shape(self, global_shape: Sequence[int], placements: PlacementsLike) -> tuple[int, ...]:
        """Per-device shape under ``placements`` (largest shard when uneven)."""
        return local_shape(global_shape, _placements(placements), self.mesh_shape)

    def strategy_compute_cost(self, node: torch.fx.Node, op_spec: Any,
                              compute_dtype: torch.dtype | None = None) -> float:
        """``compute_cost`` of an fx node under one DTensor ``OpSpec``: the node's tensor
        args (in order, lists flattened) take the local shapes of ``op_spec.input_specs``
        and the outputs those of ``op_spec.output_specs``; specs need ``tensor_meta`` or
        the node's ``meta["val"]`` gives the global shape."""
        if node.op != "call_function" or is_zero_cost(node.target):
            return 0.0
        in_specs = list(getattr(op_spec, "input_specs", None) or ())
        it = iter(in_specs)

        def loc(a: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(loc(x) for x in a)
            sd = _as_shape_dtype(a) if isinstance(a, torch.fx.Node) else None
            if sd is None:
                return a
            spec = next(it, None)
            if spec is None:
                return sd
            tm = getattr(spec, "tensor_meta", None)
            shape, dtype = (tuple(tm.shape), tm.dtype) if tm is not None else sd
            return (self.local_shape(shape, spec), dtype)

        args = loc(tuple(node.args))
        outs = getattr(op_spec, "output_specs", None)
        out_list = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        vals = node.meta.get("val")
        vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
        out_meta = []
        for i, spec in enumerate(out_list):
            if spec is None:
                continue
            tm = getattr(spec, "tensor_meta", None)
            sd = (tuple(tm.shape), tm.dtype) if tm is not None else (
                _as_shape_dtype(vals[i]) if i < len(vals) and vals[i] is not None else None)
            if sd is not None:
                out_meta.append((self.local_shape(sd[0], spec), sd[1]))
        return self.compute_cost(node, list(args), local_kwargs_meta=dict(node.kwargs),
                                 out_meta=out_meta or None, compute_dtype=compute_dtype)

    @staticmethod
    def _op_dtype(ins: list, outs: list, cdt: torch.dtype | None) -> torch.dtype | None:
        floats = [dt for _, dt in ins + outs if dt.is_floating_point]
        if cdt is not None and floats:
            return cdt
        return floats[0] if floats else None

    # ------------------------------------------------------------------ communication
    def _key(self, src: PlacementsLike, dst: PlacementsLike, tensor_meta: TensorMetaLike) -> tuple:
        """Cache key (src placements, dst placements, shape, dtype); hot path, kept cheap."""
        if tensor_meta is None:
            tensor_meta = getattr(src, "tensor_meta", None) or getattr(dst, "tensor_meta", None)
        shape, dtype = getattr(tensor_meta, "shape", None), getattr(tensor_meta, "dtype", None)
        if (shape is None or not isinstance(dtype, torch.dtype)
                or isinstance(tensor_meta, tuple) and len(tensor_meta) == 2):
            sd = _as_shape_dtype(tensor_meta) if tensor_meta is not None else None
            if sd is None:
                raise ValueError("redistribute needs the tensor's global shape and dtype: pass tensor_meta "
                                 "(TensorMeta or (shape, dtype)) or DTensorSpecs carrying tensor_meta")
            shape, dtype = sd
        sp = src.placements if hasattr(src, "placements") else _placements(src)
        dp = dst.placements if hasattr(dst, "placements") else _placements(dst)
        return (tuple(sp), tuple(dp), tuple(shape), dtype)

    def _steps(self, key: tuple) -> tuple[Step, ...]:
        steps = self._redist_cache.get(key)
        if steps is None:
            sp, dp, shape, dtype = key
            steps = tuple(decompose_redistribution(sp, dp, shape, dtype.itemsize, self.mesh_shape))
            self._redist_cache[key] = steps
        return steps

    def redistribute_collectives(self, src: PlacementsLike, dst: PlacementsLike,
                                 tensor_meta: TensorMetaLike = None) -> list[Collective]:
        """The collectives (in order) that take a tensor of global shape/dtype
        ``tensor_meta`` from ``src`` to ``dst`` placements, each costed on its axis.
        Raises RedistributionNotAllowed for Replicate/Shard → Partial. The local copy that
        gathering or scattering a dim other than 0 needs is not a collective: it is in
        ``redistribute_cost`` (comm.py, Relayout; `Step.relayout_bytes`)."""
        out = []
        for s in self._steps(self._key(src, dst, tensor_meta)):
            if s.kind is None:
                raise RedistributionNotAllowed(
                    f"{s.src} -> {s.dst} on mesh axis {s.mesh_axis} ('{self.mesh_axis_names[s.mesh_axis]}') "
                    f"is not allowed (placements {_placements(src)} -> {_placements(dst)})")
            link = self.links[s.mesh_axis]
            t, algo = collective_time(s.kind, s.bytes, link)
            out.append(Collective(s.kind, s.mesh_axis, link.name, s.bytes, t, algo))
        return out

    def redistribute_cost(self, src: PlacementsLike, dst: PlacementsLike,
                          tensor_meta: TensorMetaLike = None) -> float:
        """µs to redistribute; 0 when equal; ``math.inf`` when not allowed."""
        key = self._key(src, dst, tensor_meta)
        hit = self._cost_cache.get(key)
        if hit is not None:
            return hit
        sp, dp, shape, dtype = key
        total = self._cost_cache[key] = self.redistribute_cost_ids(
            placement_ids(sp, len(shape)), placement_ids(dp, len(shape)), shape, dtype.itemsize)
        return total

    def redistribute_cost_ids(self, src: tuple[int, ...], dst: tuple[int, ...], shape: tuple[int, ...],
                              itemsize: int, latency_scale: float = 1.0) -> float:
        """`redistribute_cost` on interned placement ids (comm.placement_ids): the planner's
        hot path (~10^6 calls on a 4-D mesh), without hashing placement objects.
        `latency_scale`: see comm.collective_time (bucketed collectives)."""
        total = 0.0
        for ax, kind, divisors, _, dim in transition_template(src, dst, len(shape), self.mesh_shape):
            if kind is None:
                return math.inf
            total += collective_time(kind, step_bytes(shape, divisors, itemsize), self.links[ax], latency_scale)[0]
            if dim is not None:
                total += self.relayout_cost(relayout_bytes(kind, shape, divisors, itemsize, dim))
        return total

    def redistribute_cost_matrix(self, src: np.ndarray, dst: np.ndarray, shape: tuple[int, ...],
                                 itemsize: int, latency_scale: float = 1.0) -> np.ndarray:
        """`redistribute_cost_ids` of every (row of `src`, row of `dst`) pair of interned
        placement ids, as an array (cost/comm_matrix.py): the planner's edge pricing."""
        return redistribution_costs(src, dst, shape, itemsize, self.links,
                                    self.hw.memory_bandwidth * self.hw.memory_efficiency, latency_scale)

    def relayout_cost(self, nbytes: float) -> float:
        """µs of the local copy that gathering or scattering a dim other than 0 needs
        (cost/comm.py, Relayout): read and write `nbytes` at the memory roof."""
        if nbytes <= 0:
            return 0.0
        return 2.0 * nbytes / (self.hw.memory_bandwidth * self.hw.memory_efficiency) * 1e6

    def optimizer_cost(self, local_param_bytes: float) -> float:
        """µs of the optimizer step and gradient clipping over this many local fp32 parameter
        bytes: memory-bound passes over each rank's own shard, so a plan that shards a
        parameter also shards its update (charged to the parameter's placement). A calibrated
        profile's measured rate (`optimizer.gbps`: a real AdamW step and clipping) when it has
        one, else the passes' bytes at the memory roof."""
        rate = self.optimizer_rate()
        if rate is not None:
            return local_param_bytes / (rate[0] * 1e9) * 1e6
        elems = local_param_bytes / 4
        return elems * OPTIMIZER_BYTES_PER_PARAM / (self.hw.memory_bandwidth * self.hw.memory_efficiency) * 1e6

    def optimizer_rate(self) -> tuple[float, float] | None:
        """(GB/s of parameters, µs a tensor) of this job's AdamW implementation in a calibrated
        profile: the fused kernel's figures for "fused" where the profile has them, else
        foreach's (the for-loop one included); None: no measured figure (named profiles).
        Measured alone, as calibrated, fused ran 3.5x foreach's speed on this repository's
        CPU machine, but saved only 0.4-3 % of a 4-rank training step (docs/measurements.md)."""
        opt = self.hw.optimizer
        if not opt:
            return None
        if self.optimizer == "fused" and "fused_gbps" in opt:
            return opt["fused_gbps"], opt["fused_tensor_us"]
        return opt["gbps"], opt["tensor_us"]

    def collective_cost(self, kind: str, nbytes: float, mesh_axis: int) -> float:
        """µs of one collective of ``nbytes`` (nccl-tests size) on a mesh axis."""
        return collective_time(kind, nbytes, self.links[mesh_axis])[0]

    @staticmethod
    def summarize(collectives: Iterable[Collective]) -> dict[tuple[str, str], dict[str, float]]:
        """Sum per (kind, axis_name) for reports; see comm.summarize_collectives."""
        return summarize_collectives(collectives)
