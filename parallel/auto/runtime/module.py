"""Plan -> ParallelModule: the user's model class with DTensor parameters that runs the plan.

    pmodel = apply_plan(model, graph, candidates, plan, mesh)   # api.AutoParallel.apply_placement
    pmodel.to_empty(device="cpu"); torch.manual_seed(0); pmodel.init_weights()
    loss = pmodel(local_tokens, local_labels)      # per-rank LOCAL inputs
    loss.backward()                                 # grads: DTensors with the planned placements

The returned module is an instance of a subclass of the user's model class (isinstance
holds, `named_parameters()` gives the same names, checkpoints keep their keys); its
parameters are `nn.Parameter(DTensor)` with the planned placements. Its forward runs the
plan's forward phase and autograd its backward phase (local_graphs.PlanFunction).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from models import meta_copy
from parallel import _torch as T
from parallel.auto.candidates.placements import local_shape, placement_str, rank_local_shape
from parallel.auto.candidates.strategies import Candidates
from parallel.auto.cost import CostModel
from parallel.auto.cost.simulate import StepPrediction, simulate_step
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.regions.pricing import step_region_us
from parallel.auto.runtime.local_graphs import PlanFunction
from parallel.auto.runtime.memory import param_groups, step_links
from parallel.auto.runtime.options import RuntimeOptions
from parallel.auto.runtime.redistribute import contiguous_stride, local_shard
from parallel.auto.runtime.runner import PlanRunner
from parallel.auto.runtime.step_graph import CompileError, StepGraph, step_key
from parallel.auto.trace.joint import JointGraph

log = logging.getLogger("parallel.auto.runtime")


class InputShapeError(ValueError):
    """A per-rank input does not have the local shape the plan expects."""


class ParallelModuleMixin:
    """Methods of the materialised module (mixed into a subclass of the user's class)."""

    computes_loss: bool = False  # True when the plan's forward returns the loss (traced with loss_fn)
    pending_step_graph: StepGraph | None = None  # the planner's trace of this plan, until the first step
    grad_sync_deferred: bool = False  # inside no_gradient_sync
    unreduced_grads: list | None = None  # the micro-batches' unreduced gradients summed, until the reduction
    handles_mixed_precision: bool = True
    is_auto_parallel: bool = True

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        runner: PlanRunner = self.plan_runner
        flat, _ = T.tree_flatten(inputs)
        if len(flat) != len(runner.input_nodes):
            raise TypeError(f"{type(self).__name__}.forward expects {len(runner.input_nodes)} tensor inputs "
                            f"(as traced), got {len(flat)}")
        dts = [self._planned_input(i, x) for i, x in enumerate(flat)]
        params = [self.param_refs[f]() for f in runner.param_names]
        buffers = [self.buffer_refs[f]() for f in runner.buffer_names]
        return PlanFunction.apply(runner, len(params), len(buffers), *params, *buffers, *dts)

    def _planned_input(self, i: int, x: Any) -> DTensor:
        runner: PlanRunner = self.plan_runner
        val = runner.input_nodes[i].meta["val"]
        pl = runner.input_placements(i)
        if isinstance(x, DTensor):
            if tuple(x.shape) != tuple(val.shape):
                raise InputShapeError(f"input {i}: global shape {tuple(x.shape)}, "
                                      f"the plan was made for {tuple(val.shape)}")
            return runner.to_placements(x, pl)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input {i}: expected a tensor, got {type(x).__name__}")
        want = local_shape(tuple(val.shape), pl, tuple(runner.mesh.shape))
        if tuple(x.shape) != want:
            raise InputShapeError(
                f"input {i}: this rank got local shape {tuple(x.shape)} but the plan expects {want} "
                f"(global {tuple(val.shape)} placed {placement_str(pl)} on mesh {tuple(runner.mesh.shape)} "
                f"{tuple(runner.mesh.mesh_dim_names or ())}); pass each rank its LOCAL shard")
        if x.dtype != val.dtype:
            raise InputShapeError(f"input {i}: dtype {x.dtype}, the plan was traced with {val.dtype}")
        # the graph was traced on contiguous inputs (its views assume that layout)
        return DTensor.from_local(x.contiguous(), runner.mesh, pl, run_check=False, shape=val.shape,
                                  stride=contiguous_stride(tuple(val.shape)))

    def planned_arguments(self, *inputs: Any) -> tuple[list[DTensor], list[Any], list[DTensor]]:
        """(parameters, buffers, inputs) as the plan's graphs take them: the per-rank local
        inputs wrapped as DTensors at their planned placements (checked against the plan)."""
        runner: PlanRunner = self.plan_runner
        flat, _ = T.tree_flatten(inputs)
        params = [self.param_refs[f]() for f in runner.param_names]
        buffers = [self.buffer_refs[f]() for f in runner.buffer_names]
        return params, buffers, [self._planned_input(i, x) for i, x in enumerate(flat)]

    def forward_backward(self, *inputs: Any, grad_scale: float = 1.0) -> torch.Tensor:
        """One training step's forward, loss and backward as ONE per-device graph (step_graph.py):
        accumulates every parameter's gradient (as `loss.backward()` would; `grad_scale` x it:
        gradient accumulation's 1 / micro-batches) and returns the local loss. The gradients
        arrive reduced to their planned placements (the graph's collectives); under
        `no_gradient_sync` they stay unreduced, and the first call after it reduces their sum
        once. Overlap and Inductor compilation follow the plan's RuntimeOptions."""
        runner: PlanRunner = self.plan_runner
        unreduced = self.grad_sync_deferred or self.unreduced_grads is not None
        with torch.no_grad():  # the graph computes the gradients: no autograd work on the host per tensor
            params, buffers, dts = self.planned_arguments(*inputs)
            sg = self._step_graph(params, buffers, dts, reduce=not unreduced)
            plocs = [p.to_local() for p in params]
            blocs = [b.to_local() if isinstance(b, DTensor) else b for b in buffers]
            outs, grads = sg(plocs, blocs, [x.to_local() for x in dts])
            if unreduced:
                if sg.compiled:  # a CUDA-graph replay (compile modes reduce-overhead, max-autotune) reuses its
                    grads = [g.clone() for g in grads]  # output buffers: the sum must not be one of them
                self._accumulate_unreduced(sg.grads_as_dtensors(grads), grad_scale)
                grads.clear()  # added to the sum: freed before the reduction allocates its results
                grad_values = None if self.grad_sync_deferred else self._reduce_accumulated(params)
            else:
                if grad_scale != 1.0:
                    grads = [g * grad_scale for g in grads]
                grad_values = sg.grads_as_dtensors(grads)
            for p, g in zip(params, grad_values or ()):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
        runner.stats["step_graph_steps"] += 1
        return outs[0]

    @contextlib.contextmanager
    def no_gradient_sync(self) -> Iterator[None]:
        """Gradient accumulation without a reduction per micro-batch (DDP's `no_sync`, FSDP2's
        `set_requires_gradient_sync(False)`): `forward_backward` inside it runs the plan's
        step graph without its gradient reductions and sums the unreduced gradients (a
        Partial weight gradient stays Partial: with FSDP-like placements that sum is a whole
        gradient per rank until the step's reduction, as FSDP2's). The next `forward_backward`
        outside it adds its own and reduces the sum once, bucketed as the plan's graph
        reduces, into the parameters' `.grad`."""
        object.__setattr__(self, "grad_sync_deferred", True)
        try:
            yield
        finally:
            object.__setattr__(self, "grad_sync_deferred", False)

    def discard_unreduced_grads(self) -> None:
        """Drop the gradients summed under `no_gradient_sync` (a step abandoned mid-way)."""
        object.__setattr__(self, "unreduced_grads", None)

    def _accumulate_unreduced(self, grads: list[DTensor | None], scale: float) -> None:
        """Add `scale` x a micro-batch's unreduced gradients to the sum, in place (the first
        micro-batch's own graph outputs become the sum: no copy)."""
        acc = self.unreduced_grads
        if acc is None:
            if scale != 1.0:
                for g in grads:
                    if g is not None:
                        g.to_local().mul_(scale)
            object.__setattr__(self, "unreduced_grads", grads)
            return
        for a, g in zip(acc, grads):
            if a is not None:
                if tuple(a.placements) != tuple(g.placements) or a.shape != g.shape:
                    raise PlanMismatchError("gradient accumulation: a micro-batch's unreduced gradient has "
                                            f"placements {placement_str(tuple(g.placements))}, the sum so far "
                                            f"{placement_str(tuple(a.placements))} (micro-batches of one step "
                                            "must run the same plan)")
                a.to_local().add_(g.to_local(), alpha=scale)

    def _reduce_accumulated(self, params: list[DTensor]) -> list[DTensor | None]:
        """The summed unreduced gradients reduced to the parameters' placements, once."""
        acc = self.unreduced_grads
        object.__setattr__(self, "unreduced_grads", None)
        reduced = self.plan_runner.reduce_grads(acc, params)
        self.plan_runner.stats["deferred_grad_reductions"] += 1
        return reduced

    def _step_graph(self, params: list[Any], buffers: list[Any], inputs: list[DTensor],
                    reduce: bool = True) -> StepGraph:
        key = (reduce, step_key(params, buffers, inputs))
        sg = self.step_graphs.get(key)
        if sg is None:
            opts = self.plan_runner.options
            compile = opts.compile and not self.compile_failed
            sg = self._planned_step_graph(key[1], reduce, compile, opts.compile_mode)
            if sg is None:
                sg = StepGraph(self.plan_runner, params, buffers, inputs, overlap=opts.overlap, compile=compile,
                               compile_mode=opts.compile_mode, reduce=reduce)
            self.step_graphs[key] = sg
        if sg.compiled and sg.first_call_seconds is None and self.plan_runner.options.compile_fallback:
            return _FallbackOnCompileError(sg, self, params, buffers, inputs, reduce)
        return sg

    def _planned_step_graph(self, key: tuple, reduce: bool, compile: bool, compile_mode: str) -> StepGraph | None:
        """The step graph the planner's memory estimate traced for this plan (handed over by
        apply_plan, used once), when it was traced for this very input layout and gradient
        reduction; else None."""
        sg = self.pending_step_graph
        if sg is None:
            return None
        if sg.reduces != reduce:  # kept for the call that reduces as it was traced
            return None
        object.__setattr__(self, "pending_step_graph", None)  # one chance: the first layout; then released
        if sg.key != key:
            diff = next((i for i, (a, b) in enumerate(zip(sg.key, key)) if a != b), min(len(sg.key), len(key)))
            log.info("apply: the memory estimate's step graph was traced for another input layout (tensor %d: %s, "
                     "here %s); tracing this one", diff, sg.key[diff][1:] if diff < len(sg.key) else "-",
                     key[diff][1:] if diff < len(key) else "-")
            return None
        sg.make_executable(compile=compile, compile_mode=compile_mode)
        log.info("apply: step graph of the memory estimate reused (traced once for this plan; its code regenerated "
                 "in %.2fs)%s", sg.recompile_seconds, ", compiling with Inductor" if compile else "")
        return sg

    @torch.no_grad()
    def init_weights(self, *args: Any, sharded: bool = False, **kwargs: Any) -> None:
        """The model's own init. `sharded`: on the DTensor parameters themselves (each rank
        draws only its shards; equal to the single-device init where DTensor's RNG tracker
        makes it so, on GPUs). Otherwise the single-device init of a full copy (same RNG
        draws), of which each rank keeps its shards."""
        if sharded:
            super().init_weights(*args, **kwargs)  # the user's class's init, on DTensors
            return
        template = copy.deepcopy(self.meta_template)
        template.to_empty(device=self._device())
        template.init_weights(*args, **kwargs)
        self.load_full_weights(template)

    def _device(self) -> torch.device:
        """Where the parameters' shards live (the module's device)."""
        p = next(iter(self.parameters()))
        return (p.to_local() if isinstance(p, DTensor) else p).device

    @torch.no_grad()
    def load_full_weights(self, full: nn.Module) -> None:
        """Copy the shards of a full (single-device) module's weights into this module."""
        runner: PlanRunner = self.plan_runner
        full_params = dict(full.named_parameters())
        for fqn in runner.param_names:
            p = self.param_refs[fqn]()
            p.to_local().copy_(local_shard(full_params[fqn].detach().to(p.dtype), runner.mesh, tuple(p.placements)))
        for fqn, b in full.named_buffers():
            mod, _, leaf = fqn.rpartition(".")
            setattr(self.get_submodule(mod) if mod else self, leaf, b.detach().clone())

    @torch.no_grad()
    def take_state_from(self, other: nn.Module) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """Adopt `other`'s weights and buffers (a ParallelModule of the same model under
        another plan, e.g. for another sequence length) at this module's placements, in
        memory: every parameter is redistributed by DTensor (all-gathers / local slices
        / all-to-alls, no files). Returns {fqn: (old parameter, new parameter)} so that an
        optimizer can follow its parameters."""
        runner: PlanRunner = self.plan_runner
        old = dict(other.named_parameters())
        if set(old) != set(runner.param_names):
            raise PlanMismatchError(f"cannot take the state of a module with parameters "
                                    f"{sorted(set(old) ^ set(runner.param_names))[:5]} not in this plan")
        moved = {}
        for fqn in runner.param_names:
            src, placements = old[fqn], runner.param_placements(fqn)
            local = src.detach().redistribute(runner.mesh, placements).to_local()
            dt = DTensor.from_local(local.clone(memory_format=torch.contiguous_format), runner.mesh, placements,
                                    run_check=False, shape=src.shape, stride=contiguous_stride(tuple(src.shape)))
            mod, _, leaf = fqn.rpartition(".")
            new = nn.Parameter(dt, requires_grad=src.requires_grad)
            setattr(self.get_submodule(mod) if mod else self, leaf, new)
            moved[fqn] = (src, new)
        for fqn, b in other.named_buffers():
            mod, _, leaf = fqn.rpartition(".")
            setattr(self.get_submodule(mod) if mod else self, leaf, b)
        return moved

    @property
    def plan(self) -> Plan:
        return self.plan_runner.plan

    def predict_step(self, cost_model: CostModel | None = None) -> StepPrediction:
        """The cost model's time for one training step as this module runs it: its step graph
        (built by the first `forward_backward`) simulated on the planner's cost model."""
        if not self.step_graphs:
            raise RuntimeError("predict_step needs the step graph: call forward_backward once first")
        cm = cost_model if cost_model is not None else self.plan_cost_model
        sg = next(iter(self.step_graphs.values()))
        names = self.plan_runner.param_names
        params = [self.param_refs[f]() for f in names]
        local_bytes = sum(p.to_local().numel() * 4 for p in params)  # fp32 master weights and states
        return simulate_step(sg.gm, cm, step_links(self.plan_runner.mesh, cm), optimizer_param_bytes=local_bytes,
                             optimizer_tensors=len(params), param_groups=param_groups(names),
                             region_us=step_region_us)


class _FallbackOnCompileError:
    """The first call of a compiled step graph; on a compile error, the eager graph instead
    (logged as a warning), kept for the rest of the run."""

    def __init__(self, sg: StepGraph, module: ParallelModuleMixin, params: list, buffers: list, inputs: list,
                 reduce: bool):
        self.sg, self.module, self.args = sg, module, (params, buffers, inputs, reduce)

    def __call__(self, *locals_: Any) -> Any:
        try:
            return self.sg(*locals_)
        except CompileError as e:
            log.warning("training.compile_fallback = true: %s; running the step graph eagerly", e)
            module = self.module
            object.__setattr__(module, "compile_failed", True)
            module.step_graphs.clear()
            self.sg = module._step_graph(*self.args)
            return self.sg(*locals_)

    @property
    def compiled(self) -> bool:
        return self.sg.compiled

    def grads_as_dtensors(self, grad_locals: list) -> list:
        return self.sg.grads_as_dtensors(grad_locals)


_SUBCLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(f"AutoParallel{cls.__name__}", (ParallelModuleMixin, cls),
                                      {"__module__": cls.__module__})
    return sub


def is_parallel_module(m: Any) -> bool:
    return isinstance(m, ParallelModuleMixin)


def _all_meta(model: nn.Module) -> bool:
    ts = list(model.parameters()) + list(model.buffers())
    return bool(ts) and all(t.device.type == "meta" for t in ts)


def _attr_ref(root: nn.Module, fqn: str) -> tuple[nn.Module, str, Callable[[], Any]]:
    mod_name, _, leaf = fqn.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    return mod, leaf, lambda: getattr(mod, leaf)


def _shard_parameters(pm: nn.Module, runner: PlanRunner, mesh: DeviceMesh, on_meta: bool) -> dict[str, Callable]:
    """Replace every parameter of `pm` by an nn.Parameter(DTensor) at its planned placement."""
    named = dict(pm.named_parameters())
    if set(named) != set(runner.param_names):
        raise PlanMismatchError(f"model parameters {sorted(set(named) ^ set(runner.param_names))[:5]} "
                                "are not in the plan")
    refs = {}
    for fqn in runner.param_names:
        p, pl = named[fqn], runner.param_placements(fqn)
        if on_meta or p.device.type == "meta":
            shape = rank_local_shape(tuple(p.shape), pl, tuple(mesh.shape), mesh.get_coordinate())
            local = torch.empty(shape, dtype=p.dtype, device="meta")
        else:
            local = local_shard(p.detach(), mesh, pl).clone()
        dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=p.shape,
                                stride=contiguous_stride(tuple(p.shape)))
        mod, leaf, refs[fqn] = _attr_ref(pm, fqn)
        setattr(mod, leaf, nn.Parameter(dt, requires_grad=p.requires_grad))
    return refs


