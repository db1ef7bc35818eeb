"""local_map contracts: a region of the model the planner treats as one black-box node.

A region is a function of tensors (attention, MoE dispatch) whose placements its author
declares per mesh axis, as `torch.distributed.tensor.experimental.local_map` does: each
`Option` says how every input and output is placed on ONE mesh axis when the region runs
that way, and which inputs the region all-gathers over that axis inside itself. On a
D-axis mesh a strategy picks one option per axis (Replicate on every tensor is always
among them). Outside the planner the region is plain model code and runs unchanged.

How the pieces meet (no stage needs a special case beyond pricing and running):

* `declare(contract)` defines two torch.library custom ops, ``autotitan::<name>`` and its
  backward ``autotitan::<name>_bwd`` (recomputes the region's vjp on local shards), and
  registers a DTensor single-dim strategy for each that lists the declared options, so
  the joint graph holds one forward and one backward node per region call and
  enumeration finds their strategies with DTensor's own machinery;
* tracing (`traced_regions`) routes the region's calls to the forward op;
* `region_cost` prices a strategy: FLOPs of the region function on the local shapes it
  computes on (gathered inputs whole along the gathered axes) plus its declared gathers;
* `run_region` runs a node on local shards: the op gets a layout string (per mesh axis the
  chosen option, this rank's coordinate and the axis's process-group name) and its real
  implementation calls the contract's local function, then checks each output's local
  shape against the declared placements (`ContractError` names region, axis, placements).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.utils.flop_counter import FlopCounterMode

from parallel import _torch as T
from parallel.auto.placements import local_shape, parse_placements, placement_str

NAMESPACE = "autotitan"
MARKER = "contract_region"
"""Class attribute a model module sets to the name of the region its forward is (models
import only torch); the planner swaps that forward for the region's op while tracing."""


class ContractError(ValueError):
    """A region's declaration or its local function's behaviour is wrong."""


@dataclass(frozen=True)
class Option:
    """One way to run a region on ONE mesh axis.

    inputs / outputs: a placement per tensor input / output; grads: per input, the placement
    of its gradient (default: as the input); gather: inputs the region all-gathers along
    their sharded dim over this axis inside itself (forward; the backward gathers them again
    and reduce-scatters their gradients), priced as such; exchange: the elements one rank
    sends all-to-all over this axis, from the local input shapes (MoE token dispatch), priced
    there and back (dispatch + combine), twice that with the backward.
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
class Contract:
    """A region: its name, its options, its plain function `fn(*tensors)` (global semantics;
    also gives the output shapes on local shards; the decorated function with `region`),
    and optionally `local_fn(ctx, *local
    tensors)` run on shards with a `RegionContext` (default: `fn` on the shards); `meta_fn`:
    `fn`'s stand-in on fake/meta tensors, same output shapes and the FLOPs to price, for a
    region whose function needs data (MoE: routing counts; default `fn`)."""

    name: str
    options: Sequence[Option]
    fn: Callable[..., Any] | None = None
    local_fn: Callable[..., Any] | None = None
    meta_fn: Callable[..., Any] | None = None
    n_inputs: int = field(init=False)
    n_outputs: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ContractError(f"region name {self.name!r}: use a Python identifier (it names a torch op)")
        self.options = tuple(self.options)
        self.n_inputs = len(self.options[0].inputs) if self.options else 0
        self.n_outputs = len(self.options[0].outputs) if self.options else 0
        for o in self.options:
            if len(o.inputs) != self.n_inputs or len(o.outputs) != self.n_outputs:
                raise ContractError(f"region {self.name!r}: option {o.name!r} declares {len(o.inputs)} inputs and "
                                    f"{len(o.outputs)} outputs, the first option {self.n_inputs} and "
                                    f"{self.n_outputs}; every option places every tensor")
        if not self.options or self.n_inputs == 0 or self.n_outputs == 0:
            raise ContractError(f"region {self.name!r}: declare at least one option with tensor inputs and outputs")

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


REPLICATED = "replicated"


@dataclass(frozen=True)
class AxisLayout:
    """One mesh axis as a region's local function sees it."""

    name: str
    size: int
    rank: int  # this rank's coordinate on the axis
    group: str  # process-group name (functional collectives take it)
    option: str


