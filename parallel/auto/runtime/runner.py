"""PlanRunner: the joint graph of a plan run as a forward phase and a backward phase.

The joint graph is split by torch's partitioner (`T.partition_joint`): the forward graph
returns the loss and the values the backward reads; nodes keep their joint-graph names,
so every node finds its planned strategy by name. Each phase runs in a
`PlacementInterpreter` (interpreter.py). Around them the runner does what a hand-written
recipe does around its model:

  * parameter gathers are bucketed per transformer block (FSDP's unit): the first op of a
    phase that takes one of a block's parameters replicated gathers all of them with one
    flat all-gather per (placement, dtype) group; the backward gathers again
    (`reshard_after_forward`, FSDP's default) or reuses the forward's copies;
  * activation checkpointing: forward nodes are tagged for recomputation by the AC policy
    (parallel/activation_checkpoint.py) before the partition, so the backward graph
    recomputes them (with the same planned placements: nodes keep their names);
  * gradients are reduced to the parameter's own placement, in the reduce dtype of the
    mixed-precision policy, one flat reduce-scatter / all-reduce per group (layout ops
    between a weight-gradient matmul and its output run on the Partial value, so each
    gradient reduction joins its group's bucket);
  * mixed precision: parameters are cast to the compute dtype on their own shard before
    any gather.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate

from parallel import _torch as T
from parallel.activation_checkpoint import recompute_parameter_views, tag_recomputation
from parallel.auto.candidates.placements import flat_bucket_key, join_buckets, spec_placement_strs
from parallel.auto.candidates.strategies import PLACEHOLDER, Candidates
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.runtime.device import place_on_device, runtime_device
from parallel.auto.runtime.interpreter import LAYOUT_OPS, PlacementInterpreter, PlacementOps, TraceTags, is_tensor_node
from parallel.auto.runtime.options import RuntimeOptions
from parallel.auto.runtime.redistribute import bucketed_redistribute, redistribute
from parallel.auto.runtime.repeated_blocks import BlockCopies, BlockLayout, CallCopies, PhaseBlocks
from parallel.auto.trace.blocks import block_indices, block_prefixes
from parallel.auto.trace.joint import FWD, JointGraph

log = logging.getLogger("parallel.auto.runtime")


def resolve_specs(candidates: Candidates, plan: Plan) -> dict[str, Any]:
    """node name -> the OpSpec the plan chose, checked against the plan's placement strings
    (so a replayed plan that does not fit this graph is refused with PlanMismatchError)."""
    gone = [r for r in getattr(plan, "regions", []) if r not in candidates.graph.regions]
    if gone:
        raise PlanMismatchError(
            f"the plan was made with the local_map region(s) {', '.join(map(repr, gone))}, which this model no "
            "longer declares (its traced graph has " + (", ".join(map(repr, candidates.graph.regions)) or "none")
            + "); re-plan")
    missing = [n for n in candidates.nodes if n not in plan.nodes]
    extra = [n for n in plan.nodes if n not in candidates.nodes]
    if missing or extra:
        raise PlanMismatchError(
            f"the plan does not match this model's joint graph: {len(missing)} nodes without a strategy "
            f"(e.g. {missing[:3]}), {len(extra)} unknown plan nodes (e.g. {extra[:3]}); re-plan")
    spec: dict[str, Any] = {}
    for name, c in candidates.nodes.items():
        np_ = plan.nodes[name]
        want = (list(np_.output_placements), list(np_.input_placements))

        def matches(s: Any, placeholder: bool = c.kind == PLACEHOLDER) -> bool:
            outs, ins = spec_placement_strs(s)
            return outs == want[0] and (placeholder or ins == want[1])

        # the plan's index first; by placements when the menus differ (candidates rebuilt
        # from the plan on a seeded mesh hold one strategy per node)
        i = np_.strategy
        found = c.specs[i] if 0 <= i < len(c.specs) and matches(c.specs[i]) else next(
            (s for s in c.specs if matches(s)), None)
        if found is None:
            raise PlanMismatchError(
                f"plan node {name} ({np_.label or np_.target}): no candidate here gives outputs {want[0]} from "
                f"inputs {want[1]} ({len(c.specs)} candidates); the plan was made for a different graph")
        spec[name] = found
    return spec


def merge_small_buckets(pending: dict[tuple, list[tuple[int, tuple]]], grads: list[Any],
                        cap_bytes: int) -> list[tuple[tuple, list[tuple[int, tuple]]]]:
    """Per-block gradient buckets ((block, key, dtype) -> members, in forward order) joined
    by DDP's rule (`placements.join_buckets`, `bucket_cap_mb`) over the gradients' local
    bytes, buckets of one (key, dtype) only. Large blocks keep a bucket each (a transformer
    layer of a real model is far above the cap); small models pay the fixed cost of a
    collective once per few blocks instead of once per block. 0: one bucket per block."""
    blocks = (((key, dtype), members, sum(_local_bytes(grads[i]) for i, _ in members))
              for (_, key, dtype), members in reversed(pending.items()))
    return join_buckets(blocks, cap_bytes)


def _local_bytes(v: Any) -> int:
    local = v.to_local() if isinstance(v, DTensor) else v
    return local.numel() * local.element_size()


def _deferred_layout_ops(bwd: fx.GraphModule, grad_nodes: set[str]) -> set[str]:
    """Layout-only ops between a weight-gradient matmul and its gradient output: they run on
    the Partial value and the gradient is reduced once, bucketed (sum commutes with them)."""
    defer: set[str] = set()
    for n in reversed(list(bwd.graph.nodes)):
        if n.op != "call_function" or n.target not in LAYOUT_OPS:
            continue
        users = list(n.users)
        if users and all(u.op == "output" or u.name in defer for u in users) and (
                n.name in grad_nodes or any(u.name in defer for u in users)):
            defer.add(n.name)
    return defer


def _replicated_param_uses(graph: JointGraph, spec: dict[str, Any]) -> list[str]:
    """Parameter placeholders that some op takes replicated (gathered once per step)."""
    param_nodes = {n.name for n in graph.params.values()}
    out: list[str] = []
    for n in graph.gm.graph.nodes:
        if n.op != "call_function" or n.name not in spec or n.target is operator.getitem:
            continue
        ins = list(spec[n.name].input_specs or [])
        leaves, _ = T.tree_flatten((n.args, dict(n.kwargs)))
        tensors = [a for a in leaves if is_tensor_node(a)]
        for a, s in zip(tensors, ins):
            if a.name in param_nodes and a.name not in out and all(isinstance(p, Replicate) for p in s.placements):
                out.append(a.name)
    return out


COMPILE_FIELDS = ("compile", "compile_fallback", "compile_mode")
"""RuntimeOptions fields that change only how the step graph is run, not the runner or the graph."""


@dataclasses.dataclass(frozen=True)
class PhaseGraphs:
    """The joint graph partitioned into the forward and backward the runner interprets
    (read only: runners of different plans share them), and how many forward nodes the
    backward recomputes."""

    fwd: fx.GraphModule
    bwd: fx.GraphModule
    recomputed: int


PHASE_GRAPHS_KEPT = 4
"""Partitions kept per joint graph (one per activation-checkpointing policy and device in use)."""


def phase_graphs(graph: JointGraph, block_of: dict[str, int], options: RuntimeOptions, device: Any) -> PhaseGraphs:
    """`graph`'s forward and backward for `options`' activation checkpointing on `device`.

    The partition (a second or more on an 8B graph) does not depend on the plan, so it is made
    once per graph and policy and kept on the graph: the memory estimate's rounds, the plans of
    a sweep or mesh search on one trace, and `apply_placement` after an estimate reuse it."""
    if not isinstance(options.reshard_after_forward, bool):  # "auto" is resolved by the plan (plan_options)
        raise ValueError(f"reshard_after_forward {options.reshard_after_forward!r}: a plan runs with true or false")
    policies = options.ac_policies(max(block_of.values(), default=-1) + 1)
    key = (policies, options.reshard_after_forward, str(device))
    hit = graph.phase_graphs.get(key)
    if hit is not None:
        return hit
    forward = [n for n in graph.gm.graph.nodes if graph.phase.get(n.name) == FWD and n.op == "call_function"]
    recomputed = tag_recomputation(forward, block_of, policies)
    if options.reshard_after_forward:  # the backward gathers its parameters again (FSDP)
        params = {n.name for n in graph.params.values()}
        recomputed += recompute_parameter_views(forward, params, block_of)
    n_out = sum(1 for s in graph.slots if s.kind == "output")
    with graph.fake_mode:  # the partitioner's RNG handling asks for the fake mode
        fwd_gm, bwd_gm = T.partition_joint(graph.gm, num_fwd_outputs=n_out)
    for gm in (fwd_gm, bwd_gm):  # the partitioner keeps unused random ops (attention): drop them
        # (no recompile: these graphs are only interpreted, node by node, never called)
        gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output"))
        place_on_device(gm, device, graph.traced_device)
    while len(graph.phase_graphs) >= PHASE_GRAPHS_KEPT:
        graph.phase_graphs.pop(next(iter(graph.phase_graphs)))
    out = graph.phase_graphs[key] = PhaseGraphs(fwd_gm, bwd_gm, recomputed)
    return out


def same_graph_options(a: RuntimeOptions, b: RuntimeOptions) -> bool:
    """Options that build the same runner and step graph (they may differ in compilation)."""
    keep = {f: getattr(a, f) for f in COMPILE_FIELDS}
    return dataclasses.replace(b, **keep) == a


class PlanRunner:
    """Executes the joint graph of `graph` with the placements of `plan` on `mesh`."""

    copy_blocks = True
    """Under a trace, a repeated block's nodes are copies of the first one's (repeated_blocks.py);
    False: every block is interpreted (the graph is the same, made slower)."""

    def __init__(self, graph: JointGraph, candidates: Candidates, plan: Plan, mesh: DeviceMesh,
                 mp_policy: MixedPrecisionPolicy | None = None, options: RuntimeOptions | None = None,
                 local_graphs: bool = True):
        options = options or RuntimeOptions()
        self.options = options
        self.graph = graph
        self.mesh = mesh
        self.device = runtime_device(mesh)  # every value the runtime creates lives here
        self.plan = plan
        self.param_dtype = getattr(mp_policy, "param_dtype", None)
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
        self.spec = resolve_specs(candidates, plan)
        self.out_slots = [s for s in graph.slots if s.kind == "output"]
        self.grad_slots = {s.of: s for s in graph.slots if s.kind == "grad_param"}
        self.input_grad_slots = {s.of: s for s in graph.slots if s.kind == "grad_input" and s.node is not None}
        self.param_names = list(graph.params)
        self.buffer_names = list(graph.buffers)
        self.input_nodes = list(graph.inputs)
        self.block_of = block_indices(graph)
        phases = phase_graphs(graph, self.block_of, options, self.device)
        self.fwd_gm, self.bwd_gm, self.recomputed = phases.fwd, phases.bwd, phases.recomputed
        self.saved_names = [a.name for a in self.fwd_gm.graph.output_node().args[0][len(self.out_slots):]]
        bucket = self.bucket = options.bucket
        self.reshard_after_forward = options.reshard_after_forward
        grad_nodes = {s.node.name for s in self.grad_slots.values() if s.node is not None}
        self.gather_params = _replicated_param_uses(graph, self.spec) if bucket else []
        self.ops = PlacementOps(mesh, self.spec, self.param_dtype,
                                _deferred_layout_ops(self.bwd_gm, grad_nodes) if bucket else set(),
                                # a parameter outside the blocks (embedding, head) is a bucket of its own:
                                # gathered or reduced with another, it would wait for that one's use
                                {name: self.block_of.get(name, name) for name in self.gather_params},
                                load_balance=options.load_balance)
        # per-device graphs (local_graphs.py), built on the first call; False: interpret eagerly
        self.use_local_graphs = local_graphs
        self.local_graphs_cache: dict[Any, Any] = {}
        self._block_layout: BlockLayout | None = None
        self._phase_blocks: dict[str, PhaseBlocks] = {}
        self.block_copy_counts: Counter = Counter()  # segments copied / traced per phase, last trace
        self._layer_of: dict[str, str] | None = None  # node name -> its block's layer (trace labels)

    def _block_copies(self, phase: str) -> BlockCopies | None:
        """The phase's block copier when a trace is running (None: interpret every node)."""
        if not self.copy_blocks or T.active_tracer() is None:
            return None
        blocks = self._phase_blocks.get(phase)
        if blocks is None:
            if self._block_layout is None:
                self._block_layout = BlockLayout(self.graph.gm, self.block_of,
                                                 {n.name for n in self.graph.params.values()})
            gm = self.fwd_gm if phase == "fwd" else self.bwd_gm
            blocks = self._phase_blocks[phase] = PhaseBlocks(gm, self._block_layout, self.spec, self.ops.defer)
        return BlockCopies(blocks, self.ops, self.mesh)

    def ac_by_layer(self) -> dict[str, str]:
        """Layer ('layers.3') -> its block's activation checkpointing choice (`AC_CHOICES`)."""
        policies = self.options.ac_policies(max(self.block_of.values(), default=-1) + 1)
        if self._layer_of is None:
            self._layer_of = block_prefixes(self.graph)
        return {layer: policies[self.block_of[name]] for name, layer in self._layer_of.items() if name in self.block_of}

    def _trace_tags(self, phase: str) -> TraceTags | None:
        """Under a trace, the block and recomputation labels of the traced nodes (a backward
        node named as a forward one recomputes it)."""
        tracer = T.active_tracer()
        if tracer is None:
            return None
        if self._layer_of is None:
            self._layer_of = block_prefixes(self.graph)
        recomputed = set() if phase == "fwd" else {
            n.name for n in self.bwd_gm.graph.nodes if n.op == "call_function" and self.graph.phase.get(n.name) == FWD}
        return TraceTags(tracer, self._layer_of, recomputed)

    def _interpret(self, phase: str, args: list[Any]) -> Any:
        gm = self.fwd_gm if phase == "fwd" else self.bwd_gm
        copies = self._block_copies(phase)
        with torch.no_grad():
            results = PlacementInterpreter(gm, self.ops, copies, self._trace_tags(phase)).run(*args)
        if copies is not None:
            self.block_copy_counts[f"{phase}_copied"] = copies.copied
            self.block_copy_counts[f"{phase}_refused"] = copies.refused
        return results

    @property
    def stats(self) -> Counter:
        """Counters of the run: redistributions, deviations from the plan, bucketed collectives."""
        return self.ops.stats

    def out_placements(self, name: str, idx: int | None = None) -> tuple:
        return self.ops.out_placements(name, idx)

    def param_placements(self, fqn: str) -> tuple:
        return self.out_placements(self.graph.params[fqn].name)

    def input_placements(self, i: int) -> tuple:
        return self.out_placements(self.input_nodes[i].name)

    def to_placements(self, x: Any, placements: tuple) -> Any:
        return self.ops.to_placements(x, placements)

    # -- forward ---------------------------------------------------------------
    def run_forward(self, params: list[DTensor], buffers: list[Any], inputs: list[DTensor]) -> tuple[list[Any], dict]:
        """(planned outputs, saved values for `run_backward`) of one forward."""
        g = self.graph
        env: dict[str, Any] = {}
        for fqn, p in zip(self.param_names, params):
            v = p.detach()
            if self.param_dtype is not None and v.dtype.is_floating_point and v.dtype != self.param_dtype:
                v = v.to(self.param_dtype)  # cast the shard before any gather
            env[g.params[fqn].name] = v
        for fqn, b in zip(self.buffer_names, buffers):
            name = g.buffers[fqn].name
            env[name] = self.to_placements(b, self.out_placements(name))
        for node, x in zip(self.input_nodes, inputs):
            env[node.name] = x
        self.ops.param_values = {name: env[name] for name in self.gather_params}
        self.ops.cache = {}
        args = [env[n.name] for n in self.fwd_gm.graph.find_nodes(op="placeholder")]
        results = self._interpret("fwd", args)
        n_out = len(self.out_slots)
        outs = [self.to_placements(v, self.out_placements(f"output[{s.index}]"))
                for v, s in zip(results[:n_out], self.out_slots)]
        saved = dict(zip(self.saved_names, results[n_out:]))
        saved["__cache__"], self.ops.cache = self.ops.cache, {}
        return outs, saved

    # -- backward --------------------------------------------------------------
    def run_backward(self, saved: dict, tangents: list[Any], params: list[Any], reduce: bool = True,
                     input_grads: list | None = None) -> list[Any]:
        """Gradients of the parameters (None where none), at the parameters' placements;
        `reduce=False`: as the backward leaves them (a weight gradient of a batch-sharded
        matmul is Partial), in the dtype they are summed in (`accumulation_dtype`), for a
        gradient accumulation that reduces once per step (`reduce_grads`). `input_grads`: a
        list to fill with the inputs' gradients at the inputs' placements (None where an input
        has none): a pipeline stage's backward hands them to the stage before it."""
        env = dict(saved)
        cache = env.pop("__cache__", {})
        self.ops.cache = {} if self.reshard_after_forward else cache
        self.ops.param_values = {name: env[name] for name in self.gather_params if name in env}
        for out_idx, t in self.graph.output_tangents:
            val = tangents[out_idx] if out_idx < len(tangents) else None
            if val is None:
                val = torch.zeros(t.meta["val"].shape, dtype=t.meta["val"].dtype, device=self.device)
            env[t.name] = self.to_placements(val, self.out_placements(t.name))
        args = [env[n.name] for n in self.bwd_gm.graph.find_nodes(op="placeholder")]
        results = self._interpret("bwd", args)
        self.ops.cache, self.ops.param_values = {}, {}
        by_slot = dict(zip([s.index for s in self.graph.slots if s.kind != "output"], results))
        values = [by_slot.get(s.index) if s is not None else None
                  for s in (self.grad_slots.get(fqn) for fqn in self.param_names)]
        if input_grads is not None:
            input_grads.extend(self._input_grads(by_slot))
        if not reduce:
            return [v if v is None or not v.dtype.is_floating_point else v.to(self.accumulation_dtype(p))
                    for v, p in zip(values, params)]
        return self.reduce_grads(values, params)

    def _input_grads(self, by_slot: dict[int, Any]) -> list[Any]:
        """Each user input's gradient from the backward's results, at the input's placement."""
        out: list[Any] = []
        for i in range(len(self.input_nodes)):
            s = self.input_grad_slots.get(i)
            v = by_slot.get(s.index) if s is not None else None
            if v is not None and tuple(v.placements) != self.input_placements(i):
                v = redistribute(v, self.mesh, self.input_placements(i))
            out.append(v)
        return out

    def accumulation_dtype(self, param: Any) -> torch.dtype:
        """The dtype unreduced gradients are summed in over micro-batches: the reduce dtype of
        the mixed-precision policy, else the parameter's (its fp32 master weight's), not the
        compute dtype (bf16 sums of many micro-batches lose bits)."""
        return self.reduce_dtype or param.dtype

    def _in_reduce_dtype(self, v: Any) -> Any:
        """A gradient in the reduce dtype of the mixed-precision policy (reduced in it)."""
        if self.reduce_dtype is not None and v.dtype != self.reduce_dtype and v.dtype.is_floating_point:
            return v.to(self.reduce_dtype)
        return v

    def reduce_grads(self, values: list[Any], params: list[Any]) -> list[Any]:
        """Each parameter's gradient (`values`, in `param_names` order, None where none) reduced
        to the parameter's placement: one bucketed collective per block and placement group."""
        grads: list[Any] = []
        pending: dict[tuple, list[tuple[int, tuple]]] = {}  # (bucket key, dtype) -> (index, target)
        # under a trace, a call of a kind already traced (a later block's bucket, a later layer's
        # gradient of the same shape and layout) is a copy of the first one's nodes
        calls = CallCopies(self.mesh) if self.copy_blocks else None
        for fqn, v in zip(self.param_names, values):
            s = self.grad_slots.get(fqn)
            if v is None or s is None:
                grads.append(None)
                continue
            dst = self.out_placements(f"output[{s.index}]")
            key = (flat_bucket_key(v.shape, tuple(v.placements), dst, tuple(self.mesh.shape))
                   if self.bucket and tuple(v.placements) != dst else None)
            if key is not None:  # one bucket per block, as the gathers
                v = self._in_reduce_dtype(v)
                block = self.block_of.get(self.graph.params[fqn].name, fqn)
                pending.setdefault((block, key, v.dtype), []).append((len(grads), dst))
            else:
                if tuple(v.placements) != dst:
                    self.stats["redistributions"] += 1
                def reduce(v: Any = v, dst: tuple = dst) -> list[Any]:
                    return [redistribute(self._in_reduce_dtype(v), self.mesh, dst)]

                v = (calls(("grad", dst), reduce, [v]) if calls is not None else reduce())[0]
            grads.append(v)
        for (key, dtype), members in merge_small_buckets(pending, grads, self.options.reduce_bucket_bytes):
            # one collective per bucket and mesh axis
            self.stats["bucketed_grad_reductions"] += 1
            idx = [i for i, _ in members]
            items, dsts = [grads[i] for i in idx], [d for _, d in members]
            reduced = calls(("grad bucket", key, dtype, tuple(dsts)),
                            lambda items=items, dsts=dsts: bucketed_redistribute(items, dsts, self.mesh), items) \
                if calls is not None else bucketed_redistribute(items, dsts, self.mesh)
            for i, r in zip(idx, reduced):
                grads[i] = r
        if calls is not None:
            self.block_copy_counts["grad_reductions_copied"] = calls.copied
        for i, (v, p) in enumerate(zip(grads, params)):
            if v is None:
                continue
            if v.dtype != p.dtype:
                v = v.to(p.dtype)
            if tuple(v.placements) != tuple(p.placements):
                v = redistribute(v, self.mesh, tuple(p.placements))
            grads[i] = v
        return grads
