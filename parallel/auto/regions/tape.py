"""A region's forward kept for its backward in a step graph, instead of recomputed.

A region's backward op recomputes the region's local function under autograd to get its
vjp (ops.py): the op pair is all a traced graph can hold, since the region's internals
(routed token counts, an all-to-all's splits) are data-dependent. In the plan's eager step
graph the pair runs in one Python call, though, so the forward can run under autograd
once and hand its graph to the backward, as the plain model's autograd does: the
DeepSeek-V3 debug step ran 48 expert matmuls more than torch's DDP on the same plan, each
MoE region's forward a second time (bench_auto_vs_manual --profile). A compiled step graph
breaks at the region calls (`use_region_tape(..., compiled=True)`): Inductor compiles the
pieces between them, the regions run eagerly, on the tape.

* `pair_region_calls`: each backward node with the forward node it undoes: the last
  forward of its region not yet undone, its inputs of the same layout (autograd's order;
  an activation-checkpointed recomputation of the forward pairs, not the original). The
  two nodes' layout strings differ, the backward's also placing the gradients, but they
  describe one option, so the forward's graph is the one the backward's recomputation
  would build;
* `RegionTape`: the replacement bodies of a paired forward (runs under autograd, keeps the
  graph, its saved inputs packed as references) and backward (uses it once, the inputs it
  is given standing in for the forward's; recomputes if none is kept);
* `taped_bytes`: what a kept forward holds until its backward (the memory estimate's
  figure), from the region's balanced-routing shape function on fake inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from parallel import _torch as T
from parallel.auto.regions.declaration import Region, backward_op, forward_op, lookup, region_of
from parallel.auto.regions.layout import check_outputs
from parallel.auto.regions.ops import _backward_impl, _run_local, _split, as_tuple, single, vjp

__all__ = ["RegionTape", "pair_region_calls", "region_call", "taped_bytes"]


def _same_layouts(a: Sequence[Any], b: Sequence[Any]) -> bool:
    va, vb = [x.meta.get("val") if isinstance(x, fx.Node) else x for x in a], \
        [x.meta.get("val") if isinstance(x, fx.Node) else x for x in b]
    return all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
               and x.dtype == y.dtype and x.stride() == y.stride() for x, y in zip(va, vb))


def pair_region_calls(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(forward node, backward node) of every region call whose backward is in the graph:
    the backward undoes the last forward of its region not yet undone (autograd's order),
    whose inputs have the same shapes, dtypes and strides."""
    open_calls: dict[str, list[fx.Node]] = {}
    pairs = []
    for n in gm.graph.nodes:
        hit = region_of(n.target) if n.op == "call_function" else None
        if hit is None:
            continue
        r, backward = hit
        calls = open_calls.setdefault(r.name, [])
        if not backward:
            calls.append(n)
        elif calls and _same_layouts(calls[-1].args[:r.n_inputs], n.args[r.n_outputs:r.n_outputs + r.n_inputs]):
            pairs.append((calls.pop(), n))
    return pairs


class _Inputs:
    """The saved tensors of a kept forward that are (views of) its inputs, packed as where
    they sit in which input, and unpacked from the inputs the backward is given (the same
    values: a parameter gathered again, an activation recomputed), so the tape holds only
    what the region made itself."""

    def __init__(self, leaves: list[torch.Tensor]):
        self.leaves = leaves
        self.given: Sequence[torch.Tensor] = ()

    def pack(self, t: torch.Tensor) -> Any:
        sid = T.storage_id(t)
        for i, leaf in enumerate(self.leaves):
            if T.storage_id(leaf) == sid and leaf.storage_offset() <= t.storage_offset() < \
                    leaf.storage_offset() + max(leaf.numel(), 1) * max(leaf.stride() or (1,)):
                return (i, tuple(t.shape), t.stride(), t.storage_offset() - leaf.storage_offset())
        return t

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        i, shape, stride, offset = packed
        given = self.given[i]
        return given.as_strided(shape, stride, given.storage_offset() + offset)

    def fit(self, given: Sequence[torch.Tensor]) -> bool:
        """Whether `given` can stand for the forward's inputs (same shapes and strides)."""
        return len(given) == len(self.leaves) and all(
            g.shape == x.shape and g.stride() == x.stride() and g.dtype == x.dtype for g, x in zip(given, self.leaves))


def _traced(xs: Sequence[Any]) -> bool:
    return T.active_tracer() is not None or any(T.is_fake(x) for x in xs if isinstance(x, torch.Tensor))


