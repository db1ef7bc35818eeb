"""The price of one strategy of a region node: FLOPs of the region function on the local
shapes it computes on (gathered inputs whole along the gathered axes), plus its declared
gathers and all-to-alls."""

from __future__ import annotations

import functools
import json
import math
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.tensor import Replicate
from torch.utils.flop_counter import FlopCounterMode

from parallel.auto.candidates.placements import local_shape
from parallel.auto.regions.declaration import Region, lookup, region_of
from parallel.auto.regions.layout import axis_options
from parallel.auto.regions.ops import as_tuple


def _effective_shapes(r: Region, backward: bool, spec: Any, mesh_shape: tuple) -> list[tuple[int, ...]]:
    """Local shapes the region function computes on: inputs' shards, whole along the axes
    whose option gathers them."""
    ins = list(spec.input_specs)[r.n_outputs:] if backward else list(spec.input_specs)
    opts = axis_options(r, backward, spec)
    shapes = []
    for k, s in enumerate(ins):
        pl = tuple(Replicate() if k in opts[i].gather else p for i, p in enumerate(s.placements))
        shapes.append(local_shape(tuple(s.tensor_meta.shape), pl, mesh_shape))
    return shapes


@functools.lru_cache(maxsize=4096)
def region_flops(name: str, backward: bool, shapes: tuple, dtypes: tuple) -> float:
    """FLOPs of the region function on meta tensors of `shapes` (backward: recompute + vjp)."""
    xs = [torch.empty(s, dtype=d, device="meta", requires_grad=backward and d.is_floating_point)
          for s, d in zip(shapes, dtypes)]
    with FlopCounterMode(display=False) as fc:
        outs = as_tuple(lookup(name).shape_fn()(*xs))
        if backward:
            outs = [o for o in outs if o.requires_grad]
            torch.autograd.grad(outs, [x for x in xs if x.requires_grad], [torch.ones_like(o) for o in outs],
                                allow_unused=True)
    return float(fc.get_total_flops())


def region_cost(cm: Any, node: Any, spec: Any, mesh_shape: tuple, kept: bool = False) -> float:
    """µs of one strategy of a region node: compute (roofline of the region function's FLOPs on
    the shapes it computes on) plus the gathers its options declare (the backward
    reduce-scatters the gathered inputs' gradients) and all-to-alls (`exchange`, times the
    cost model's `routing_imbalance`). `kept`: the runtime keeps the forward for the backward
    (tape.py); else the backward runs the forward again, its gathers and all-to-alls too."""
    r, backward = region_of(node.target)  # type: ignore[misc]
    return _option_us(cm, r, backward, spec, mesh_shape, kept)


def _option_us(cm: Any, r: Region, backward: bool, spec: Any, mesh_shape: tuple, kept: bool) -> float:
    from parallel.auto.cost.compute import roofline_us

    ins = list(spec.input_specs)[r.n_outputs:] if backward else list(spec.input_specs)
    dtypes = tuple(s.tensor_meta.dtype for s in ins)
    shapes = _effective_shapes(r, backward, spec, mesh_shape)
    flops = region_flops(r.name, backward, tuple(shapes), dtypes)
    redo = backward and not kept
    if backward and kept:  # the vjp alone: the kept forward's FLOPs are not run again
        flops = max(0.0, flops - region_flops(r.name, False, tuple(shapes), dtypes))
    cdt = getattr(cm, "compute_dtype", None) or dtypes[0]
    item = cdt.itemsize if cdt.is_floating_point else dtypes[0].itemsize
    outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    nbytes = item * (sum(math.prod(s) for s in shapes)
                     + sum(math.prod(local_shape(tuple(o.tensor_meta.shape), o.placements, mesh_shape)) for o in outs))
    # an attention region runs the fused SDPA kernel inside (its FLOPs counted chunk by chunk)
    t = roofline_us(cm.hw, flops, nbytes, cdt, cm.hw.attention_eff if "attention" in r.name else None)
    for i, o in enumerate(axis_options(r, backward, spec)):
        for k in o.gather:
            g = item * math.prod(local_shape(tuple(ins[k].tensor_meta.shape), ins[k].placements, mesh_shape,
                                             skip_axis=i))
            if not backward or redo:
                t += cm.collective_cost("all_gather", g, i)
            if backward:
                t += cm.collective_cost("reduce_scatter", g, i)
        if o.exchange is not None:
            n = item * cm.routing_imbalance * o.exchange([local_shape(tuple(s.tensor_meta.shape), s.placements,
                                                                       mesh_shape) for s in ins])
            t += (4 if redo else 2) * cm.collective_cost("all_to_all", n, i)
    return t


def _spec(local: torch.Tensor, placements: tuple, sizes: tuple[int, ...]) -> SimpleNamespace:
    """A DTensorSpec-like view of a local tensor: the global shape its placements give."""
    shape = list(local.shape)
    for i, p in enumerate(placements):
        if p.is_shard():
            shape[p.dim] *= sizes[i]
    return SimpleNamespace(tensor_meta=SimpleNamespace(shape=tuple(shape), dtype=local.dtype), placements=placements)


def step_region_us(cm: Any, node: Any) -> float | None:
    """µs of a region call in a rank's step graph (its op, or the tape body it became, whose
    backward does not run the forward again): `region_cost` of the option its layout names,
    on the node's local shapes. The op-by-op price sees only the call, not the local
    function's FLOPs: on the DeepSeek-V3 debug DDP plan the region calls were priced at 4 ms
    a step where their expert matmuls alone took about 45 (docs/measurements.md). None: not
    a region call."""
    from parallel.auto.regions.tape import region_call

    hit = region_call(node)
    if hit is None:
        return None
    r, backward, args, layout = hit
    vals = [a.meta.get("val") if hasattr(a, "meta") else a for a in args]
    outs = node.meta.get("val")
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if not all(isinstance(v, torch.Tensor) for v in vals + outs):
        return None
    axes = json.loads(layout)["axes"] if layout else []
    sizes, options = tuple(a[1] for a in axes), [r.option(a[4]) for a in axes]
    ins = []
    for k, v in enumerate(vals):
        j = k - r.n_outputs if backward else k
        ins.append(_spec(v, tuple(o.inputs[j] if j >= 0 else o.outputs[k] for o in options), sizes))
    out_pls = [tuple((o.grad_placements() if backward else o.outputs)[k] for o in options) for k in range(len(outs))]
    spec = SimpleNamespace(input_specs=ins, output_specs=tuple(_spec(v, p, sizes) for v, p in zip(outs, out_pls)))
    return _option_us(cm, r, backward, spec, sizes, kept=region_of(node.target) is None)