def apply_plan(model: nn.Module, graph: JointGraph, candidates: Candidates, plan: Plan, mesh: DeviceMesh, *,
               mp_policy: MixedPrecisionPolicy | None = None, options: RuntimeOptions | None = None,
               computes_loss: bool = True, cost_model: CostModel | None = None, runner: PlanRunner | None = None,
               step_graph: StepGraph | None = None) -> nn.Module:
    """Materialise `plan` for `model`: a ParallelModule with DTensor parameters (see module doc).

    `model` may be on meta (then `to_empty` + `init_weights()` later) or materialised (then
    every rank must hold the same full weights; each keeps its shards). `runner`, `step_graph`:
    the runner of this plan built with these options and graphs (the memory estimate's), and
    the step graph it traced; the first `forward_backward` runs that graph when its input
    layout is the one it was traced for (`step_graph.key`), instead of tracing again.
    """
    plan.check_compatible(model=model, mesh=mesh, source="the plan")
    if runner is None:
        runner = PlanRunner(graph, candidates, plan, mesh, mp_policy, options)
    else:  # built for this plan (same placements) by the estimate: run it with these options, as this plan
        runner.options, runner.plan = options or RuntimeOptions(), plan
    on_meta = _all_meta(model)
    # the parameters are replaced by their shards below: shared, not copied; the buffers are
    # cloned (a dry run's fake ones stay in their mode: a deepcopy would copy the mode too)
    pm = copy.deepcopy(model, {id(t): t for t in model.parameters()} | {id(b): b.clone() for b in model.buffers()})
    template = meta_copy(model)
    pm.__class__ = _parallel_class(type(model))
    param_refs = _shard_parameters(pm, runner, mesh, on_meta)
    buffer_refs = {fqn: _attr_ref(pm, fqn)[2] for fqn in runner.buffer_names}
    # plain attributes, not submodules or parameters: state_dict and named_modules stay the user's
    for name, value in (("plan_runner", runner), ("meta_template", template), ("param_refs", param_refs),
                        ("buffer_refs", buffer_refs), ("computes_loss", computes_loss), ("step_graphs", {}),
                        ("plan_cost_model", cost_model), ("pending_step_graph", step_graph),
                        ("compile_failed", False), ("grad_sync_deferred", False), ("unreduced_grads", None)):
        object.__setattr__(pm, name, value)
    log.info("apply: materialised %s with %d DTensor parameters on mesh %s", type(pm).__name__, len(param_refs),
             tuple(mesh.shape))
    return pm