@dataclass(frozen=True)
class RegionContext:
    """What the local function knows: the chosen option per mesh axis, and the order of the
    sequence the inputs follow (`load_balance`: the load-balanced CP order for that many
    ranks, 1 = natural order; see parallel/recipes/cp.py)."""

    region: str
    axes: tuple[AxisLayout, ...] = ()
    load_balance: int = 1

    def axes_with(self, option: str) -> tuple[AxisLayout, ...]:
        """The mesh axes (in mesh order) this rank runs `option` on."""
        return tuple(a for a in self.axes if a.option == option)


# ---------------------------------------------------------------------------- registry
_contracts: dict[str, Contract] = {}
_ops: dict[Any, tuple[Contract, bool]] = {}  # OpOverload -> (contract, is backward)
_lock = threading.Lock()
_lib: Any = None


def declared() -> dict[str, Contract]:
    """Region name -> contract, every region declared in this process."""
    return dict(_contracts)


def declare(contract: Contract) -> Contract:
    """Declare a region (idempotent by name: a new declaration replaces the options and
    functions; the ops are defined once)."""
    with _lock:
        old = _contracts.get(contract.name)
        if old is not None and (old.n_inputs, old.n_outputs) != (contract.n_inputs, contract.n_outputs):
            raise ContractError(f"region {contract.name!r} is already declared with {old.n_inputs} inputs and "
                                f"{old.n_outputs} outputs; choose another name")
        _contracts[contract.name] = contract
        if old is None:
            _define_ops(contract)
        T.clear_sharding_caches()
    return contract


def forward_op(name: str) -> Any:
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def backward_op(name: str) -> Any:
    return getattr(getattr(torch.ops, NAMESPACE), f"{name}_bwd").default


def region_of(target: Any) -> tuple[Contract, bool] | None:
    """(contract, is backward) of a region op, else None."""
    hit = _ops.get(target)
    if hit is None:
        return None
    return _contracts[hit[0].name], hit[1]


