"""The price of one strategy of a region node: FLOPs of the region function on the local
shapes it computes on (gathered inputs whole along the gathered axes), plus its declared
gathers and all-to-alls."""

from __future__ import annotations

import functools
import math
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


def region_cost(cm: Any, node: Any, spec: Any, mesh_shape: tuple) -> float:
    """µs of one strategy of a region node: compute (roofline of the region function's FLOPs on
    the shapes it computes on) plus the gathers its options declare (the backward gathers
    again and reduce-scatters the gathered inputs' gradients) and all-to-alls (`exchange`,
    times the cost model's `routing_imbalance`)."""
    from parallel.auto.cost.compute import roofline_us

    r, backward = region_of(node.target)  # type: ignore[misc]
    ins = list(spec.input_specs)[r.n_outputs:] if backward else list(spec.input_specs)
    dtypes = tuple(s.tensor_meta.dtype for s in ins)
    shapes = _effective_shapes(r, backward, spec, mesh_shape)
    flops = region_flops(r.name, backward, tuple(shapes), dtypes)
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
            t += cm.collective_cost("all_gather", g, i)
            if backward:
                t += cm.collective_cost("reduce_scatter", g, i)
        if o.exchange is not None:
            n = item * cm.routing_imbalance * o.exchange([local_shape(tuple(s.tensor_meta.shape), s.placements,
                                                                       mesh_shape) for s in ins])
            t += (4 if backward else 2) * cm.collective_cost("all_to_all", n, i)
    return t
