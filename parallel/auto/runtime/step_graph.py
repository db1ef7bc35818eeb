"""The whole training step of a plan as ONE per-device graph: forward, loss and backward.

`StepGraph` traces the plan runner's forward and backward phases together (`make_fx`,
fake tensors, this rank's local shapes) into a single graph of plain ATen ops and
functional collectives: `(param locals, buffer locals, input locals) -> (output locals,
gradient locals)` with the loss's tangent fixed to one. On that graph:

  * `loss_sync.loss_off_the_critical_path` counts the mean loss's tokens from the labels at
    the start and seeds the backward without the loss's all-reduce, so no barrier of the
    ranks stands between forward and backward;
  * `schedule.schedule_overlap` moves collective starts early and waits late (overlap);
  * each region's forward is kept for its backward instead of run again (regions/tape.py),
    eager or compiled (there the graph breaks at each region call, which runs eagerly);
  * `torch.compile` (Inductor) compiles it once per input layout; Inductor's own cache
    makes a second run of the same shapes skip the codegen;
  * or it runs as it is (eager: FX's Python code, values freed after their last use), with
    two more rewrites of what autograd's engine and DDP do anyway: sums of gradient
    contributions written into a summand nothing else reads (`reinplace_adds`) and a
    gradient bucket all-reduced in place (`reduce_buffers_in_place`).

Activation checkpointing is already in the graph: the runner's partition recomputes the
tagged forward ops inside the backward part.

One trace per plan: the memory estimate (runtime/memory.py) traces this graph on fake
tensors of the same local layout the first training step has, so the planner hands it to
the ParallelModule (`step_key` says whether a call's layout is the one it was traced for;
`make_executable` regenerates its code, the one thing an analysis-only graph skips).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from parallel import _torch as T
from parallel.auto.regions.tape import RegionTape, use_region_tape
from parallel.auto.runtime.local_graphs import dspec, local_value, wrap
from parallel.auto.runtime.loss_sync import WHOLE_VIEWS, loss_off_the_critical_path
from parallel.auto.runtime.schedule import OverlapReport, count_collectives, schedule_overlap

log = logging.getLogger("parallel.auto.runtime")


_ALIASES = {"detach", "alias"}  # in a graph run without autograd, the input itself
_VIEW = torch.ops.aten.view.default


def _same_shape(n: Any, src: Any) -> bool:
    a, b = n.meta.get("val"), src.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tuple(a.shape) == tuple(b.shape) \
        and a.stride() == b.stride()


def drop_no_op_nodes(gm: Any) -> int:
    """Remove what computes nothing in a step graph run without autograd: `detach` / `alias`
    of a value, `t(t(x))`, a view to the same shape, a view of a view, so the eager graph's
    Python runs fewer ops per step (each costs its dispatch on the host). A node that feeds
    the graph's output stays: an output must not become the very tensor of an input (a
    gradient that is a parameter's storage). Returns how many nodes were removed; the
    caller regenerates the code."""
    outputs = set(gm.graph.output_node().all_input_nodes)
    removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n in outputs or not n.args or not isinstance(n.args[0], torch.fx.Node):
            continue
        name, src = T.op_name(n.target), n.args[0]
        if name in _ALIASES:
            n.replace_all_uses_with(src)
        elif name == "t" and src.op == "call_function" and T.op_name(src.target) == "t":
            n.replace_all_uses_with(src.args[0])
        elif n.target is _VIEW and _same_shape(n, src):
            n.replace_all_uses_with(src)
        elif n.target is _VIEW and src.target is _VIEW and len(src.users) == 1:
            n.args = (src.args[0], *n.args[1:])  # view(view(x, a), b) = view(x, b): one view less
            gm.graph.erase_node(src)
            removed += 1
            continue
        else:
            continue
        gm.graph.erase_node(n)
        removed += 1
        if name == "t" and not src.users:  # the inner transpose fed only this one
            gm.graph.erase_node(src)
            removed += 1
    return removed


_PURE_NAMESPACES = ("aten", "prims")  # ops whose schema says all they do; collectives, regions' ops stay


def _fresh_and_only_read_by(v: Any, n: Any) -> bool:
    """`v` is a new tensor made inside the graph (not an input, not a view of anything) that
    nothing but `n` reads: mutating it is invisible once `n`'s result is unused."""
    if not isinstance(v, torch.fx.Node) or v.op != "call_function" or set(v.users) != {n}:
        return False
    return isinstance(v.target, T.OpOverload) and not T.returns_a_view(v.target)


