"""The plan lowered to per-device FX graphs (paper §5.1), and the autograd function that runs it.

`LocalGraphs` traces the DTensor runner (`make_fx`, fake tensors) once per input layout
into two graphs of plain ATen ops on local shards with explicit functional collectives:
`fwd(param locals, buffer locals, input locals) -> (output locals, saved locals)` and
`bwd(saved locals, tangent locals) -> gradient locals`. Running them skips DTensor's
per-op dispatch; the results are the interpreter's, op for op. When lowering fails the
runner interprets eagerly (always correct, slower) and says so in the log.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from parallel import _torch as T
from parallel.auto.candidates.placements import local_shape

log = logging.getLogger("parallel.auto.runtime")

DSpec = tuple  # (placements, global shape, global stride) of a DTensor


def dspec(x: DTensor) -> DSpec:
    return (tuple(x.placements), tuple(x.shape), tuple(x.stride()))


def local_value(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def wrap(locs: list[Any], specs: list[DSpec | None], mesh: DeviceMesh) -> list[Any]:
    """DTensors from local shards and their specs (None: a plain tensor stays plain)."""
    return [DTensor.from_local(x, mesh, sp[0], run_check=False, shape=sp[1], stride=sp[2]) if sp is not None else x
            for x, sp in zip(locs, specs)]


class _ParamMeta:
    """What run_backward reads of a parameter: dtype and placements."""

    def __init__(self, spec: DSpec, dtype: torch.dtype):
        self.placements = spec[0]
        self.dtype = dtype


class LocalGraphs:
    """Per-device forward and backward graphs of one plan for one input layout."""

    def __init__(self, runner: Any, params: list[DTensor], buffers: list[Any], inputs: list[DTensor]):
        self.mesh = runner.mesh
        self.pspecs = [dspec(p) for p in params]
        self.param_dtypes = [p.dtype for p in params]
        bspecs = [dspec(b) if isinstance(b, DTensor) else None for b in buffers]
        ispecs = self.ispecs = [dspec(x) for x in inputs]
        plocs, blocs, ilocs = ([p.to_local() for p in params], [local_value(b) for b in buffers],
                               [x.to_local() for x in inputs])
        layout: dict[str, Any] = {}

        def fwd(plocs: list[torch.Tensor], blocs: list[Any], ilocs: list[torch.Tensor]) -> Any:
            m = self.mesh
            outs, saved = runner.run_forward(wrap(plocs, self.pspecs, m), wrap(blocs, bspecs, m),
                                             wrap(ilocs, ispecs, m))
            cache = saved.pop("__cache__", {})
            layout["keys"], layout["ckeys"] = sorted(saved), sorted(cache)
            layout["saved"] = [dspec(saved[k]) if isinstance(saved[k], DTensor) else None for k in layout["keys"]]
            layout["saved"] += [dspec(cache[k]) for k in layout["ckeys"]]
            layout["outs"] = [dspec(o) for o in outs]
            return ([o.to_local() for o in outs],
                    [local_value(saved[k]) for k in layout["keys"]] + [cache[k].to_local() for k in layout["ckeys"]])

        self.fwd = T.trace_fake(fwd)(plocs, blocs, ilocs)
        self.out_specs: list[DSpec] = layout["outs"]
        outs_l, slocs = self.fwd(plocs, blocs, ilocs)
        self.bwd = self._trace_backward(runner, layout, slocs, outs_l)
        n_coll = sum(1 for g in (self.fwd, self.bwd) for n in g.graph.nodes if getattr(n.target, "namespace", "")
                     == "_c10d_functional" and T.op_name(n.target) != "wait_tensor")
        runner.stats["local_graph_collectives"] = n_coll
        log.info("apply: local graphs built (%d forward, %d backward nodes, %d collectives)",
                 len(self.fwd.graph.nodes), len(self.bwd.graph.nodes), n_coll)

    def _trace_backward(self, runner: Any, layout: dict[str, Any], slocs: list[Any], outs_l: list[Any]) -> Any:
        keys, ckeys, sspecs = layout["keys"], layout["ckeys"], layout["saved"]
        metas = [_ParamMeta(sp, dt) for sp, dt in zip(self.pspecs, self.param_dtypes)]

        def bwd(slocs: list[torch.Tensor], tlocs: list[torch.Tensor]) -> Any:
            vals = wrap(slocs, sspecs, self.mesh)
            saved = dict(zip(keys, vals[:len(keys)]))
            saved["__cache__"] = dict(zip(ckeys, vals[len(keys):]))
            input_grads: list[Any] = []
            grads = runner.run_backward(saved, wrap(tlocs, self.out_specs, self.mesh), metas,
                                        input_grads=input_grads)
            layout["has_grad"] = [g is not None for g in grads]
            layout["has_input_grad"] = [g is not None for g in input_grads]
            return [g.to_local() for g in grads + input_grads if g is not None]

        tlocs = [torch.ones(self.local_out_shape(sp), dtype=o.dtype, device=runner.device)
                 for sp, o in zip(self.out_specs, outs_l)]
        gm = T.trace_fake(bwd)(slocs, tlocs)
        self.has_grad: list[bool] = layout["has_grad"]
        self.has_input_grad: list[bool] = layout["has_input_grad"]
        return gm

    def local_out_shape(self, sp: DSpec) -> tuple[int, ...]:
        return local_shape(sp[1], sp[0], tuple(self.mesh.shape))

    def grads_as_dtensors(self, grad_locals: list[torch.Tensor]) -> list[DTensor | None]:
        """The parameters' gradients, then the inputs' (None where none), as DTensors."""
        it = iter(grad_locals)
        return [DTensor.from_local(next(it), self.mesh, sp[0], run_check=False, shape=sp[1], stride=sp[2])
                if has else None for has, sp in zip(self.has_grad + self.has_input_grad, self.pspecs + self.ispecs)]


def local_graphs_for(runner: Any, params: list[DTensor], buffers: list[Any],
                     inputs: list[DTensor]) -> LocalGraphs | None:
    """The LocalGraphs for these argument layouts (built on first use), or None (interpret eagerly)."""
    if not runner.use_local_graphs:
        return None
    key = tuple(dspec(x) if isinstance(x, DTensor) else (tuple(x.shape), x.dtype) for x in params + buffers + inputs)
    key += tuple(x.dtype for x in params + inputs)
    hit = runner.local_graphs_cache.get(key)
    if hit is None:
        try:
            hit = runner.local_graphs_cache[key] = LocalGraphs(runner, params, buffers, inputs)
        except Exception as e:  # noqa: BLE001 - the interpreter is always correct, only slower
            log.warning("apply: could not lower the plan to local graphs (%s: %s); interpreting eagerly",
                        type(e).__name__, str(e)[:300])
            runner.use_local_graphs = False
            return None
    return hit


class PlanFunction(torch.autograd.Function):
    """The plan's forward phase in forward, its backward phase in backward (local graphs when
    available, the DTensor interpreter otherwise). Returns local output shards."""

    @staticmethod
    def forward(ctx: Any, runner: Any, n_params: int, n_buffers: int, *flat: Any) -> Any:
        params, buffers = list(flat[:n_params]), list(flat[n_params:n_params + n_buffers])
        inputs = list(flat[n_params + n_buffers:])
        ctx.runner, ctx.n_rest, ctx.n_inputs = runner, n_buffers + len(inputs), len(inputs)
        ctx.lg = local_graphs_for(runner, params, buffers, inputs)
        if ctx.lg is not None:
            runner.stats["local_graph_steps"] += 1
            outs_l, ctx.saved = ctx.lg.fwd([p.to_local() for p in params], [local_value(b) for b in buffers],
                                           [x.to_local() for x in inputs])
            ctx.out_specs = ctx.lg.out_specs
            return tuple(outs_l) if len(outs_l) > 1 else outs_l[0]
        runner.stats["interpreted_steps"] += 1
        outs, ctx.saved = runner.run_forward(params, buffers, inputs)
        ctx.params = params
        ctx.out_specs = [dspec(o) for o in outs]
        locals_ = tuple(o.to_local() for o in outs)
        return locals_ if len(locals_) > 1 else locals_[0]

    @staticmethod
    def backward(ctx: Any, *grad_outs: Any) -> Any:
        runner = ctx.runner
        if ctx.lg is not None:
            lg: LocalGraphs = ctx.lg
            tl = [g.contiguous() if g is not None else torch.zeros(lg.local_out_shape(sp), device=runner.device)
                  for g, sp in zip(grad_outs, lg.out_specs)]
            grads = lg.grads_as_dtensors(lg.bwd(ctx.saved, tl))
        else:
            tangents = [None if g is None else wrap([g.contiguous()], [sp], runner.mesh)[0]
                        for g, sp in zip(grad_outs, ctx.out_specs)]
            input_grads: list[Any] = []
            grads = runner.run_backward(ctx.saved, tangents, ctx.params, input_grads=input_grads) + input_grads
        ctx.saved = None
        # the inputs' gradients (a pipeline stage's hidden state) follow the buffers' Nones
        n_params = len(grads) - ctx.n_inputs
        return (None, None, None, *grads[:n_params], *([None] * (ctx.n_rest - ctx.n_inputs)), *grads[n_params:])