class RegionTape:
    """Forward graphs of region calls kept, slot by slot, from a forward node's run to its
    backward node's (one slot per pair of `pair_region_calls`)."""

    def __init__(self) -> None:
        self.kept: dict[int, tuple[_Inputs, tuple[torch.Tensor, ...]]] = {}
        self.recomputed = 0  # backward calls that found no kept forward

    def forward(self, slot: int, name: str, *xs: Any, layout: str = "") -> Any:
        xs, layout = _split(xs, layout)
        if _traced(xs):  # the graph traced again (a dry run on fake tensors): the op, whose fake body knows shapes
            return forward_op(name)(*xs, layout=layout)
        r = lookup(name)
        inputs = _Inputs([x.detach().requires_grad_(x.is_floating_point()) for x in xs])
        with T.autograd_enabled(), torch.autograd.graph.saved_tensors_hooks(inputs.pack, inputs.unpack):
            outs = _run_local(r, inputs.leaves, layout)
        if layout:
            check_outputs(r.name, outs, layout)
        self.kept[slot] = (inputs, outs)
        return single([(o.detach().clone() if any(o is x for x in inputs.leaves) else o.detach().contiguous())
                       for o in outs])

    def backward(self, slot: int, name: str, *xs: Any, layout: str = "") -> Any:
        xs, layout = _split(xs, layout)
        if _traced(xs):
            return backward_op(name)(*xs, layout=layout)
        r = lookup(name)
        kept = self.kept.pop(slot, None)
        given = xs[r.n_outputs:]
        if kept is None or not kept[0].fit(given):  # no forward kept (or not one of these inputs): recompute
            self.recomputed += 1
            return _backward_impl(name, *xs, layout=layout)
        inputs, outs = kept
        inputs.given = given
        return vjp(outs, inputs.leaves, xs[:r.n_outputs])


def use_region_tape(gm: fx.GraphModule, compiled: bool = False) -> RegionTape | None:
    """Rewrite the paired region calls of a step graph onto a new tape (None: the graph has
    none); the caller regenerates the code. `compiled`: the tape's calls are left out of
    torch.compile (`torch.compiler.disable`), so the graph compiles in pieces between them and
    each region runs eagerly, its forward kept, as in the eager graph."""
    pairs = pair_region_calls(gm)
    if not pairs:
        return None
    tape = RegionTape()
    forward, backward = tape.forward, tape.backward
    if compiled:
        forward, backward = torch.compiler.disable(forward), torch.compiler.disable(backward)
    for slot, (fwd, bwd) in enumerate(pairs):
        for n, body in ((fwd, forward), (bwd, backward)):
            r, _ = region_of(n.target)  # type: ignore[misc]
            n.target, n.args = body, (slot, r.name, *n.args)
    return tape


def region_call(n: fx.Node) -> tuple[Region, bool, list[Any], str] | None:
    """(region, is backward, tensor arguments, layout string) of a step graph's region call:
    the region's op, or the tape body `use_region_tape` rewrote it to; None for any other node."""
    if n.op != "call_function":
        return None
    hit = region_of(n.target)
    if hit is not None:
        args = tuple(n.args)
    else:
        body = getattr(n.target, "__wrapped__", n.target)  # torch.compiler.disable keeps the body here
        if not isinstance(getattr(body, "__self__", None), RegionTape) or len(n.args) < 2:
            return None
        hit = lookup(n.args[1]), body.__name__ == "backward"
        args = tuple(n.args[2:])
    args, layout = _split(args, n.kwargs.get("layout", ""))  # the layout may come positionally, as at run time
    return hit[0], hit[1], list(args), layout


def taped_bytes(fwd: fx.Node) -> int:
    """Bytes a kept forward of region node `fwd` holds until its backward: the tensors its
    autograd graph saves, from the region's shape function (balanced routing) run on meta
    tensors of the node's input shapes (as its pricing runs it; no device, no fake mode),
    less the inputs themselves (the graph holds those already)."""
    r, _ = region_of(fwd.target)  # type: ignore[misc]
    vals = [a.meta.get("val") for a in fwd.args[:r.n_inputs]]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return 0
    leaves = [torch.empty(tuple(v.shape), dtype=v.dtype, device="meta").requires_grad_(v.is_floating_point())
              for v in vals]
    inputs = {T.storage_id(x) for x in leaves}
    held: dict[Any, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        key = T.storage_id(t)
        if key not in inputs:
            held[key] = max(held.get(key, 0), t.untyped_storage().nbytes())
        return t

    with T.autograd_enabled(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        as_tuple(r.shape_fn()(*leaves))
    return sum(held.values())
