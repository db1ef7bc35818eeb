"""Stage 2: JointGraph + mesh -> Candidates (valid strategies per node).

Strategies come from DTensor's own sharding propagation rules, so every candidate is
semantically valid by construction:
  * single-dim rules (mm, add, mul, embedding, ...): placeholders expanded to Shard(d)
    here and expanded over the mesh with `expand_to_full_mesh_op_strategy`;
  * op-strategy functions (view, t, sum, log_softmax, nll_loss, ...): called once per
    candidate input placement, merged and de-duplicated;
  * otherwise DTensor's decomposition fallback; and if everything fails, replicate-only
    (counted in the coverage report).
Enumeration is cached by (op, input shapes/dtypes, static args): transformer layers repeat.

Besides ATen ops there are three node kinds: placeholders (params, buffers, inputs,
tangents) get every evenly-divisible placement; getitem picks one output of a tuple;
and one virtual "slot" per graph output (loss, gradients) where the output placement is
decided, so a Partial gradient can be reduce-scattered or all-reduced into it.
"""

from __future__ import annotations

import logging
import operator
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from torch.distributed.tensor import Replicate, Shard
from parallel import _torch as T
from parallel.auto.placements import (
    Placements,
    evenly_divisible,
    strategy_key,
    tensor_placements,
)
from parallel.auto.trace import JointGraph

log = logging.getLogger(__name__)


PLACEHOLDER = "placeholder"
OP = "op"
GETITEM = "getitem"
SLOT = "slot"


@dataclass
class NodeCandidates:
    """All candidate strategies of one node.

    specs[i].input_specs[k] is the placement strategy i expects for `inputs[k]`
    (an fx node; for getitem/slot nodes the single input is the producer) and
    specs[i].output_specs the placement(s) it produces (a tuple for multi-output ops).
    `input_index[k]` is the output index of inputs[k] consumed (for tuple producers via
    getitem it is None: getitem nodes consume `output_specs[idx]` of their producer).
    """

    name: str
    kind: str  # placeholder | op | getitem | slot
    node: fx.Node | None  # None for slots
    inputs: list[fx.Node]
    specs: list[Any]  # list[OpSpec]
    key: Any = None  # enumeration cache key (shared by identical ops)
    source: str = ""  # rule family: single_dim | strategy_func | decomp | replicate_fallback | ...
    getitem_index: int | None = None
    slot_index: int | None = None

    def output_placements(self, i: int) -> Placements:
        spec = self.specs[i].output_specs
        if isinstance(spec, tuple):
            raise TypeError(f"{self.name} has several outputs; use output_placements_at")
        return spec.placements

    def output_spec_at(self, i: int, idx: int | None) -> Any:
        spec = self.specs[i].output_specs
        if isinstance(spec, tuple):
            return spec[idx or 0]
        return spec

    def input_placements(self, i: int, k: int) -> Placements:
        return self.specs[i].input_specs[k].placements


@dataclass
class CoverageReport:
    """Ops whose strategies fell back to replicate-only or failed."""

    fallback: dict[str, str] = field(default_factory=dict)  # op -> reason
    # replicate-only by design: constants built without data inputs (causal masks,
    # scalars) are recomputed on every rank; sharding them would save nothing
    explained: dict[str, str] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)  # op -> number of nodes
    dropped_strided: int = 0
    dropped_uneven: int = 0

    @property
    def ok(self) -> bool:
        return not self.fallback

    def __str__(self) -> str:
        lines = []
        if not self.fallback:
            lines.append("coverage: every op has DTensor sharding strategies")
        else:
            lines.append("coverage: ops with replicate-only strategies:")
            for op, why in sorted(self.fallback.items()):
                lines.append(f"  {op} ({self.counts[op]} nodes): {why}")
        for op, why in sorted(self.explained.items()):
            lines.append(f"  (explained) {op}: {why}")
        return "\n".join(lines)


