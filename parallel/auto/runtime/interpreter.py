"""One phase of a plan (forward or backward graph) run on DTensors: torch.fx's Interpreter
with a plan-aware `run_node`.

For every op the interpreter redistributes each tensor input to the placement the chosen
strategy expects (all-gather, reduce-scatter, all-reduce, all-to-all, local chunking),
runs the op on those DTensors (so the per-device op sees local shards and DTensor sizes
views and factories per device), and checks the output placement against the plan (a
disagreement is redistributed to the planned placement and counted as a deviation).
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Replicate

from parallel import _torch as T
from parallel.auto.candidates.placements import flat_bucket_key, placement_str
from parallel.auto.cost.memory import BLOCK, RECOMPUTED
from parallel.auto.losses import FP32_LOSS_OPS
from parallel.auto.regions import region_of, run_region
from parallel.auto.runtime.redistribute import bucketed_redistribute, redistribute
from parallel.auto.runtime.repeated_blocks import MISSING

log = logging.getLogger("parallel.auto.runtime")

aten = torch.ops.aten
VIEW_OPS = (aten.view.default, aten._unsafe_view.default)
CAST_OPS = (aten._to_copy.default,)
LAYOUT_OPS = (aten.t.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
              aten._to_copy.default, aten.detach.default, aten.clone.default)
"""Ops that only change layout or dtype: a sum over ranks commutes with them."""
NEW_FACTORIES = (aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
                 aten.new_empty_strided.default)
"""`x.new_zeros(shape)` and kin: the output's values do not depend on `x` (only its dtype and device)."""


def _keeps_dtype(op: Any, v: torch.Tensor) -> bool:
    """Inputs that keep their dtype under mixed precision: an attention backward (CPU or
    CUDA kernels) takes its fp32 logsumexp [B, H, S] with bf16 q/k/v/out."""
    name = T.op_name(op)
    return "attention" in name and name.endswith("_backward") and v.ndim == 3 and v.dtype == torch.float32


def _replicated(v: DTensor) -> tuple:
    return tuple(Replicate() for _ in v.placements)


def is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


