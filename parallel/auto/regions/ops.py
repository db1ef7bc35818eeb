"""A region as torch ops: `declare` defines ``autotitan::<name>`` and its backward
``autotitan::<name>_bwd`` (recomputes the region's vjp on local shards), their fake, real
and autograd bodies, and a DTensor single-dim strategy for each that lists the declared
options, so the joint graph holds one forward and one backward node per region call and
enumeration finds their strategies with DTensor's own machinery. The real body calls the
region's local function with the `RegionContext` its layout string describes, then checks
each output's local shape against the declared placements (layout.py).

`call_region` calls a region as its op while the planner traces (tracing.py switches that
on) and as its plain function otherwise; `region` is the decorator form.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from parallel import _torch as T
from parallel.auto.regions.declaration import (
    NAMESPACE,
    Region,
    RegionError,
    backward_op,
    declared,
    forward_op,
    lock,
    lookup,
    region_of,
    store,
    store_ops,
)
from parallel.auto.regions.layout import check_outputs, context_from

_lib: Any = None
tracing = threading.local()
"""`tracing.active`: region calls become their ops (set by tracing.traced_regions)."""


def declare(region: Region) -> Region:
    """Declare a region (idempotent by name: a new declaration replaces the options and
    functions; the ops are defined once)."""
    with lock:
        old = declared().get(region.name)
        if old is not None and (old.n_inputs, old.n_outputs) != (region.n_inputs, region.n_outputs):
            raise RegionError(f"region {region.name!r} is already declared with {old.n_inputs} inputs and "
                              f"{old.n_outputs} outputs; choose another name")
        store(region)
        if old is None:
            _define_ops(region)
        T.clear_sharding_caches()
    return region


def _define_ops(r: Region) -> None:
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    ins = ", ".join(f"Tensor x{i}" for i in range(r.n_inputs))
    outs = "Tensor" if r.n_outputs == 1 else "(" + ", ".join(["Tensor"] * r.n_outputs) + ")"
    g_ins = ", ".join([f"Tensor g{i}" for i in range(r.n_outputs)] + [f"Tensor x{i}" for i in range(r.n_inputs)])
    g_outs = "Tensor" if r.n_inputs == 1 else "(" + ", ".join(["Tensor"] * r.n_inputs) + ")"
    _lib.define(f"{r.name}({ins}, str layout='') -> {outs}")
    _lib.define(f"{r.name}_bwd({g_ins}, str layout='') -> {g_outs}")
    name = r.name
    _lib.impl(name, functools.partial(_forward_impl, name), "CompositeExplicitAutograd")
    _lib.impl(f"{name}_bwd", functools.partial(_backward_impl, name), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", functools.partial(_forward_fake, name), lib=_lib)
    torch.library.register_fake(f"{NAMESPACE}::{name}_bwd", functools.partial(_backward_fake, name), lib=_lib)
    torch.library.register_autograd(f"{NAMESPACE}::{name}", functools.partial(_autograd_backward, name),
                                    setup_context=_setup_context, lib=_lib)
    store_ops(r)
    T.register_region_strategy(forward_op(name), functools.partial(_strategy_rule, name, False),
                               static_argnum=r.n_inputs)
    T.register_region_strategy(backward_op(name), functools.partial(_strategy_rule, name, True),
                               static_argnum=r.n_inputs + r.n_outputs)


def _strategy_rule(name: str, backward: bool, op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
    """The declared options as DTensor single-dim strategies: [outputs..., inputs...]."""
    rows = []
    for o in lookup(name).options:
        if backward:
            rows.append([*o.grad_placements(), *o.outputs, *o.inputs])
        else:
            rows.append([*o.outputs, *o.inputs])
    return rows


# ---------------------------------------------------------------------------- op bodies
def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def single(xs: Sequence[torch.Tensor]) -> Any:
    return xs[0] if len(xs) == 1 else tuple(xs)


def _split(xs: tuple, layout: str) -> tuple[tuple, str]:
    """(tensors, layout): the dispatcher may pass the layout positionally."""
    if xs and isinstance(xs[-1], str):
        return xs[:-1], xs[-1]
    return xs, layout


def _forward_fake(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    xs, layout = _split(xs, layout)
    outs = as_tuple(lookup(name).shape_fn()(*xs))
    return single([o.new_empty(o.shape) for o in outs])  # contiguous, as the real kernel returns


def _backward_fake(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    xs, layout = _split(xs, layout)
    return single([x.new_empty(x.shape) for x in xs[lookup(name).n_outputs:]])


def _run_local(r: Region, xs: Sequence[torch.Tensor], layout: str) -> tuple[torch.Tensor, ...]:
    if not layout or r.local_fn is None:
        return as_tuple(r.fn(*xs))
    return as_tuple(r.local_fn(context_from(layout), *xs))


def _forward_impl(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    xs, layout = _split(xs, layout)
    r = lookup(name)
    with torch.no_grad():
        outs = _run_local(r, xs, layout)
    if layout:
        check_outputs(r.name, outs, layout)
    return single([o.clone() if any(o is x for x in xs) else o.contiguous() for o in outs])


def _backward_impl(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    """The region's vjp on local shards: recompute the local function under autograd (its
    collectives are differentiable: a gather's gradient is a reduce-scatter). Compiled
    graphs call the op below the autograd dispatch keys: they are re-enabled here."""
    xs, layout = _split(xs, layout)
    r = lookup(name)
    grads_out, ins = xs[:r.n_outputs], xs[r.n_outputs:]
    with T.autograd_enabled():
        leaves = [(x.clone() if x.is_inference() else x.detach()).requires_grad_(x.is_floating_point()) for x in ins]
        outs = _run_local(r, leaves, layout)
    return vjp(outs, leaves, grads_out)


def vjp(outs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], grads_out: Sequence[torch.Tensor]) -> Any:
    """The gradient of every leaf (zeros where none flows, an input that needs none
    included) from a region's outputs run under autograd and their gradients."""
    pairs = [(o, g) for o, g in zip(outs, grads_out) if o.requires_grad]
    wrt = [x for x in leaves if x.requires_grad]
    with T.autograd_enabled():
        got = list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                   if pairs else [None] * len(wrt))
    res = []
    for x in leaves:
        g = got.pop(0) if x.requires_grad else None
        res.append(torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g.detach().contiguous())
    return single(res)


