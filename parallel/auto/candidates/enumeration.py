"""Candidate strategies of one op from DTensor's own sharding-propagation rules.

Every candidate is semantically valid by construction:
  * single-dim rules (mm, add, mul, embedding, ...): placeholders expanded to Shard(d)
    here and expanded over the mesh with `expand_to_full_mesh_op_strategy`;
  * op-strategy functions (view, t, sum, log_softmax, nll_loss, ...): called once per
    candidate input placement, merged and de-duplicated;
  * otherwise DTensor's decomposition fallback; and if everything fails, replicate-only
    (counted in the coverage report).
Enumeration is cached by (op, input shapes/dtypes, static args): transformer layers repeat.
`restricted` builds only given strategy keys (split-dimension seeding on 3-4-D meshes,
solve/seed.py), so the (1 + n)^D product of placements is never expanded.
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from parallel import _torch as T
from parallel.auto.candidates.placements import Placements, evenly_divisible, strategy_key, tensor_placements


def tensor_meta(val: torch.Tensor) -> Any:
    return T.TensorMeta(shape=val.shape, stride=val.stride(), dtype=val.dtype)


_SPEC_TEMPLATES: dict[tuple, Any] = {}  # (mesh id, placements, meta) -> a spec to copy
_SPEC_TEMPLATES_MAX = 200_000


def make_spec(mesh: DeviceMesh, placements: Placements, meta: Any) -> Any:
    """A new DTensorSpec: a shallow copy of the first one made for these arguments. Seeding a
    4-D mesh makes ~2*10^5 specs; DTensorSpec's __post_init__ (shard order, checks) costs
    ~14 µs each, a copy ~2 µs. Copies, not one shared spec: DTensor sets fields of the
    specs it is handed (`tensor_meta` of a strategy's outputs)."""
    placements = tuple(placements)
    key = (id(mesh), placements, meta)
    try:
        tpl = _SPEC_TEMPLATES.get(key)
    except TypeError:  # an unhashable meta: no template
        return T.DTensorSpec(mesh, placements, tensor_meta=meta)
    if tpl is None or tpl.mesh is not mesh:
        if len(_SPEC_TEMPLATES) >= _SPEC_TEMPLATES_MAX:
            _SPEC_TEMPLATES.clear()
        tpl = _SPEC_TEMPLATES[key] = T.DTensorSpec(mesh, placements, tensor_meta=meta)
    return copy.copy(tpl)


def out_meta_of(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return tensor_meta(val)
    if isinstance(val, (tuple, list)):
        return tuple(tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def is_multi(meta: Any) -> bool:
    """True for a tuple of output metas (TensorMeta itself is a NamedTuple)."""
    return isinstance(meta, tuple) and not isinstance(meta, T.TensorMeta)


def is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


_STR_LEAVES = (torch.dtype, torch.device, torch.memory_format, torch.layout)


def _key_of(a: Any) -> Any:
    """An op argument as a hashable key: tensors by shape, stride and dtype; containers
    tagged by kind (a list and a tuple of the same items differ; so do True and 1). fx keeps
    a node's lists and dicts as its immutable subclasses: isinstance, not type."""
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
        return ("V", repr(v))
    if isinstance(a, (tuple, list)):
        return ("list" if isinstance(a, list) else "tuple", tuple(_key_of(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _key_of(v)) for k, v in a.items()))
    if type(a) is bool:
        return ("bool", a)
    if isinstance(a, _STR_LEAVES):
        return str(a)
    return a


def _tensor_leaves(a: Any, out: list[fx.Node]) -> None:
    """Append the tensor nodes of an argument in pytree's order (containers in order, dicts in key order)."""
    if isinstance(a, (tuple, list)):
        for x in a:
            _tensor_leaves(x, out)
    elif isinstance(a, dict):
        for x in a.values():
            _tensor_leaves(x, out)
    elif is_tensor_node(a):
        out.append(a)


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


# One enumeration (specs, source, fallback reason, strategies dropped as (strided, uneven)).
Enumeration = tuple[list[Any], str, "str | None", tuple[int, int]]
# Full-menu enumerations of the last few mesh objects, kept across candidate builds: a replan,
# or a second plan applied on the same mesh (a replay, the tests' eight plans per 2x2 mesh),
# asks DTensor's rules nothing again (~2.6 s of a 3.3 s build of the debug LLaMA on 2x2).
# Keyed by the mesh object itself, not its value: the cached specs carry that mesh.
_SHARED: OrderedDict[int, tuple[DeviceMesh, dict[Any, Enumeration]]] = OrderedDict()
_SHARED_MESHES = 4


def shared_enumerations(mesh: DeviceMesh) -> dict[Any, Enumeration]:
    """The enumeration cache of this mesh object (the least recently used of more are dropped)."""
    hit = _SHARED.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        hit = (mesh, {})
        _SHARED[id(mesh)] = hit
    _SHARED.move_to_end(id(mesh))
    while len(_SHARED) > _SHARED_MESHES:
        _SHARED.popitem(last=False)
    return hit[1]


class OpEnumerator:
    """Strategies of one op node from DTensor's rules, cached by op key (layers repeat)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.prop = T.sharding_propagator()
        self.cache: dict[Any, tuple[list[Any], str, str | None]] = {}  # this build's (seeded balls by identity)
        self.shared = shared_enumerations(mesh)
        self.coverage = CoverageReport()

    # -- keys -------------------------------------------------------------
    def key(self, node: fx.Node) -> Any:
        """What the op's strategies depend on: its target and its arguments, each tensor by
        shape, stride and dtype. Walked by hand, not by pytree: it is most of the cost of a
        repeated layer's node (a 128-layer 8B graph has 27 k op nodes)."""
        args = _key_of(node.args)
        kwargs = tuple(sorted((k, _key_of(v)) for k, v in node.kwargs.items()))
        try:
            k = (node.target, args, kwargs)
            hash(k)
            return k
        except TypeError:  # an unhashable leaf (a slice): its repr stands for it
            return (node.target, repr(args), repr(kwargs))

    # -- schema building --------------------------------------------------
    def schema(self, node: fx.Node, placements: list[Placements]) -> Any:
        """OpSchema with each tensor input an OpStrategy holding one spec."""
        it = iter(placements)

        def conv(a: Any) -> Any:
            if is_tensor_node(a):
                return T.OpStrategy([T.OpSpec(make_spec(self.mesh, next(it), tensor_meta(a.meta["val"])))])
            if isinstance(a, fx.Node):
                return a.meta.get("val")
            return a

        def top(a: Any) -> Any:
            if isinstance(a, (list, tuple)) and a and all(is_tensor_node(x) for x in a):
                return T.TupleStrategy([conv(x) for x in a])  # tensor lists (cat, stack)
            return T.tree_map(conv, a)

        args = [top(a) for a in node.args]
        kwargs = {k: top(v) for k, v in node.kwargs.items()}
        op = node.target
        schema_info = self.prop.op_to_schema_info.get(op) or self.prop.op_to_schema_info_for_single_dim_strategy.get(op)
        return T.OpSchema(op, tuple(args), kwargs, schema_info=schema_info)

    @staticmethod
    def tensor_inputs(node: fx.Node) -> list[fx.Node]:
        """The tensor-valued input nodes in argument order (pytree's flattening order, repeats kept)."""
        out: list[fx.Node] = []
        _tensor_leaves(node.args, out)
        _tensor_leaves(node.kwargs, out)
        return out

    # -- enumeration ------------------------------------------------------
    def enumerate(self, node: fx.Node, key: Any = None) -> tuple[list[Any], str]:
        """`key`: `self.key(node)` when the caller has it (a node's key is most of a cached call)."""
        key = self.key(node) if key is None else key
        hit = self.cache.get(key)
        if hit is None:
            hit = self._enumerate_shared(key, node)
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

    def _enumerate_shared(self, key: Any, node: fx.Node) -> tuple[list[Any], str, str | None]:
        return self._shared(key, lambda: self._enumerate_uncached(node))

    def _shared(self, key: Any, enumerate_: Callable[[], tuple[list[Any], str, str | None]]
                ) -> tuple[list[Any], str, str | None]:
        """From this mesh's shared cache, or enumerated and added to it; the strategies it
        dropped are counted in this build's coverage either way."""
        entry = self.shared.get(key)
        cov = self.coverage
        if entry is None:
            before = (cov.dropped_strided, cov.dropped_uneven)
            specs, source, why = enumerate_()
            dropped = (cov.dropped_strided - before[0], cov.dropped_uneven - before[1])
            self.shared[key] = (specs, source, why, dropped)
            return specs, source, why
        specs, source, why, dropped = entry
        cov.dropped_strided += dropped[0]
        cov.dropped_uneven += dropped[1]
        return specs, source, why

    def _enumerate_uncached(self, node: fx.Node) -> tuple[list[Any], str, str | None]:
        op = node.target
        inputs = self.tensor_inputs(node)
        in_metas = [tensor_meta(a.meta["val"]) for a in inputs]
        out_meta = out_meta_of(node.meta.get("val"))
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
        found = len(specs)
        specs = self.finalize(specs, in_metas, out_meta)
        if not specs or all(self._all_replicate(s) for s in specs):
            why = "; ".join(errors) if errors else (
                f"no strategy of its DTensor rule shards evenly on mesh {self.mesh_shape}" if found
                else "no sharding rule")
            return self.replicate_only(node, in_metas, out_meta), "replicate_fallback", why
        return specs, source, None

    @staticmethod
    def _all_replicate(spec: Any) -> bool:
        outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        all_specs = [s for s in outs if s is not None] + list(spec.input_specs or [])
        return all(isinstance(p, Replicate) for s in all_specs for p in s.placements)

    def replicate_only(self, node: fx.Node, in_metas: list[Any], out_meta: Any) -> list[Any]:
        rep = tuple(Replicate() for _ in self.mesh_shape)
        if is_multi(out_meta):
            outs = tuple(make_spec(self.mesh, rep, m) if m is not None else None for m in out_meta)
        else:
            outs = make_spec(self.mesh, rep, out_meta)
        return [T.OpSpec(outs, [make_spec(self.mesh, rep, m) for m in in_metas])]

    def _single_dim(self, node: fx.Node, inputs: list[fx.Node], out_meta: Any) -> list[Any]:
        op = node.target
        info = self.prop.op_single_dim_strategy_funcs[op]
        rep = tuple(Replicate() for _ in self.mesh_shape)
        schema = self.schema(node, [rep] * len(inputs))
        func = info.func if isinstance(info, T.SingleDimStrategyInfo) else info
        rules = func(op, schema.args_meta, schema.kwargs_meta)
        n_in = len(inputs)
        n_out = len(rules[0]) - n_in if rules else (len(out_meta) if is_multi(out_meta) else 1)
        filled: list[list[Any]] = []
        seen = set()
        rep_rule = [Replicate()] * (n_out + n_in)
        if is_multi(out_meta):
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
                schema = self.schema(node, c)
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
                strat = ds.propagate_strategy(self.schema(node, c))
                if isinstance(strat, T.OpStrategy):
                    specs.extend(strat.strategies)
        return specs

    def finalize(self, specs: list[Any], in_metas: list[Any], out_meta: Any) -> list[Any]:
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
            if is_multi(out_meta):
                if not isinstance(outs, tuple):
                    outs = tuple(outs if m is not None else None for m in out_meta)
                new_outs = tuple(
                    make_spec(self.mesh, o.placements, m) if (o is not None and m is not None) else None
                    for o, m in zip(outs, out_meta)
                )
            else:
                if isinstance(outs, tuple):
                    outs = outs[0]
                new_outs = make_spec(self.mesh, outs.placements, out_meta)
            new_ins = [make_spec(self.mesh, i.placements, m) for i, m in zip(ins, in_metas)]
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

    def restricted(self, node: fx.Node, keys: list[tuple], key: Any = None) -> tuple[list[Any], str]:
        """The strategies of `node` whose (output, inputs) placements are among `keys`.

        Single-dim rules expand over the mesh as a per-axis product (what
        `expand_to_full_mesh_op_strategy` does), so their strategies are built directly from
        the keys; strategy-function and decomposition rules are asked once per distinct
        input placement of the keys and only their answers inside `keys` are kept. Nothing
        left -> replicate-only (counted in the coverage report).
        """
        # by identity: seeding hands identical balls out as one shared list, alive for the whole build;
        # by value in the mesh's shared cache (a search's shallow copies ask for the same balls)
        op_key = self.key(node) if key is None else key
        ck = ("restricted", op_key, id(keys), len(keys))
        hit = self.cache.get(ck)
        if hit is None:
            hit = self._shared(("restricted", op_key, tuple(keys)), lambda: self._restricted_uncached(node, keys))
            self.cache[ck] = hit
        specs, source, why = hit
        self.record_fallback(node, why)
        return specs, source


    def _restricted_uncached(self, node: fx.Node, keys: list[tuple]) -> tuple[list[Any], str, str | None]:
        op = node.target
        inputs = self.tensor_inputs(node)
        in_metas = [tensor_meta(a.meta["val"]) for a in inputs]
        out_meta = out_meta_of(node.meta.get("val"))
        mesh = self.mesh
        wanted = set(keys)
        specs: list[Any] = []
        source = ""
        errors: list[str] = []
        if op in self.prop.op_single_dim_strategy_funcs:
            source = "single_dim"
            for o, ins in keys:
                if len(ins) != len(in_metas):
                    continue
                if is_multi(out_meta):
                    outs = tuple(make_spec(mesh, p, m) if (p is not None and m is not None) else None
                                 for p, m in zip(o, out_meta))
                else:
                    outs = make_spec(mesh, o, out_meta)
                specs.append(T.OpSpec(outs, [make_spec(mesh, p, m) for p, m in zip(ins, in_metas)]))
        else:
            if op in self.prop.op_strategy_funcs:
                source = "strategy_func"
                func = self.prop.op_strategy_funcs[op]
            else:
                source = "decomp"
                ds = self.prop.decomp_strategy
                if hasattr(ds, "has_decomp") and ds.has_decomp(op):
                    ds.ensure_schema_info(op)
                    func = ds.propagate_strategy
                else:
                    func = None
                    errors.append("no sharding rule and no decomposition")
            if func is not None:
                for ins in dict.fromkeys(k[1] for k in keys):
                    try:
                        strat = func(self.schema(node, list(ins)))
                    except Exception as e:  # noqa: BLE001 - invalid combination for this op
                        errors.append(f"{source}: {type(e).__name__}: {e}"[:200])
                        continue
                    if isinstance(strat, T.OpStrategy):
                        specs.extend(strat.strategies)
        specs = self.finalize(specs, in_metas, out_meta)
        specs = [s for s in specs if strategy_key(s) in wanted]
        # stable order: the order of `keys`
        order = {k: i for i, k in enumerate(keys)}
        specs.sort(key=lambda s: order[strategy_key(s)])
        if not specs:
            why = "; ".join(errors[-1:]) if errors else "no strategy inside the seeded Hamming ball"
            return self.replicate_only(node, in_metas, out_meta), "replicate_fallback", why
        return specs, source, None
