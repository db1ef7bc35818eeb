"""A region's declaration and the registry of declared regions.

A region is a function of tensors (attention, MoE dispatch) whose placements its author
declares per mesh axis, as `torch.distributed.tensor.experimental.local_map` does: each
`Option` says how every input and output is placed on ONE mesh axis when the region runs
that way, and which inputs the region all-gathers over that axis inside itself. On a
D-axis mesh a strategy picks one option per axis (Replicate on every tensor is always
among them). Outside the planner the region is plain model code and runs unchanged.

This module holds the data only: `Region`, `Option`, and the registry (name -> region,
op -> region) that `ops.declare` fills.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate

NAMESPACE = "autotitan"
MARKER = "local_map_region"
"""Class attribute a model module sets to the name of the region its forward is (models
import only torch); the planner swaps that forward for the region's op while tracing."""
REPLICATED = "replicated"


class RegionError(ValueError):
    """A region's declaration or its local function's behaviour is wrong."""


@dataclass(frozen=True)
class Option:
    """One way to run a region on ONE mesh axis.

    inputs / outputs: a placement per tensor input / output; grads: per input, the placement
    of its gradient (default: as the input); gather: inputs the region all-gathers along
    their sharded dim over this axis inside itself (forward; the backward gathers them again
    and reduce-scatters their gradients), priced as such; exchange: the elements one rank
    sends all-to-all over this axis under balanced routing, from the local input shapes (MoE
    token dispatch), priced there and back (dispatch + combine), twice that with the backward,
    times the cost model's `routing_imbalance`.
    """

    name: str
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    gather: tuple[int, ...] = ()
    grads: tuple[Placement, ...] | None = None
    exchange: Callable[[Sequence[tuple[int, ...]]], float] | None = None

    def grad_placements(self) -> tuple[Placement, ...]:
        return self.grads if self.grads is not None else self.inputs


@dataclass
class Region:
    """A region: its name, its options, its plain function `fn(*tensors)` (global semantics;
    also gives the output shapes on local shards; the decorated function with `region`),
    and optionally `local_fn(ctx, *local tensors)` run on shards with a `RegionContext`
    (default: `fn` on the shards); `meta_fn`: `fn`'s stand-in on fake/meta tensors, same
    output shapes and the FLOPs to price, for a region whose function needs data (MoE:
    routing counts; default `fn`)."""

    name: str
    options: Sequence[Option]
    fn: Callable[..., Any] | None = None
    local_fn: Callable[..., Any] | None = None
    meta_fn: Callable[..., Any] | None = None
    n_inputs: int = field(init=False)
    n_outputs: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise RegionError(f"region name {self.name!r}: use a Python identifier (it names a torch op)")
        self.options = tuple(self.options)
        self.n_inputs = len(self.options[0].inputs) if self.options else 0
        self.n_outputs = len(self.options[0].outputs) if self.options else 0
        for o in self.options:
            if len(o.inputs) != self.n_inputs or len(o.outputs) != self.n_outputs:
                raise RegionError(f"region {self.name!r}: option {o.name!r} declares {len(o.inputs)} inputs and "
                                  f"{len(o.outputs)} outputs, the first option {self.n_inputs} and "
                                  f"{self.n_outputs}; every option places every tensor")
        if not self.options or self.n_inputs == 0 or self.n_outputs == 0:
            raise RegionError(f"region {self.name!r}: declare at least one option with tensor inputs and outputs")

    def option(self, name: str) -> Option:
        if name == REPLICATED:
            return self.replicated()
        return next(o for o in self.options if o.name == name)

    def replicated(self) -> Option:
        rep = Replicate()
        return Option(REPLICATED, (rep,) * self.n_inputs, (rep,) * self.n_outputs)

    def all_options(self) -> tuple[Option, ...]:
        return (self.replicated(), *self.options)

    def shape_fn(self) -> Callable[..., Any]:
        """The function to run on fake or meta tensors."""
        return self.meta_fn or self.fn  # type: ignore[return-value]


# ---------------------------------------------------------------------------- registry
_regions: dict[str, Region] = {}
_ops: dict[Any, tuple[Region, bool]] = {}  # OpOverload -> (region, is backward)
lock = threading.Lock()


def declared() -> dict[str, Region]:
    """Region name -> region, every region declared in this process."""
    return dict(_regions)


def lookup(name: str) -> Region:
    """The region declared as `name` (KeyError if none)."""
    return _regions[name]


def store(region: Region) -> None:
    """Record `region` under its name (`ops.declare` holds `lock`)."""
    _regions[region.name] = region


def store_ops(region: Region) -> None:
    """Record the region's forward and backward ops (defined once per name)."""
    _ops[forward_op(region.name)], _ops[backward_op(region.name)] = (region, False), (region, True)


def forward_op(name: str) -> Any:
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def backward_op(name: str) -> Any:
    return getattr(getattr(torch.ops, NAMESPACE), f"{name}_bwd").default


def region_of(target: Any) -> tuple[Region, bool] | None:
    """(region, is backward) of a region op, else None."""
    hit = _ops.get(target)
    if hit is None:
        return None
    return _regions[hit[0].name], hit[1]