def run_kernel(target: Any, *args: Any, **kwargs: Any) -> Any:
    """A region op's real kernel called directly, not through the dispatcher (so a dispatch
    mode that intercepts the op can still see the ops inside, e.g. a memory tracker)."""
    r, backward = region_of(target)  # type: ignore[misc]
    return (_backward_impl if backward else _forward_impl)(r.name, *args, **kwargs)


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    *xs, layout = inputs if len(inputs) and isinstance(inputs[-1], str) else (*inputs, "")
    ctx.save_for_backward(*xs)
    ctx.layout = layout


def _autograd_backward(name: str, ctx: Any, *grads: torch.Tensor) -> tuple:
    xs = ctx.saved_tensors
    out = backward_op(name)(*grads, *xs, layout=ctx.layout)
    return (*as_tuple(out), None)


# ---------------------------------------------------------------------------- calling
def call_region(name: str, *xs: torch.Tensor) -> Any:
    """Call region `name` as its op (while the planner traces) or as its plain function."""
    r = lookup(name)
    if getattr(tracing, "active", False):
        return forward_op(name)(*xs)
    return r.fn(*xs)


def region(spec: Region) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: declare region `spec` for the decorated function (its `fn` when none is
    given) and make the function one region node when the planner traces it; eager calls run it."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if spec.fn is None:
            spec.fn = fn
        declare(spec)

        @functools.wraps(fn)
        def call(*xs: torch.Tensor) -> Any:
            return call_region(spec.name, *xs)

        return call

    return wrap