@dataclass
class Candidates:
    """Per-node candidate strategies for one joint graph on one mesh."""

    graph: JointGraph
    mesh: Any  # DeviceMesh
    nodes: dict[str, NodeCandidates]  # name -> candidates, in topological order (slots last)
    coverage: CoverageReport
    unique_keys: int
    seconds: float

    def __getitem__(self, name: str) -> NodeCandidates:
        return self.nodes[name]

    def summary(self) -> str:
        n_specs = sum(len(c.specs) for c in self.nodes.values())
        return (
            f"Candidates: {len(self.nodes)} nodes, {n_specs} strategies, "
            f"{self.unique_keys} unique op keys, {self.seconds:.2f}s"
        )


# ---------------------------------------------------------------------------
# Placement enumeration
# ---------------------------------------------------------------------------


def _meta(val: torch.Tensor) -> Any:
    return T.TensorMeta(shape=val.shape, stride=val.stride(), dtype=val.dtype)


def _spec(mesh: Any, placements: Placements, meta: Any) -> Any:
    return T.DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def _out_meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return _meta(val)
    if isinstance(val, (tuple, list)):
        return tuple(_meta(v) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _multi(meta: Any) -> bool:
    """True for a tuple of output metas (TensorMeta itself is a NamedTuple)."""
    return isinstance(meta, tuple) and not isinstance(meta, T.TensorMeta)


def _is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


# ---------------------------------------------------------------------------
# Op enumeration from DTensor rules
# ---------------------------------------------------------------------------


class _Enumerator:
    def __init__(self, mesh: Any):
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.prop = T.sharding_propagator()
        self.cache: dict[Any, tuple[list[Any], str, str | None]] = {}
        self.coverage = CoverageReport()

    # -- keys -------------------------------------------------------------
    def key(self, node: fx.Node) -> Any:
        def conv(a: Any) -> Any:
            if isinstance(a, fx.Node):
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
                return ("V", repr(v))
            if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
                return str(a)
            return a

        args = T.tree_map(conv, node.args)
        kwargs = tuple(sorted((k, T.tree_map(conv, v)) for k, v in node.kwargs.items()))
        try:
            k = (node.target, args, kwargs)
            hash(k)
            return k
        except TypeError:
            return (node.target, repr(args), repr(kwargs))

    # -- schema building --------------------------------------------------
    def _schema(self, node: fx.Node, placements: list[Placements]) -> Any:
        """OpSchema with each tensor input an OpStrategy holding one spec."""
        it = iter(placements)

        def conv(a: Any) -> Any:
            if _is_tensor_node(a):
                return T.OpStrategy([T.OpSpec(_spec(self.mesh, next(it), _meta(a.meta["val"])))])
            if isinstance(a, fx.Node):
                return a.meta.get("val")
            return a

        def top(a: Any) -> Any:
            if isinstance(a, (list, tuple)) and a and all(_is_tensor_node(x) for x in a):
                return T.TupleStrategy([conv(x) for x in a])  # tensor lists (cat, stack)
            return T.tree_map(conv, a)

        args = [top(a) for a in node.args]
        kwargs = {k: top(v) for k, v in node.kwargs.items()}
        op = node.target
        schema_info = self.prop.op_to_schema_info.get(op) or self.prop.op_to_schema_info_for_single_dim_strategy.get(op)
        return T.OpSchema(op, tuple(args), kwargs, schema_info=schema_info)

    @staticmethod
    def tensor_inputs(node: fx.Node) -> list[fx.Node]:
        leaves, _ = T.tree_flatten((node.args, dict(node.kwargs)))
        return [a for a in leaves if _is_tensor_node(a)]

    # -- enumeration ------------------------------------------------------
    def enumerate(self, node: fx.Node) -> tuple[list[Any], str]:
        key = self.key(node)
        hit = self.cache.get(key)
        if hit is None:
            hit = self._enumerate_uncached(node)
            self.cache[key] = hit
        specs, source, why = hit
        self.record_fallback(node, why)
        return specs, source

    def record_fallback(self, node: fx.Node, why: str | None) -> None:
        """Count a node whose op fell back (replicate-only or failed) in the coverage report."""
        if why is not None:
            name = str(node.target)
            self.coverage.fallback.setdefault(name, why)
            self.coverage.counts[name] += 1

    def _enumerate_uncached(self, node: fx.Node) -> tuple[list[Any], str, str | None]:
        op = node.target
        inputs = self.tensor_inputs(node)
        in_metas = [_meta(a.meta["val"]) for a in inputs]
        out_meta = _out_meta(node.meta.get("val"))
        errors: list[str] = []
        specs: list[Any] = []
        source = ""
        if op in self.prop.op_single_dim_strategy_funcs:
            source = "single_dim"
            try:
                specs = self._single_dim(node, inputs, out_meta)
            except Exception as e:  # noqa: BLE001 - report, then try the next family
                errors.append(f"single-dim rule: {type(e).__name__}: {e}"[:200])
        if not specs and op in self.prop.op_strategy_funcs:
            source = "strategy_func"
            specs, err = self._strategy_func(node, inputs)
            if err:
                errors.append(err)
        if not specs and op not in self.prop.op_single_dim_strategy_funcs and op not in self.prop.op_strategy_funcs:
            source = "decomp"
            try:
                specs = self._decomp(node, inputs)
            except Exception as e:  # noqa: BLE001
                errors.append(f"decomposition: {type(e).__name__}: {e}"[:200])
        specs = self._finalize(specs, in_metas, out_meta)
        if not specs or all(self._all_replicate(s) for s in specs):
            why = "; ".join(errors) if errors else "no sharding rule"
            return self._replicate_only(node, in_metas, out_meta), "replicate_fallback", why
        return specs, source, None

    @staticmethod
    def _all_replicate(spec: Any) -> bool:
        outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        all_specs = [s for s in outs if s is not None] + list(spec.input_specs or [])
        return all(isinstance(p, Replicate) for s in all_specs for p in s.placements)

    def _replicate_only(self, node: fx.Node, in_metas: list[Any], out_meta: Any) -> list[Any]:
        rep = tuple(Replicate() for _ in self.mesh_shape)
        if _multi(out_meta):
            outs = tuple(_spec(self.mesh, rep, m) if m is not None else None for m in out_meta)
        else:
            outs = _spec(self.mesh, rep, out_meta)
        return [T.OpSpec(outs, [_spec(self.mesh, rep, m) for m in in_metas])]

    def _single_dim(self, node: fx.Node, inputs: list[fx.Node], out_meta: Any) -> list[Any]:
        op = node.target
        info = self.prop.op_single_dim_strategy_funcs[op]
        rep = tuple(Replicate() for _ in self.mesh_shape)
        schema = self._schema(node, [rep] * len(inputs))
        func = info.func if isinstance(info, T.SingleDimStrategyInfo) else info
        rules = func(op, schema.args_meta, schema.kwargs_meta)
        n_in = len(inputs)
        n_out = len(rules[0]) - n_in if rules else (len(out_meta) if _multi(out_meta) else 1)
        filled: list[list[Any]] = []
        seen = set()
        rep_rule = [Replicate()] * (n_out + n_in)
        if _multi(out_meta):
            for i, m in enumerate(out_meta):
                if m is None and i < n_out:
                    rep_rule[i] = None
        for r in [rep_rule] + list(rules):
            rr = [Shard(p.dim) if isinstance(p, T.ShardingPlaceholder) else p for p in r]
            k = tuple(repr(p) for p in rr)
            if k not in seen:
                seen.add(k)
                filled.append(rr)
        strat = T.expand_to_full_mesh_op_strategy(
            self.mesh, schema, filled, output_tensor_meta=out_meta, input_index=n_out
        )
        return list(strat.strategies)

    def _strategy_func(self, node: fx.Node, inputs: list[fx.Node]) -> tuple[list[Any], str | None]:
        func = self.prop.op_strategy_funcs[node.target]
        rep = tuple(Replicate() for _ in self.mesh_shape)
        combos: list[list[Placements]] = []
        for k, a in enumerate(inputs):
            shape = tuple(a.meta["val"].shape)
            for p in tensor_placements(shape, self.mesh_shape, partial=True):
                c = [rep] * len(inputs)
                c[k] = p
                combos.append(c)
        if not inputs:
            combos.append([])
        specs: list[Any] = []
        last_err = None
        for c in combos:
            try:
                schema = self._schema(node, c)
                strat = func(schema)
            except Exception as e:  # noqa: BLE001 - invalid combination for this op
                last_err = f"strategy function: {type(e).__name__}: {e}"[:200]
                continue
            if isinstance(strat, T.TupleStrategy):
                return [], "returns a TupleStrategy (unsupported)"
            specs.extend(strat.strategies)
        return specs, (None if specs else last_err)

    def _decomp(self, node: fx.Node, inputs: list[fx.Node]) -> list[Any]:
        ds = self.prop.decomp_strategy
        if not hasattr(ds, "has_decomp") or not ds.has_decomp(node.target):
            raise RuntimeError("no sharding rule and no decomposition")
        ds.ensure_schema_info(node.target)
        specs: list[Any] = []
        rep = tuple(Replicate() for _ in self.mesh_shape)
        for k, a in enumerate(inputs):
            for p in tensor_placements(tuple(a.meta["val"].shape), self.mesh_shape):
                c = [rep] * len(inputs)
                c[k] = p
                strat = ds.propagate_strategy(self._schema(node, c))
                if isinstance(strat, T.OpStrategy):
                    specs.extend(strat.strategies)
        return specs

    def _finalize(self, specs: list[Any], in_metas: list[Any], out_meta: Any) -> list[Any]:
        """Fill tensor metas, drop uneven/strided strategies, de-duplicate, stable order."""
        out: list[Any] = []
        seen: set = set()
        for s in specs:
            outs = s.output_specs
            ins = s.input_specs
            if ins is None:  # "follow the output" convention
                ins = [outs] * len(in_metas)
            if len(ins) != len(in_metas):
                continue
            if _multi(out_meta):
                if not isinstance(outs, tuple):
                    outs = tuple(outs if m is not None else None for m in out_meta)
                new_outs = tuple(
                    _spec(self.mesh, o.placements, m) if (o is not None and m is not None) else None
                    for o, m in zip(outs, out_meta)
                )
            else:
                if isinstance(outs, tuple):
                    outs = outs[0]
                new_outs = _spec(self.mesh, outs.placements, out_meta)
            new_ins = [_spec(self.mesh, i.placements, m) for i, m in zip(ins, in_metas)]
            all_specs = [new_outs] if not isinstance(new_outs, tuple) else [o for o in new_outs if o is not None]
            all_specs = all_specs + new_ins
            bad = False
            for sp in all_specs:
                if any(isinstance(p, T.StridedShard) for p in sp.placements):
                    self.coverage.dropped_strided += 1
                    bad = True
                    break
                if not evenly_divisible(tuple(sp.tensor_meta.shape), sp.placements, self.mesh_shape):
                    self.coverage.dropped_uneven += 1
                    bad = True
                    break
            if bad:
                continue
            k = strategy_key(T.OpSpec(new_outs, new_ins))
            if k in seen:
                continue
            seen.add(k)
            out.append(T.OpSpec(new_outs, new_ins))
        return out


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------


CONSTANT_REASON = "constant built without data inputs (causal mask, scalar): replicated on every rank by design"


def build_candidates(graph: JointGraph, mesh: Any, restrict: dict[str, list[tuple]] | None = None) -> Candidates:
    """Enumerate the candidate strategies of every node of `graph` on `mesh`.

    `restrict` (split-dimension seeding, solve/seed.py): node name -> the only strategy
    keys (output placements, input placements per tensor input) that node may take; the
    full product over the mesh is then never expanded for it (see `_restricted_specs`).
    """
    T.register_planner_ops()
    t0 = time.perf_counter()
    en = _Enumerator(mesh)
    mesh_shape = tuple(mesh.shape)
    rep = tuple(Replicate() for _ in mesh_shape)
    nodes: dict[str, NodeCandidates] = {}
    placeholder_cache: dict[Any, list[Any]] = {}
    constants: set[str] = set()  # nodes computed from no data input at all

    def placeholder_specs(val: torch.Tensor, shard: bool = True) -> list[Any]:
        key = (tuple(val.shape), tuple(val.stride()), val.dtype, shard)
        if key not in placeholder_cache:
            meta = _meta(val)
            pls = tensor_placements(tuple(val.shape), mesh_shape) if shard else [rep]
            placeholder_cache[key] = [T.OpSpec(_spec(mesh, p, meta), []) for p in pls]
        return placeholder_cache[key]

    for n in graph.gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta["val"]
            shard = val.ndim > 0
            if restrict and n.name in restrict and shard:
                specs = _restricted_placeholder(mesh, val, restrict[n.name], placeholder_cache)
                nodes[n.name] = NodeCandidates(n.name, PLACEHOLDER, n, [], specs, key=None, source=PLACEHOLDER)
                continue
            nodes[n.name] = NodeCandidates(n.name, PLACEHOLDER, n, [], placeholder_specs(val, shard), key=None, source=PLACEHOLDER)
        elif n.op == "call_function" and n.target is operator.getitem:
            src, idx = n.args[0], n.args[1]
            prod = nodes[src.name]
            seen: dict[Any, Any] = {}
            for s in prod.specs:
                o = s.output_specs[idx] if isinstance(s.output_specs, tuple) else s.output_specs
                if o is None or o.placements in seen:
                    continue
                seen[o.placements] = T.OpSpec(_spec(mesh, o.placements, o.tensor_meta), [_spec(mesh, o.placements, o.tensor_meta)])
            nodes[n.name] = NodeCandidates(n.name, GETITEM, n, [src], list(seen.values()), source=GETITEM, getitem_index=idx)
        elif n.op == "call_function" and isinstance(n.target, T.OpOverload):
            val = n.meta.get("val")
            if not isinstance(val, (torch.Tensor, tuple, list)):
                raise NotImplementedError(f"node {n.name} ({n.target}) has a non-tensor output {type(val)}")
            ins = en.tensor_inputs(n)
            if all(a.name in constants for a in ins):
                constants.add(n.name)
                en.coverage.explained[str(n.target)] = CONSTANT_REASON
                specs = en._replicate_only(n, [_meta(a.meta["val"]) for a in ins], _out_meta(val))
                nodes[n.name] = NodeCandidates(n.name, OP, n, ins, specs, key=en.key(n), source="constant")
                continue
            if restrict and n.name in restrict:
                specs, source = _restricted_specs(en, n, restrict[n.name])
                nodes[n.name] = NodeCandidates(n.name, OP, n, en.tensor_inputs(n), specs, key=en.key(n), source=source)
                continue
            specs, source = en.enumerate(n)
            nodes[n.name] = NodeCandidates(n.name, OP, n, en.tensor_inputs(n), specs, key=en.key(n), source=source)
        elif n.op == "output":
            continue
        else:
            raise NotImplementedError(f"unsupported node {n.name}: {n.op} {n.target}")

    for slot in graph.slots:
        if slot.node is None:
            continue
        val = slot.node.meta["val"]
        name = f"output[{slot.index}]"
        if restrict and name in restrict and val.ndim > 0:
            specs = _restricted_placeholder(mesh, val, restrict[name], placeholder_cache)
        elif slot.kind == "grad_param":
            specs = placeholder_specs(val)  # same menu as the parameter itself
        elif val.ndim == 0:
            specs = placeholder_specs(val, shard=False)
        else:
            specs = placeholder_specs(val)
        nodes[name] = NodeCandidates(
            name, SLOT, None, [slot.node], [T.OpSpec(s.output_specs, [s.output_specs]) for s in specs], source=SLOT, slot_index=slot.index
        )
    cands = Candidates(graph, mesh, nodes, en.coverage, len(en.cache), time.perf_counter() - t0)
    log.info("candidates: %s", cands.summary())
    if not en.coverage.ok:
        log.info("%s", en.coverage)
    return cands


# ---------------------------------------------------------------------------
# Seeded (restricted) enumeration, for split-dimension seeding (solve/seed.py;
# owner: scalable-solver helper). Only the given strategy keys are built, so a 3-4D
# mesh never expands the (1 + n)^D product of placements.
# ---------------------------------------------------------------------------


def _restricted_placeholder(mesh: Any, val: torch.Tensor, keys: list[tuple], cache: dict) -> list[Any]:
    mesh_shape = tuple(mesh.shape)
    outs = tuple(dict.fromkeys(k[0] for k in keys))
    ck = ("restricted", tuple(val.shape), tuple(val.stride()), val.dtype, outs)
    if ck not in cache:
        meta = _meta(val)
        cache[ck] = [T.OpSpec(_spec(mesh, p, meta), []) for p in outs if evenly_divisible(tuple(val.shape), p, mesh_shape)]
    return cache[ck]


def _restricted_specs(en: _Enumerator, node: fx.Node, keys: list[tuple]) -> tuple[list[Any], str]:
    """The strategies of `node` whose (output, inputs) placements are among `keys`.

    Single-dim rules expand over the mesh as a per-axis product (what
    `expand_to_full_mesh_op_strategy` does), so their strategies are built directly from
    the keys; strategy-function and decomposition rules are asked once per distinct
    input placement of the keys and only their answers inside `keys` are kept. Nothing
    left -> replicate-only (counted in the coverage report).
    """
    # by identity: seeding hands identical balls out as one shared list, alive for the whole build
    ck = ("restricted", en.key(node), id(keys), len(keys))
    hit = en.cache.get(ck)
    if hit is None:
        hit = _restricted_uncached(en, node, keys)
        en.cache[ck] = hit
    specs, source, why = hit
    en.record_fallback(node, why)
    return specs, source


def _restricted_uncached(en: _Enumerator, node: fx.Node, keys: list[tuple]) -> tuple[list[Any], str, str | None]:
    op = node.target
    inputs = en.tensor_inputs(node)
    in_metas = [_meta(a.meta["val"]) for a in inputs]
    out_meta = _out_meta(node.meta.get("val"))
    mesh = en.mesh
    wanted = set(keys)
    specs: list[Any] = []
    source = ""
    errors: list[str] = []
    if op in en.prop.op_single_dim_strategy_funcs:
        source = "single_dim"
        for o, ins in keys:
            if len(ins) != len(in_metas):
                continue
            if _multi(out_meta):
                outs = tuple(_spec(mesh, p, m) if (p is not None and m is not None) else None for p, m in zip(o, out_meta))
            else:
                outs = _spec(mesh, o, out_meta)
            specs.append(T.OpSpec(outs, [_spec(mesh, p, m) for p, m in zip(ins, in_metas)]))
    else:
        if op in en.prop.op_strategy_funcs:
            source = "strategy_func"
            func = en.prop.op_strategy_funcs[op]
        else:
            source = "decomp"
            ds = en.prop.decomp_strategy
            if hasattr(ds, "has_decomp") and ds.has_decomp(op):
                ds.ensure_schema_info(op)
                func = ds.propagate_strategy
            else:
                func = None
                errors.append("no sharding rule and no decomposition")
        if func is not None:
            for ins in dict.fromkeys(k[1] for k in keys):
                try:
                    strat = func(en._schema(node, list(ins)))
                except Exception as e:  # noqa: BLE001 - invalid combination for this op
                    errors.append(f"{source}: {type(e).__name__}: {e}"[:200])
                    continue
                if isinstance(strat, T.OpStrategy):
                    specs.extend(strat.strategies)
    specs = en._finalize(specs, in_metas, out_meta)
    specs = [s for s in specs if strategy_key(s) in wanted]
    # stable order: the order of `keys`
    order = {k: i for i, k in enumerate(keys)}
    specs.sort(key=lambda s: order[strategy_key(s)])
    if not specs:
        why = "; ".join(errors[-1:]) if errors else "no strategy inside the seeded Hamming ball"
        return en._replicate_only(node, in_metas, out_meta), "replicate_fallback", why
    return specs, source, None