class PlacementOps:
    """The per-op part of running a plan: specs by node name, redistribution, checks.

    `spec`: node name -> chosen OpSpec; `defer`: names of layout ops that run on Partial
    values (their reduction is done once, bucketed, at the gradient output); `cache`:
    this step's gathered parameters (name -> replicated DTensor), read by every op that
    wants the parameter replicated, forward and backward.
    """

    planned_strategies = True
    """An op whose inputs are at the plan's placements gets DTensor's propagation with the
    plan's strategy alone (`T.planned_strategy`); False: DTensor weighs all of them."""

    def __init__(self, mesh: Any, spec: dict[str, Any], param_dtype: torch.dtype | None, defer: set[str],
                 gather_buckets: dict[str, tuple] | None = None, load_balance: int = 1):
        self.mesh = mesh
        self.load_balance = load_balance  # the sequence order of the inputs (regions.RegionContext)
        self.spec = spec
        self.param_dtype = param_dtype
        self.defer = defer
        # parameter node name -> its gather bucket (block, ...): parameters some op takes
        # replicated are gathered together with their bucket at the first such use
        self.gather_buckets = gather_buckets or {}
        self._bucket_members: dict[Any, list[str]] = {}  # bucket -> its parameters (a scan of one bucket, not all)
        for m, b in self.gather_buckets.items():
            self._bucket_members.setdefault(b, []).append(m)
        self.param_values: dict[str, DTensor] = {}  # this phase's parameter shards (compute dtype)
        self.cache: dict[str, DTensor] = {}
        self.stats: Counter = Counter()
        # a GPU job runs the traced CPU attention op as its CUDA kernel (trace/attention.py)
        self.lower_attention = T.lowers_attention(mesh.device_type)

    def gathered(self, name: str) -> DTensor | None:
        """The replicated copy of parameter `name`, gathering its whole bucket (one flat
        all-gather per mesh axis) the first time this phase asks for one of them."""
        hit = self.cache.get(name)
        if hit is not None or name not in self.gather_buckets or name not in self.param_values:
            return hit
        v = self.param_values[name]
        mesh_shape = tuple(self.mesh.shape)
        key = (self.gather_buckets[name], flat_bucket_key(v.shape, tuple(v.placements), _replicated(v), mesh_shape),
               v.dtype)
        members = [m for m in self._bucket_members[key[0]] if m in self.param_values and m not in self.cache
                   and (flat_bucket_key((w := self.param_values[m]).shape, tuple(w.placements), _replicated(v),
                                        mesh_shape), w.dtype) == key[1:]]
        if key[1] is None:
            return None
        self.stats["bucketed_param_gathers"] += 1
        outs = bucketed_redistribute([self.param_values[m] for m in members], [_replicated(v)] * len(members),
                                     self.mesh)
        self.cache.update(zip(members, outs))
        return self.cache[name]

    def to_placements(self, x: Any, placements: tuple) -> Any:
        """`x` redistributed to `placements`; a plain tensor is a global value every rank holds."""
        if not isinstance(x, DTensor):
            if not isinstance(x, torch.Tensor):
                return x
            x = DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        if tuple(x.placements) == tuple(placements):
            return x
        self.stats["redistributions"] += 1
        return redistribute(x, self.mesh, tuple(placements))

    def out_placements(self, name: str, idx: int | None = None) -> tuple:
        o = self.spec[name].output_specs
        if isinstance(o, tuple):
            o = o[idx or 0]
        return tuple(o.placements)

    def _input(self, n: fx.Node, a: fx.Node, v: Any, target: Any) -> Any:
        if target is not None and n.name not in self.defer:
            want = tuple(target.placements)
            replicated = all(isinstance(p, Replicate) for p in want)
            cached = self.gathered(a.name) if replicated else self.cache.get(a.name)
            v = cached if cached is not None and tuple(cached.placements) == want else self.to_placements(v, want)
        if n.target in VIEW_OPS and isinstance(v, DTensor) and not v.to_local().is_contiguous():
            # the joint graph is functional: a copy is as good as a view, and local shards
            # (after a redistribution) need not keep the global layout
            v = DTensor.from_local(v.to_local().contiguous(), v.device_mesh, v.placements, run_check=False,
                                   shape=v.shape, stride=v.stride())
        return v

    def run(self, n: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """Run op node `n` with its inputs (from `env`) at their planned placements."""
        in_specs = list(self.spec[n.name].input_specs or [])
        leaves, tree = T.tree_flatten((n.args, dict(n.kwargs)))
        # an op on lifted constants only (plain tensors every rank holds whole: lift_fresh_copy of
        # a torch.tensor literal) runs on them as they are; its output is wrapped Replicate below
        plain = not any(isinstance(env[a], DTensor) for a in leaves if is_tensor_node(a))
        vals, k = [], 0
        as_planned = not plain and n.name not in self.defer and bool(in_specs)  # inputs at the plan's placements
        for a in leaves:
            if is_tensor_node(a) and not plain:
                target = in_specs[k] if k < len(in_specs) else None
                vals.append(self._input(n, a, env[a], target))
                as_planned = as_planned and target is not None and isinstance(vals[-1], DTensor) and tuple(
                    vals[-1].placements) == tuple(target.placements)
                k += 1
            else:
                vals.append(env[a] if isinstance(a, fx.Node) else a)
        if n.target in NEW_FACTORIES and isinstance(vals[0], DTensor) and all(
                isinstance(p, Replicate) for p in self.out_placements(n.name)):
            # planned whole on every rank: made from the local tensor (DTensor's dispatch would
            # shard it like `x`, and the plan's replicated output would cost an all-gather)
            vals[0] = vals[0].to_local()
        if self.param_dtype is not None:
            vals = self._harmonize(vals, n)
        args, kwargs = T.tree_unflatten(vals, tree)
        if region_of(n.target) is not None:  # a local_map region: its local function on shards
            return run_region(n, args, self.spec[n.name], self.mesh, self.load_balance)
        try:
            if self.lower_attention and n.target in T.CPU_ATTENTION_OPS:  # the job's CUDA kernel, by DTensor's rules
                out = T.run_lowered(n.target, args, kwargs)
            elif self.planned_strategies and as_planned and k == len(in_specs) and isinstance(n.target, T.OpOverload):
                with T.planned_strategy(n.target, self.spec[n.name]):
                    out = n.target(*args, **kwargs)
            else:
                out = n.target(*args, **kwargs)
        except Exception as e:
            ins = [f"{tuple(v.shape)}@{placement_str(tuple(v.placements))} local {tuple(v.to_local().shape)}"
                   for v in vals if isinstance(v, DTensor)]
            raise RuntimeError(f"apply: node {n.name} ({n.target}) failed on inputs {ins}: {e}") from e
        return out if n.name in self.defer else self._check_outputs(n, out)

    def _check_outputs(self, n: fx.Node, out: Any) -> Any:
        o_spec = self.spec[n.name].output_specs
        if isinstance(out, (tuple, list)):
            outs = list(out)
            for i, o in enumerate(outs):
                if (isinstance(o_spec, tuple) and i < len(o_spec) and o_spec[i] is not None
                        and isinstance(o, torch.Tensor)):
                    outs[i] = self._fix(o, tuple(o_spec[i].placements), n)
            return type(out)(outs) if isinstance(out, tuple) else outs
        if isinstance(out, torch.Tensor):
            return self._fix(out, self.out_placements(n.name), n)
        return out

    def _fix(self, out: torch.Tensor, planned: tuple, n: fx.Node) -> Any:
        if not isinstance(out, DTensor):  # factory op (no DTensor input): a global value on every rank
            out = DTensor.from_local(out, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        if tuple(out.placements) != planned:
            self.stats["deviations"] += 1
            if self.stats["deviations"] <= 5:
                log.debug("apply: %s (%s) produced %s, plan says %s; redistributing", n.name, n.target,
                          placement_str(tuple(out.placements)), placement_str(planned))
            out = redistribute(out, self.mesh, planned)
        return out

    def _harmonize(self, vals: list[Any], n: fx.Node) -> list[Any]:
        """Mixed precision: an op whose floating inputs mix dtypes computes in param_dtype.

        The graph was traced in fp32; parameters enter it in bf16, so fp32 values (RoPE
        tables, the fp32 loss branch meeting a bf16 matmul in backward) are cast down
        where they meet bf16 ones. Ops with a single float dtype run as traced (the loss
        stays fp32). The cross-entropy computes in fp32, as the model's `logits.float()` asks:
        bf16 logits are cast up where the loss reads them.
        """
        if n.target in CAST_OPS:
            return vals
        if n.target in FP32_LOSS_OPS:
            return [v.float() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v for v in vals]
        dts = {v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
        if len(dts) <= 1:
            return vals
        pd = self.param_dtype
        return [v.to(pd) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dtype != pd
                and not _keeps_dtype(n.target, v) else v for v in vals]


class TraceTags:
    """Under a trace: each graph node that running a phase-graph node adds gets that node's layer
    (`BLOCK`) and whether it recomputes a forward op in the backward (`RECOMPUTED`), so the
    memory walk can say which block holds the activations and what recomputation does."""

    def __init__(self, tracer: Any, layer_of: dict[str, str], recomputed: set[str]):
        self.graph = tracer.graph
        self.layer_of = layer_of
        self.recomputed = recomputed

    def mark(self) -> fx.Node:
        return next(iter(reversed(self.graph.nodes)))  # iter(): torch < 2.13 returns a list view

    def label(self, marker: fx.Node, n: fx.Node) -> None:
        """Tag what was added after `marker` while `n` ran (a copied block segment keeps its
        template's recomputation flags, set node by node when the template ran)."""
        layer = self.layer_of.get(n.name)
        if layer is None and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            layer = self.layer_of.get(n.args[0].name)
        rec = n.name in self.recomputed
        m = marker.next
        while m.op != "root":  # the graph's sentinel: the end of its node list
            m.meta[BLOCK] = layer
            m.meta.setdefault(RECOMPUTED, rec)
            m = m.next


class PlacementInterpreter(fx.Interpreter):
    """torch.fx.Interpreter over one phase's GraphModule, ops run through `PlacementOps`."""

    def __init__(self, gm: fx.GraphModule, ops: PlacementOps, copies: Any = None, tags: TraceTags | None = None):
        """`copies`: a repeated_blocks.BlockCopies that copies repeated blocks' traced nodes;
        `tags`: labels the traced nodes with their block (the memory walk's)."""
        super().__init__(gm, garbage_collect_values=True)
        self.ops = ops
        self.copies = copies
        self.tags = tags

    def run_node(self, n: fx.Node) -> Any:
        if self.tags is None:
            return self._run_node(n)
        marker = self.tags.mark()
        out = self._run_node(n)
        self.tags.label(marker, n)
        return out

    def _run_node(self, n: fx.Node) -> Any:
        r = self.copies
        if r is not None:
            out = r.value(n, self.env)
            if out is not MISSING:
                return out
        if n.op != "call_function" or n.target is operator.getitem:
            out = super().run_node(n)
        else:
            out = self.ops.run(n, self.env)
        if r is not None:
            r.ran(n, out)
        return out