def _define_ops(c: Contract) -> None:
    global _lib
    if _lib is None:
        _lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    ins = ", ".join(f"Tensor x{i}" for i in range(c.n_inputs))
    outs = "Tensor" if c.n_outputs == 1 else "(" + ", ".join(["Tensor"] * c.n_outputs) + ")"
    g_ins = ", ".join([f"Tensor g{i}" for i in range(c.n_outputs)] + [f"Tensor x{i}" for i in range(c.n_inputs)])
    g_outs = "Tensor" if c.n_inputs == 1 else "(" + ", ".join(["Tensor"] * c.n_inputs) + ")"
    _lib.define(f"{c.name}({ins}, str layout='') -> {outs}")
    _lib.define(f"{c.name}_bwd({g_ins}, str layout='') -> {g_outs}")
    name = c.name
    _lib.impl(name, functools.partial(_forward_impl, name), "CompositeExplicitAutograd")
    _lib.impl(f"{name}_bwd", functools.partial(_backward_impl, name), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", functools.partial(_forward_fake, name), lib=_lib)
    torch.library.register_fake(f"{NAMESPACE}::{name}_bwd", functools.partial(_backward_fake, name), lib=_lib)
    torch.library.register_autograd(f"{NAMESPACE}::{name}", functools.partial(_autograd_backward, name),
                                    setup_context=_setup_context, lib=_lib)
    fwd, bwd = forward_op(name), backward_op(name)
    _ops[fwd], _ops[bwd] = (c, False), (c, True)
    T.register_region_strategy(fwd, functools.partial(_strategy_rule, name, False), static_argnum=c.n_inputs)
    T.register_region_strategy(bwd, functools.partial(_strategy_rule, name, True),
                               static_argnum=c.n_inputs + c.n_outputs)


def _strategy_rule(name: str, backward: bool, op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
    """The declared options as DTensor single-dim strategies: [outputs..., inputs...]."""
    rows = []
    for o in _contracts[name].options:
        if backward:
            rows.append([*o.grad_placements(), *o.outputs, *o.inputs])
        else:
            rows.append([*o.outputs, *o.inputs])
    return rows


# ---------------------------------------------------------------------------- op bodies
def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _single(xs: Sequence[torch.Tensor]) -> Any:
    return xs[0] if len(xs) == 1 else tuple(xs)


def _split(xs: tuple, layout: str) -> tuple[tuple, str]:
    """(tensors, layout): the dispatcher may pass the layout positionally."""
    if xs and isinstance(xs[-1], str):
        return xs[:-1], xs[-1]
    return xs, layout


def _forward_fake(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    xs, layout = _split(xs, layout)
    c = _contracts[name]
    outs = _as_tuple(c.shape_fn()(*xs))
    return _single([o.new_empty(o.shape) for o in outs])  # contiguous, as the real kernel returns


def _backward_fake(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    xs, layout = _split(xs, layout)
    c = _contracts[name]
    return _single([x.new_empty(x.shape) for x in xs[c.n_outputs:]])


def _run_local(c: Contract, xs: Sequence[torch.Tensor], layout: str) -> tuple[torch.Tensor, ...]:
    if not layout or c.local_fn is None:
        return _as_tuple(c.fn(*xs))
    return _as_tuple(c.local_fn(context_from(layout), *xs))


def _forward_impl(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    xs, layout = _split(xs, layout)
    c = _contracts[name]
    with torch.no_grad():
        outs = _run_local(c, xs, layout)
    if layout:
        check_outputs(c.name, outs, layout)
    return _single([o.clone() if any(o is x for x in xs) else o.contiguous() for o in outs])


def _backward_impl(name: str, *xs: torch.Tensor, layout: str = "") -> Any:
    """The region's vjp on local shards: recompute the local function under autograd (its
    collectives are differentiable: a gather's gradient is a reduce-scatter). Compiled
    graphs call the op below the autograd dispatch keys: they are re-enabled here."""
    xs, layout = _split(xs, layout)
    c = _contracts[name]
    grads_out, ins = xs[:c.n_outputs], xs[c.n_outputs:]
    with T.autograd_enabled():
        leaves = [(x.clone() if x.is_inference() else x.detach()).requires_grad_(x.is_floating_point()) for x in ins]
        outs = _run_local(c, leaves, layout)
        pairs = [(o, g) for o, g in zip(outs, grads_out) if o.requires_grad]
        wrt = [x for x in leaves if x.requires_grad]
        got = list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                   if pairs else [None] * len(wrt))
    res = []
    for x in leaves:
        g = got.pop(0) if x.requires_grad else None
        res.append(torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g.detach().contiguous())
    return _single(res)


def run_kernel(target: Any, *args: Any, **kwargs: Any) -> Any:
    """A region op's real kernel called directly, not through the dispatcher (so a dispatch
    mode that intercepts the op can still see the ops inside, e.g. a memory tracker)."""
    c, backward = region_of(target)  # type: ignore[misc]
    return (_backward_impl if backward else _forward_impl)(c.name, *args, **kwargs)


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    *xs, layout = inputs if len(inputs) and isinstance(inputs[-1], str) else (*inputs, "")
    ctx.save_for_backward(*xs)
    ctx.layout = layout


def _autograd_backward(name: str, ctx: Any, *grads: torch.Tensor) -> tuple:
    xs = ctx.saved_tensors
    out = backward_op(name)(*grads, *xs, layout=ctx.layout)
    return (*_as_tuple(out), None)


# ---------------------------------------------------------------------------- tracing
_tracing = threading.local()


def call_region(name: str, *xs: torch.Tensor) -> Any:
    """Call region `name` as its op (while the planner traces) or as its plain function."""
    c = _contracts[name]
    if getattr(_tracing, "active", False):
        return forward_op(name)(*xs)
    return c.fn(*xs)


def region(contract: Contract) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: declare `contract` for the decorated function (its `fn` when none is given)
    and make the function one region node when the planner traces it; eager calls run it."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if contract.fn is None:
            contract.fn = fn
        declare(contract)

        @functools.wraps(fn)
        def call(*xs: torch.Tensor) -> Any:
            return call_region(contract.name, *xs)

        return call

    return wrap


@contextlib.contextmanager
def traced_regions(model: nn.Module, enabled: Sequence[str] = ()) -> Iterator[list[str]]:
    """While tracing: declared regions (decorated functions) become their ops, and so do the
    forwards of `model`'s modules marked with `contract_region` = one of `enabled`. Yields
    the list the region names met are appended to (once each)."""
    met: list[str] = []
    patched = []
    for mod in model.modules():
        name = getattr(type(mod), MARKER, None)
        if name in enabled:
            if name not in _contracts:
                raise ContractError(f"region {name!r} (module {type(mod).__name__}) is not declared; "
                                    f"declare it with parallel.auto.contracts.declare")
            mod.forward = functools.partial(call_region, name)
            patched.append(mod)
    prev = getattr(_tracing, "active", False)
    _tracing.active = True
    try:
        yield met
    finally:
        _tracing.active = prev
        for mod in patched:
            del mod.forward


def marked_regions(model: nn.Module) -> tuple[str, ...]:
    """The declared regions `model`'s modules are marked with (`contract_region`), in module
    order: what to pass as AutoParallel's `regions` to plan them as regions."""
    out: list[str] = []
    for mod in model.modules():
        name = getattr(type(mod), MARKER, None)
        if name in _contracts and name not in out:
            out.append(name)
    return tuple(out)


def regions_in(gm: Any) -> list[str]:
    """Names of the regions whose forward op appears in a traced graph (first-use order)."""
    out: list[str] = []
    for n in gm.graph.nodes:
        hit = region_of(n.target) if n.op == "call_function" else None
        if hit is not None and not hit[1] and hit[0].name not in out:
            out.append(hit[0].name)
    return out


# ---------------------------------------------------------------------------- layout + checks
def _axis_options(c: Contract, backward: bool, spec: Any) -> list[Option]:
    """The option each mesh axis runs, read off a strategy's input placements."""
    ins = [s.placements for s in spec.input_specs]
    ins = ins[c.n_outputs:] if backward else ins
    chosen = []
    for i in range(len(ins[0]) if ins else 0):
        axis = tuple(p[i] for p in ins)
        hit = next((o for o in c.all_options() if tuple(o.inputs) == axis), None)
        if hit is None:
            raise ContractError(f"region {c.name!r}: mesh axis {i} places the inputs {axis}, which no declared "
                                "option does")
        chosen.append(hit)
    return chosen


def make_layout(c: Contract, backward: bool, spec: Any, mesh: Any, out_shapes: Sequence[tuple[int, ...]],
                load_balance: int = 1) -> str:
    """The layout string a region op gets at run time (see the module docstring)."""
    names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
    opts = _axis_options(c, backward, spec)
    outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    return json.dumps({
        "region": c.name, "lb": load_balance,
        "axes": [[names[i], mesh.size(i), mesh.get_local_rank(i), mesh.get_group(i).group_name, o.name]
                 for i, o in enumerate(opts)],
        "outs": [[list(s), placement_str(o.placements)] for s, o in zip(out_shapes, outs)],
    })


def option_names(target: str, input_placements: Sequence[str]) -> list[str] | None:
    """Per mesh axis, the option a planned region node runs (`target` as a plan writes it,
    e.g. "autotitan.moe_dispatch.default"; its inputs' placements); None if not a region."""
    parts = target.split(".")
    name = parts[1].removesuffix("_bwd") if len(parts) > 1 else ""
    if parts[0] != NAMESPACE or name not in _contracts:
        return None
    c, pls = _contracts[name], [parse_placements(p) for p in input_placements]
    pls = pls[c.n_outputs:] if parts[1].endswith("_bwd") else pls
    out = []
    for i in range(len(pls[0]) if pls else 0):
        axis = tuple(p[i] for p in pls)
        out.append(next((o.name for o in c.all_options() if tuple(o.inputs) == axis), "?"))
    return out


def context_from(layout: str) -> RegionContext:
    d = json.loads(layout)
    return RegionContext(d["region"], tuple(AxisLayout(*a) for a in d["axes"]), int(d.get("lb", 1)))


def _explain(shape: tuple, declared: tuple, got: tuple, mesh_shape: tuple) -> tuple[int, str] | None:
    """(mesh axis, placement) that would give `got` if only that axis's placement differed."""
    for i in range(len(declared)):
        for alt in [Replicate(), *[Shard(d) for d in range(len(shape))]]:
            trial = declared[:i] + (alt,) + declared[i + 1:]
            if alt != declared[i] and local_shape(shape, trial, mesh_shape) == got:
                return i, placement_str((alt,))[1:-1]
    return None


def check_outputs(name: str, outs: Sequence[torch.Tensor], layout: str) -> None:
    """Each output's local shape must be what its declared placements give (first step)."""
    d = json.loads(layout)
    axes, mesh_shape = d["axes"], tuple(a[1] for a in d["axes"])
    for k, (o, (shape, pl)) in enumerate(zip(outs, d["outs"])):
        declared = parse_placements(pl)
        want, got = local_shape(tuple(shape), declared, mesh_shape), tuple(o.shape)
        if got == want:
            continue
        why = _explain(tuple(shape), declared, got, mesh_shape)
        if why is not None:
            i, actual = why
            raise ContractError(
                f"local_map region {name!r}: output {k} on mesh axis {i} ({axes[i][0]!r}, option {axes[i][4]!r}) "
                f"is declared {placement_str((declared[i],))[1:-1]} but the local function returned a "
                f"{actual} shard (local shape {got}, declared {want} of global {tuple(shape)}); make the "
                "option's output placement match what the local function returns")
        raise ContractError(f"local_map region {name!r}: output {k} has local shape {got}, but its declared "
                            f"placements {pl} give {want} (global {tuple(shape)}); fix the option or the local "
                            "function")


# ---------------------------------------------------------------------------- running
def run_region(node: Any, args: Sequence[Any], spec: Any, mesh: Any, load_balance: int = 1) -> Any:
    """Run region node `node` on this rank's shards: `args` are its inputs already placed as
    `spec` wants (DTensors); returns DTensors with the planned output placements."""
    c, backward = region_of(node.target)  # type: ignore[misc]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    locs = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    vals = _as_tuple(node.meta["val"])
    layout = make_layout(c, backward, spec, mesh, [tuple(v.shape) for v in vals], load_balance)
    out = _as_tuple(node.target(*locs, layout=layout))
    specs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    res = [DTensor.from_local(o, mesh, sp.placements, run_check=False, shape=v.shape, stride=v.stride())
           for o, sp, v in zip(out, specs, vals)]
    return _single(res)


# ---------------------------------------------------------------------------- pricing
def _effective_shapes(c: Contract, backward: bool, spec: Any, mesh_shape: tuple) -> list[tuple[int, ...]]:
    """Local shapes the region function computes on: inputs' shards, whole along the axes
    whose option gathers them."""
    ins = list(spec.input_specs)[c.n_outputs:] if backward else list(spec.input_specs)
    opts = _axis_options(c, backward, spec)
    shapes = []
    for k, s in enumerate(ins):
        pl = tuple(Replicate() if k in opts[i].gather else p for i, p in enumerate(s.placements))
        shapes.append(local_shape(tuple(s.tensor_meta.shape), pl, mesh_shape))
    return shapes


@functools.lru_cache(maxsize=4096)
def _region_flops(name: str, backward: bool, shapes: tuple, dtypes: tuple) -> float:
    """FLOPs of the region function on meta tensors of `shapes` (backward: recompute + vjp)."""
    xs = [torch.empty(s, dtype=d, device="meta", requires_grad=backward and d.is_floating_point)
          for s, d in zip(shapes, dtypes)]
    with FlopCounterMode(display=False) as fc:
        outs = _as_tuple(_contracts[name].shape_fn()(*xs))
        if backward:
            outs = [o for o in outs if o.requires_grad]
            torch.autograd.grad(outs, [x for x in xs if x.requires_grad], [torch.ones_like(o) for o in outs],
                                allow_unused=True)
    return float(fc.get_total_flops())


def region_cost(cm: Any, node: Any, spec: Any, mesh_shape: tuple) -> float:
    """µs of one strategy of a region node: compute (roofline of the region function's FLOPs on
    the shapes it computes on) plus the gathers its options declare (the backward gathers
    again and reduce-scatters the gathered inputs' gradients) and all-to-alls (`exchange`)."""
    from parallel.auto.cost.compute import roofline_us

    c, backward = region_of(node.target)  # type: ignore[misc]
    ins = list(spec.input_specs)[c.n_outputs:] if backward else list(spec.input_specs)
    dtypes = tuple(s.tensor_meta.dtype for s in ins)
    shapes = _effective_shapes(c, backward, spec, mesh_shape)
    flops = _region_flops(c.name, backward, tuple(shapes), dtypes)
    cdt = getattr(cm, "compute_dtype", None) or dtypes[0]
    item = cdt.itemsize if cdt.is_floating_point else dtypes[0].itemsize
    outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
    nbytes = item * (sum(math.prod(s) for s in shapes)
                     + sum(math.prod(local_shape(tuple(o.tensor_meta.shape), o.placements, mesh_shape)) for o in outs))
    t = roofline_us(cm.hw, flops, nbytes, cdt)
    for i, o in enumerate(_axis_options(c, backward, spec)):
        for k in o.gather:
            g = item * math.prod(local_shape(tuple(ins[k].tensor_meta.shape), ins[k].placements, mesh_shape,
                                             skip_axis=i))
            t += cm.collective_cost("all_gather", g, i)
            if backward:
                t += cm.collective_cost("reduce_scatter", g, i)
        if o.exchange is not None:
            n = item * o.exchange([local_shape(tuple(s.tensor_meta.shape), s.placements, mesh_shape) for s in ins])
            t += (4 if backward else 2) * cm.collective_cost("all_to_all", n, i)
    return t