def _must_run(n: Any) -> bool:
    """Whether a node stays although nothing reads its result: inputs, outputs, anything but
    an ATen op (collectives, regions' ops, Python calls), random ops (they advance the
    generator), and writes into a tensor that something else can still see."""
    if n.op != "call_function":
        return True
    t = n.target
    if t is operator.getitem:
        return False
    if not isinstance(t, T.OpOverload) or t.namespace not in _PURE_NAMESPACES:
        return True
    if torch.Tag.nondeterministic_seeded in t.tags:
        return True
    return not all(_fresh_and_only_read_by(v, n) for v in T.written_arguments(n))


def drop_dead_nodes(gm: Any) -> int:
    """Remove the ops whose results nothing reads. Some torch versions leave such chains in the
    trace (torch 2.11 records DTensor's own shape propagation: an `embedding` of uninitialised
    host tensors that fails on a GPU, IndexError), and eager mode would run them every step.
    Returns how many nodes were removed; the caller regenerates the code."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=_must_run)
    return before - len(gm.graph.nodes)


_ADD = torch.ops.aten.add.Tensor
_ADD_ = torch.ops.aten.add_.Tensor
_HIDDEN_ALIASES = {"_unsafe_view"}  # a view whose schema does not say so


def _same_layout(a: Any, b: Any) -> bool:
    return _same_shape(a, b) and a.meta["val"].dtype == b.meta["val"].dtype


def reinplace_adds(gm: Any) -> int:
    """Turn `add(a, b)` into `a.add_(b)` where `a` is a fresh tensor nothing else reads, of the
    sum's dtype, shape and strides: the backward's sums of several gradient contributions
    (the residual stream, q/k/v's input gradient), which autograd's engine accumulates in
    place and an eager FX graph would allocate anew, an untouched page each, every step. Only
    for a graph run eagerly (Inductor fuses these itself). Returns how many adds now write
    in place; the caller regenerates the code."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not _ADD or n.kwargs or len(n.args) != 2:
            continue
        for i, a in enumerate(n.args):
            other = n.args[1 - i]
            if a is other or not _fresh_and_only_read_by(a, n) or T.op_name(a.target) in _HIDDEN_ALIASES \
                    or not _same_layout(a, n):
                continue
            n.target, n.args = _ADD_, (a, other)  # a + b == b + a exactly: the sum is unchanged
            changed += 1
            break
    return changed


_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_ALL_REDUCE_ = torch.ops._c10d_functional.all_reduce_.default


def _only_buffer(v: Any, n: Any) -> bool:
    """`v` reaches `n` only, through views that nothing else reads, from a fresh tensor."""
    while isinstance(v, torch.fx.Node) and v.op == "call_function" and len(v.users) == 1 \
            and T.op_name(v.target) in WHOLE_VIEWS and isinstance(v.target, T.OpOverload):
        n, v = v, v.args[0]
    return _fresh_and_only_read_by(v, n) and T.op_name(v.target) not in _HIDDEN_ALIASES


def reduce_buffers_in_place(gm: Any) -> int:
    """Turn a functional `all_reduce` of a buffer nothing else reads (a gradient bucket's
    concatenation) into `all_reduce_`: the out-of-place one copies its input before it
    sends, a copy of the whole bucket at the end of the backward (12 ms a step for the
    DeepSeek-V3 debug model's 19 MiB on CPU), where torch's DDP reduces its bucket in
    place. Returns how many; the caller regenerates the code."""
    changed = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _ALL_REDUCE and _only_buffer(n.args[0], n):
            n.target = _ALL_REDUCE_
            changed += 1
    return changed


class CompileError(RuntimeError):
    """Inductor could not compile the step graph (the message says why and what to set)."""


class _ParamMeta:
    def __init__(self, spec: tuple, dtype: torch.dtype):
        self.placements = spec[0]
        self.dtype = dtype


def step_key(params: list[Any], buffers: list[Any], inputs: list[Any]) -> tuple:
    """The input layout a step graph is traced for: per tensor its DTensor spec (placements,
    global shape and stride; None for a plain tensor) and its local shape, stride, dtype and
    device. Two calls with the same key run the same graph."""
    def one(x: Any) -> tuple:
        loc = local_value(x)
        return (dspec(x) if isinstance(x, DTensor) else None, tuple(loc.shape), tuple(loc.stride()), loc.dtype,
                str(loc.device))

    return tuple(one(x) for x in params + buffers + inputs)


def fake_constants(gm: Any) -> list[str]:
    """The graph's tensor constants (get_attr) that are fake tensors: a graph traced on fake
    tensors that holds one cannot run on real tensors."""
    out = []
    for n in gm.graph.find_nodes(op="get_attr"):
        vals = T.tree_flatten(getattr(gm, n.target, None))[0]
        if any(isinstance(v, torch.Tensor) and T.is_fake(v) for v in vals):
            out.append(str(n.target))
    return out


def _not_executable(*_: Any) -> Any:
    raise RuntimeError("this StepGraph was built with executable=False (for analysis: its code is stale after "
                       "scheduling); build it with executable=True to run it")


class StepGraph:
    """One plan's forward + loss + backward for one input layout, on this rank's shards."""

    def __init__(self, runner: Any, params: list[DTensor], buffers: list[Any], inputs: list[DTensor], *,
                 overlap: bool = True, compile: bool = False, compile_mode: str = "default",
                 executable: bool = True, reduce: bool = True):
        """`executable=False`: the graph is only walked (runtime/memory.py), so its Python
        code is not regenerated after scheduling and calling the StepGraph is an error
        until `make_executable`. `reduce=False`: the graph has no gradient reductions; its
        gradients are the backward's unreduced values (`PlanRunner.run_backward`), for
        micro-batches whose sum is reduced once (`ParallelModule.no_gradient_sync`)."""
        self.mesh = runner.mesh
        self.reduces = reduce
        self.key = step_key(params, buffers, inputs)
        self.pspecs = [dspec(p) for p in params]
        bspecs = [dspec(b) if isinstance(b, DTensor) else None for b in buffers]
        ispecs = [dspec(x) for x in inputs]
        metas = [_ParamMeta(sp, p.dtype) for sp, p in zip(self.pspecs, params)]
        layout: dict[str, Any] = {}

        def step(plocs: list[torch.Tensor], blocs: list[Any], ilocs: list[torch.Tensor]) -> Any:
            m = self.mesh
            outs, saved = runner.run_forward(wrap(plocs, self.pspecs, m), wrap(blocs, bspecs, m),
                                             wrap(ilocs, ispecs, m))
            layout["outs"] = [dspec(o) for o in outs]
            tangents = [DTensor.from_local(torch.ones_like(o.to_local()), m, o.placements, run_check=False,
                                           shape=o.shape, stride=o.stride()) for o in outs]
            grads = runner.run_backward(saved, tangents, metas, reduce=reduce)
            layout["has_grad"] = [g is not None for g in grads]
            layout["grads"] = [dspec(g) for g in grads if g is not None]
            return [o.to_local() for o in outs], [g.to_local() for g in grads if g is not None]

        t0 = time.perf_counter()
        args = ([p.to_local() for p in params], [local_value(b) for b in buffers], [x.to_local() for x in inputs])
        self.gm = T.trace_fake(step)(*args)
        self.out_specs, self.has_grad = layout["outs"], layout["has_grad"]
        # the gradients' layout: the parameters' (reduced), else each as the backward left it
        self.grad_specs = [sp for sp, has in zip(self.pspecs, self.has_grad) if has] if reduce else layout["grads"]
        self.dropped = drop_dead_nodes(self.gm) + drop_no_op_nodes(self.gm)
        self.loss_syncs_moved = loss_off_the_critical_path(self.gm)
        # gloo (a CPU mesh) must not have two all-gathers of one group in flight (schedule.py)
        self.overlap: OverlapReport | None = schedule_overlap(
            self.gm, recompile=False, one_gather_per_group=self.mesh.device_type == "cpu") if overlap else None
        self.collectives = count_collectives(self.gm)
        self.trace_seconds = time.perf_counter() - t0
        self.compiled = False
        self.fn: Callable[..., Any] = _not_executable
        self.first_call_seconds: float | None = None
        self.recompile_seconds = 0.0
        self.adds_in_place = 0
        self.reductions_in_place = 0
        self.region_tape: RegionTape | None = None  # region forwards kept for their backward
        log.info("apply: step graph traced in %.1fs (%d nodes, %d collectives)%s", self.trace_seconds,
                 len(self.gm.graph.nodes), self.collectives, ", compiling with Inductor" if compile else "")
        if executable:
            self.make_executable(compile=compile, compile_mode=compile_mode)

    @property
    def executable(self) -> bool:
        return self.fn is not _not_executable

    def make_executable(self, *, compile: bool = False, compile_mode: str = "default") -> "StepGraph":
        """Regenerate the graph's Python code after the passes that reordered it (once), and
        run it eagerly or, `compile`, through Inductor (torch.compile wraps this same graph)."""
        if self.executable:
            if compile != self.compiled:
                raise RuntimeError(f"this StepGraph is already executable with compile={self.compiled}")
            return self
        t0 = time.perf_counter()
        if not compile:  # Inductor fuses the sums itself
            self.adds_in_place = reinplace_adds(self.gm)
            self.reductions_in_place = reduce_buffers_in_place(self.gm)
        # compiled, the graph breaks at each region call (run eagerly, its forward kept): a
        # region op inside the compiled graph would run its forward again in its backward
        self.region_tape = use_region_tape(self.gm, compiled=compile)
        T.generate_code(self.gm)
        self.recompile_seconds = time.perf_counter() - t0
        self.compiled = compile
        self.fn = (torch.compile(self.gm, fullgraph=self.region_tape is None, dynamic=False, mode=compile_mode)
                   if compile else self.gm)
        return self

    def __call__(self, plocs: list[torch.Tensor], blocs: list[Any], ilocs: list[torch.Tensor]) -> tuple[list, list]:
        if self.first_call_seconds is not None:
            return self.fn(plocs, blocs, ilocs)
        t0 = time.perf_counter()
        try:
            out = self.fn(plocs, blocs, ilocs)
        except Exception as e:
            if not self.compiled:
                raise
            raise CompileError(f"Inductor could not compile the plan's step graph ({type(e).__name__}: "
                               f"{str(e)[:300]}); set training.compile = false, or training.compile_fallback = "
                               "true to run eagerly when this happens") from e
        self.first_call_seconds = time.perf_counter() - t0
        if self.compiled:
            log.info("apply: step graph compiled and run in %.1fs (first call)", self.first_call_seconds)
        return out

    def grads_as_dtensors(self, grad_locals: list[torch.Tensor]) -> list[DTensor | None]:
        """One per parameter (None: it has no gradient), at the graph's gradient layout."""
        it, specs = iter(grad_locals), iter(self.grad_specs)
        return [DTensor.from_local(next(it), self.mesh, (sp := next(specs))[0], run_check=False, shape=sp[1],
                                   stride=sp[2]) if has else None for has in self.has_grad]
