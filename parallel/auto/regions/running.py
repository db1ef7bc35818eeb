"""A planned region node run on this rank's shards (the runtime's interpreter calls it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from parallel.auto.regions.declaration import region_of
from parallel.auto.regions.layout import make_layout
from parallel.auto.regions.ops import as_tuple, single


def run_region(node: Any, args: Sequence[Any], spec: Any, mesh: Any, load_balance: int = 1) -> Any:
    """Run region node `node` on this rank's shards: `args` are its inputs already placed as
    `spec` wants (DTensors); returns DTensors with the planned output placements."""
    r, backward = region_of(node.target)  # type: ignore[misc]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    locs = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    vals = as_tuple(node.meta["val"])
    layout = make_layout(r, backward, spec, mesh, [tuple(v.shape) for v in vals], load_balance)
    out = as_tuple(node.target(*locs, layout=layout))
    specs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    res = [DTensor.from_local(o, mesh, sp.placements, run_check=False, shape=v.shape, stride=v.stride())
           for o, sp, v in zip(out, specs, vals)]
    return single(res)
