"""Identical transformer blocks traced once: a repeated block's part of the step graph is a
copy of the nodes its first instance produced, not a second run through DTensor's dispatch.

The runner's phase graphs (forward, backward) run block by block: each transformer block is
a contiguous run of nodes, a *segment* (`PhaseBlocks`). Two segments compute the same thing
when their nodes have the same ops, literal arguments, planned strategies and shapes, and
read the same values relative to their own block (layer i reads layer i-1's output and its
own parameters). While `make_fx` traces a step (`BlockCopies`), the first segment of each
kind is interpreted as usual and the graph nodes it added are kept as a *template*; each
later segment of that kind gets a copy of those nodes with their inputs rebound to its own
block's values, and fresh fake values that share storage exactly as the template's do (the
memory walk groups views by storage). Whatever does not line up at that point (a value
missing, a different shape, placement or gather state) runs the segment as usual, so the
copy is the graph the interpreter would have traced, made in a fraction of the time.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from parallel import _torch as T
from parallel.auto.candidates.placements import spec_placement_strs
from parallel.auto.cost.memory import COPIED_STORAGES, value_storages

log = logging.getLogger("parallel.auto.runtime")

MISSING = object()
"""`BlockCopies.value`'s answer for a node the interpreter must run itself."""

REACH = 2
"""A template may read values of blocks up to this many blocks away from its own."""


def _val_sig(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), tuple(v.stride()), v.dtype
    if isinstance(v, (tuple, list)):
        return tuple(_val_sig(x) for x in v)
    return type(v).__name__


def _literal(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


def _member_sig(n: fx.Node) -> tuple:
    """What a block member is, without its name (a placeholder's target is its name)."""
    return n.op, "" if n.op == "placeholder" else str(n.target), _val_sig(n.meta.get("val"))


class BlockLayout:
    """The joint graph's nodes of each transformer block in one order, so that the k-th node
    of one block plays the part of the k-th node of an identical block."""

    def __init__(self, joint: fx.GraphModule, block_of: dict[str, int], param_names: set[str]):
        members: dict[int, list[fx.Node]] = {}
        for n in joint.graph.nodes:
            b = block_of.get(n.name) if n.op != "output" else None  # the output may carry a layer's module path
            if b is not None:
                members.setdefault(b, []).append(n)
        self.block_of = block_of
        self.names = {b: [n.name for n in ns] for b, ns in members.items()}
        self.pos = {n.name: (b, i) for b, ns in members.items() for i, n in enumerate(ns)}
        kinds: dict[tuple, int] = {}
        self.kind = {b: kinds.setdefault(tuple(_member_sig(n) for n in ns), len(kinds)) for b, ns in members.items()}
        self.params = {b: [n.name for n in ns if n.name in param_names] for b, ns in members.items()}
        self.loose_params = sorted(p for p in param_names if p not in self.pos)  # embedding, norm, head

    def rebase(self, name: str, delta: int) -> str | None:
        """The node that plays `name`'s part `delta` blocks on (`name` itself outside the
        blocks; None where that block does not exist or is built differently)."""
        p = self.pos.get(name)
        if p is None:
            return name
        b, i = p
        if self.kind.get(b + delta) != self.kind[b]:
            return None
        return self.names[b + delta][i]


@dataclass
class Segment:
    """One block's contiguous run of nodes in a phase graph."""

    block: int
    nodes: list[fx.Node]
    signature: tuple
    needed: set[fx.Node]  # nodes whose values are read after the segment


class PhaseBlocks:
    """A phase graph's segments and which of them are the same computation."""

    def __init__(self, gm: fx.GraphModule, layout: BlockLayout, spec: dict[str, Any], defer: set[str]):
        self.layout = layout
        self.nodes = {n.name: n for n in gm.graph.nodes}
        runs: list[tuple[int, list[fx.Node]]] = []
        prev: int | None = None
        for n in gm.graph.nodes:
            b = layout.block_of.get(n.name) if n.op == "call_function" else None
            if b is None and n.op == "call_function" and n.target is operator.getitem \
                    and isinstance(n.args[0], fx.Node):
                b = layout.block_of.get(n.args[0].name)
            if b is not None and b == prev:
                runs[-1][1].append(n)
            elif b is not None:
                runs.append((b, [n]))
            prev = b
        self.starts: dict[fx.Node, Segment] = {}
        for b, nodes in runs:
            inside = set(nodes)
            needed = [i for i, n in enumerate(nodes) if any(u not in inside for u in n.users)]
            # the same ops and the same values read afterwards (a copy hands on what its template did)
            sig = (self._signature(b, nodes, spec, defer), tuple(needed))
            self.starts[nodes[0]] = Segment(b, nodes, sig, {nodes[i] for i in needed})
        self.count = Counter(s.signature for s in self.starts.values())

    def _signature(self, b: int, nodes: list[fx.Node], spec: dict[str, Any], defer: set[str]) -> tuple:
        idx = {n: i for i, n in enumerate(nodes)}
        layout = self.layout

        def ref(a: fx.Node) -> tuple:
            if a in idx:
                return ("i", idx[a])
            p = layout.pos.get(a.name)
            if p is not None:
                return ("b", p[0] - b, p[1], layout.kind[p[0]])
            return ("a", a.name)

        sig: list[tuple] = [("kind", layout.kind[b])]
        for n in nodes:
            leaves, tree = T.tree_flatten((n.args, dict(n.kwargs)))
            s = spec.get(n.name)
            strs = spec_placement_strs(s) if s is not None else None
            sig.append((n.target, str(tree), tuple(ref(x) if isinstance(x, fx.Node) else _literal(x) for x in leaves),
                        (tuple(strs[0]), tuple(strs[1])) if strs else None, n.name in defer,
                        _val_sig(n.meta.get("val"))))
        return tuple(sig)

    def repeated(self) -> int:
        """Segments that are copies of an earlier one's kind."""
        return sum(c - 1 for c in self.count.values())


def _remap(a: Any, mapping: dict[fx.Node, fx.Node]) -> Any:
    """A node's arguments with every node replaced by its copy."""
    if isinstance(a, fx.Node):
        return mapping[a]
    if isinstance(a, (tuple, list)):
        return tuple(_remap(x, mapping) for x in a) if isinstance(a, tuple) else [_remap(x, mapping) for x in a]
    if isinstance(a, dict):
        return {k: _remap(v, mapping) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_remap(a.start, mapping), _remap(a.stop, mapping), _remap(a.step, mapping))
    return a


def _leaf_sig(x: Any) -> tuple:
    placements = tuple(x.placements) if isinstance(x, DTensor) else None
    t = T.local_tensor(x) if isinstance(x, DTensor) else x
    return placements, tuple(t.shape), tuple(t.stride()), t.dtype


def _local(x: Any) -> Any:
    return T.local_tensor(x) if isinstance(x, DTensor) else x


@dataclass
class _Template:
    block: int
    nodes: list[fx.Node]  # the graph nodes the segment added, in order
    externals: list[tuple[fx.Node, tuple, tuple]]  # (node read from before, its key, its value's signature)
    outputs: list[tuple[int, Any, list[tuple]]]  # (segment index, pytree spec, leaves)
    cache_added: list[tuple[str, fx.Node, tuple]]  # (parameter, gathered copy's node, its DTensor spec)
    stats: Counter
    deltas: tuple[int, ...]  # the blocks (relative to its own) it reads
    state: tuple  # which of their parameters were gathered / had shards when it ran

    @property
    def bound(self) -> list[fx.Node]:
        """Its nodes whose values a copy hands on (outputs, gathered parameters)."""
        return [tn for _, _, leaves in self.outputs for kind, tn, _ in leaves if kind == "t"] + \
            [tn for _, tn, _ in self.cache_added]


@dataclass
class _Recording:
    seg: Segment
    marker: fx.Node  # the graph's last node before the segment ran
    keys: dict[fx.Node, tuple[tuple, tuple]]  # graph node -> (where its value lives, that value's signature)
    cache_before: set[str]
    stats_before: Counter
    state: tuple
    values: dict[fx.Node, Any] = field(default_factory=dict)


class BlockCopies:
    """One trace's templates and copies for one phase graph (see the module docstring)."""

    def __init__(self, blocks: PhaseBlocks, ops: Any, mesh: Any):
        self.blocks = blocks
        self.layout = blocks.layout
        self.ops = ops
        self.mesh = mesh
        self.tracer = T.active_tracer()
        self.templates: dict[tuple, _Template | None] = {}
        self.pending: dict[fx.Node, Any] = {}
        self.recording: _Recording | None = None
        self.copied = 0
        self.refused = 0

    # -- the interpreter's hooks -------------------------------------------------
    def value(self, n: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """`n`'s value when its segment was copied (MISSING: run it)."""
        if n in self.pending:
            return self.pending.pop(n)
        seg = self.blocks.starts.get(n)
        if seg is None or self.tracer is None or self.blocks.count[seg.signature] < 2:
            return MISSING
        t = self.templates.get(seg.signature, MISSING)
        if t is MISSING:
            self.recording = self._start(seg, env)
        elif t is not None and self._copy(seg, t, env):
            return self.pending.pop(n)
        return MISSING

    def ran(self, n: fx.Node, out: Any) -> None:
        rec = self.recording
        if rec is None:
            return
        if n in rec.seg.needed:
            rec.values[n] = out
        if n is rec.seg.nodes[-1]:
            self.templates[rec.seg.signature] = self._finish(rec)
            self.recording = None

    # -- recording ---------------------------------------------------------------
    def _state(self, block: int, deltas: tuple[int, ...]) -> tuple:
        """What the interpreter's gathers depend on around `block`: for the parameters of the
        blocks `deltas` away and the loose ones, whether each is gathered already and whether
        it has a shard to gather from."""
        cache, pv, lay = self.ops.cache, self.ops.param_values, self.layout
        out: list[Any] = []
        for d in deltas:
            names = lay.params.get(block + d)
            out.append(None if names is None else
                       (d, lay.kind[block + d], tuple((m in cache, m in pv) for m in names)))
        out.append(tuple((m in cache, m in pv) for m in lay.loose_params))
        return tuple(out)

    def _start(self, seg: Segment, env: dict[fx.Node, Any]) -> _Recording:
        keys: dict[fx.Node, tuple[tuple, tuple]] = {}

        def note(x: Any, key: tuple) -> None:
            t = _local(x)
            if isinstance(t, torch.Tensor):
                tn = T.traced_node(t, self.tracer)
                if tn is not None and tn not in keys:
                    keys[tn] = (key, _leaf_sig(x))

        for node, v in env.items():
            for j, leaf in enumerate(T.tree_flatten(v)[0]):
                note(leaf, ("env", node.name, j))
        for name, v in self.ops.cache.items():
            note(v, ("cache", name, 0))
        for name, v in self.ops.param_values.items():
            note(v, ("param", name, 0))
        return _Recording(seg, _graph_tail(self.tracer), keys, set(self.ops.cache),
                          Counter(self.ops.stats), self._state(seg.block, tuple(range(-REACH, REACH + 1))))

    def _finish(self, rec: _Recording) -> _Template | None:
        nodes = _nodes_after(rec.marker)
        inside = set(nodes)
        externals: list[tuple[fx.Node, tuple, tuple]] = []
        seen: set[fx.Node] = set()

        def external(a: fx.Node) -> bool:
            if a in inside or a in seen:
                return True
            seen.add(a)
            if a.op == "get_attr":
                externals.append((a, ("const",), ()))
                return True
            hit = rec.keys.get(a)
            if hit is None or not self._near(hit[0], rec.seg.block):
                return False
            externals.append((a, hit[0], hit[1]))
            return True

        for node in nodes:
            if not all(external(a) for a in node.all_input_nodes):
                return self._uncopyable(rec.seg, "a node reads a value the block does not own")
        index = {x: i for i, x in enumerate(rec.seg.nodes)}
        outputs = []
        for y in rec.seg.needed:
            leaves, tree = T.tree_flatten(rec.values[y])
            out = []
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    tn = T.traced_node(_local(leaf), self.tracer)
                    if tn is None or not external(tn):
                        return self._uncopyable(rec.seg, "an output is not traced")
                    spec = (tuple(leaf.placements), tuple(leaf.shape), tuple(leaf.stride())) \
                        if isinstance(leaf, DTensor) else None
                    out.append(("t", tn, spec))
                else:
                    out.append(("c", leaf, None))
            outputs.append((index[y], tree, out))
        added = []
        for name in self.ops.cache:
            if name not in rec.cache_before:
                v = self.ops.cache[name]
                tn = T.traced_node(T.local_tensor(v), self.tracer)
                if tn is None or tn not in inside:
                    return self._uncopyable(rec.seg, "a gathered parameter is not traced")
                added.append((name, tn, (tuple(v.placements), tuple(v.shape), tuple(v.stride()))))
        stats = Counter(self.ops.stats)
        stats.subtract(rec.stats_before)
        deltas = sorted({0} | {self.layout.pos[k[1]][0] - rec.seg.block for _, k, _ in externals
                               if k[0] != "const" and k[1] in self.layout.pos})
        state = tuple(rec.state[d + REACH] for d in deltas) + rec.state[-1:]
        return _Template(rec.seg.block, nodes, externals, outputs, added, +stats, tuple(deltas), state)

    def _near(self, key: tuple, block: int) -> bool:
        if key[0] == "const":
            return True
        p = self.layout.pos.get(key[1])
        return p is None or abs(p[0] - block) <= REACH

    def _uncopyable(self, seg: Segment, why: str) -> None:
        log.debug("apply: block %d's graph is traced per block (%s)", seg.block, why)
        return None

    # -- copying -----------------------------------------------------------------
    def _lookup(self, key: tuple, delta: int, env: dict[fx.Node, Any]) -> Any:
        kind, name, j = key
        name2 = self.layout.rebase(name, delta)
        if name2 is None:
            return None
        if kind == "env":
            node = self.blocks.nodes.get(name2)
            v = env.get(node, MISSING) if node is not None else MISSING
            if v is MISSING:
                return None
            leaves = T.tree_flatten(v)[0]
            return leaves[j] if j < len(leaves) else None
        return (self.ops.cache if kind == "cache" else self.ops.param_values).get(name2)

    def _copy(self, seg: Segment, tmpl: _Template, env: dict[fx.Node, Any]) -> bool:
        delta = seg.block - tmpl.block
        if self._state(seg.block, tmpl.deltas) != tmpl.state or any(
                self.layout.rebase(name, delta) is None for name, _, _ in tmpl.cache_added):
            self.refused += 1
            return False
        mapping: dict[fx.Node, fx.Node] = {}
        for tn, key, sig in tmpl.externals:
            if key[0] == "const":
                mapping[tn] = tn
                continue
            leaf = self._lookup(key, delta, env)
            if not isinstance(leaf, torch.Tensor) or _leaf_sig(leaf) != sig:
                self.refused += 1
                return False
            tn2 = T.traced_node(_local(leaf), self.tracer)
            if tn2 is None:
                self.refused += 1
                return False
            mapping[tn] = tn2
        copy_nodes(self.tracer.graph, tmpl.nodes, mapping, tmpl.bound)
        with T.untraced():
            outs = {i: T.tree_unflatten([self._bind(mapping, leaf) for leaf in leaves], tree)
                    for i, tree, leaves in tmpl.outputs}
            for name, tn, spec in tmpl.cache_added:
                name2 = self.layout.rebase(name, delta)
                self.ops.cache[name2] = self._bind(mapping, ("t", tn, spec))
        for i, n in enumerate(seg.nodes):
            self.pending[n] = outs.get(i)
        self.ops.stats.update(tmpl.stats)
        self.copied += 1
        return True

    def _bind(self, mapping: dict[fx.Node, fx.Node], leaf: tuple) -> Any:
        return bind_copy(self.tracer, self.mesh, mapping, leaf)


def copy_nodes(graph: fx.Graph, nodes: list[fx.Node], mapping: dict[fx.Node, fx.Node],
               bound: list[fx.Node]) -> None:
    """Append copies of `nodes` to `graph`, their reads of values from before them rebound by
    `mapping` (which gains every copy). The copies of `bound` (the nodes whose values the
    trace goes on with) get fresh fake values (`_FreshValues`); every other copy keeps its
    template's value and says which storage it stands for (`COPIED_STORAGES`), for the
    memory walk: a fake tensor per node was most of a copy's time."""
    fresh = _FreshValues()
    inside = set(nodes)
    for old, new in list(mapping.items()):
        if old not in inside:
            fresh.seed(old, new.meta.get("val"))
    with T.no_modes():
        vals = {n: fresh.like(n) for n in bound if "val" in n.meta}
    storages = _CopyStorages(fresh)
    for node in nodes:
        # Graph.node_copy without its generic argument walks: the arguments are set after
        # creation (create_node walks them once more for symbolic ints: none in a copy)
        new = graph.create_node(node.op, node.target, name=node.name, type_expr=node.type)
        new.args, new.kwargs = _remap(node.args, mapping), _remap(node.kwargs, mapping)
        meta = dict(node.meta)
        if node in vals:
            meta["val"] = vals[node]
            meta.pop(COPIED_STORAGES, None)
        elif "val" in meta:
            inner = meta.get(COPIED_STORAGES)
            meta[COPIED_STORAGES] = storages if inner is None else _Chained(inner, storages)
        new.meta = meta
        mapping[node] = new


def bind_copy(tracer: Any, mesh: Any, mapping: dict[fx.Node, fx.Node], leaf: tuple) -> Any:
    """The value a copied output leaf stands for: ("t", template node, DTensor spec or None)
    becomes the copy's fake value, known to the tracer as that node's (wrapped as a DTensor
    of that spec); ("c", value, None) is a constant."""
    kind, x, spec = leaf
    if kind == "c":
        return x
    node = mapping[x]
    t = node.meta["val"]
    T.bind_traced(t, node, tracer)
    return t if spec is None else T.dtensor_on(t, mesh, *spec)


def _graph_tail(tracer: Any) -> fx.Node:
    return next(iter(reversed(tracer.graph.nodes)))  # iter(): torch < 2.13 returns a list view


def _nodes_after(marker: fx.Node) -> list[fx.Node]:
    out = []
    n = marker.next
    while n.op != "root":  # the graph's sentinel: the end of its node list
        out.append(n)
        n = n.next
    return out


class CallCopies:
    """Copies of a traced call: the first call of a kind (key and input layouts) runs and the
    nodes it adds are kept; a later call of that kind gets copies, its inputs rebound. For
    work done once per block outside the phase graphs (the bucketed gradient reductions).
    Outside a trace every call just runs."""

    def __init__(self, mesh: Any):
        self.mesh = mesh
        self.tracer = T.active_tracer()
        self.templates: dict[tuple, Any] = {}
        self.copied = 0

    def __call__(self, key: tuple, fn: Any, inputs: list[Any]) -> list[Any]:
        """`fn()` (a list of tensors computed from `inputs` only), or a copy of an earlier one."""
        if self.tracer is None:
            return fn()
        locs = [_local(x) for x in inputs]
        kind = (key, tuple(_leaf_sig(x) for x in inputs))
        in_nodes = [T.traced_node(t, self.tracer) for t in locs]
        tmpl = self.templates.get(kind)
        if tmpl is not None and None not in in_nodes:
            nodes, template_inputs, consts, leaves = tmpl
            mapping = dict(zip(template_inputs, in_nodes))
            mapping.update((c, c) for c in consts)
            copy_nodes(self.tracer.graph, nodes, mapping, [tn for _, tn, _ in leaves])
            with T.untraced():
                out = [bind_copy(self.tracer, self.mesh, mapping, leaf) for leaf in leaves]
            self.copied += 1
            return out
        marker = _graph_tail(self.tracer)
        out = fn()
        if kind not in self.templates:
            self.templates[kind] = self._record(_nodes_after(marker), in_nodes, out)
        return out

    def _record(self, nodes: list[fx.Node], in_nodes: list[Any], out: list[Any]) -> Any:
        known = set(nodes) | set(in_nodes)
        if None in in_nodes or len(set(in_nodes)) != len(in_nodes) or any(
                a not in known and a.op != "get_attr" for n in nodes for a in n.all_input_nodes):
            return None
        leaves = []
        for x in out:
            tn = T.traced_node(_local(x), self.tracer)
            if tn is None or tn not in known:
                return None
            spec = (tuple(x.placements), tuple(x.shape), tuple(x.stride())) if isinstance(x, DTensor) else None
            leaves.append(("t", tn, spec))
        consts = {a for n in nodes for a in n.all_input_nodes if a.op == "get_attr" and a not in known}
        return nodes, in_nodes, sorted(consts, key=lambda a: a.name), leaves


class _FreshValues:
    """New fake tensors shaped like a template's, sharing storage among themselves exactly as
    the template's do (a view of a storage stays a view of its copy), and with the storages
    of the values read from outside the block mapped to this block's. Storages are told
    apart as the memory walk tells them (`value_storages`). Made under `T.no_modes()`."""

    def __init__(self) -> None:
        self.storages: dict[Any, torch.Tensor] = {}  # template storage -> a tensor on its copy

    def like(self, n: fx.Node) -> Any:
        """A fresh value like template node `n`'s."""
        keys = iter(value_storages(n))
        return self._like(n.meta["val"], keys)

    def _like(self, v: Any, keys: Any) -> Any:
        if isinstance(v, torch.Tensor) and T.is_fake(v):
            key, nbytes = next(keys)
            base = self.storages.get(key)
            if base is None:
                base = self.storages[key] = T.meta_storage(nbytes)
            return T.fake_view(v.fake_mode, base, v)
        if isinstance(v, torch.Tensor):
            next(keys, None)  # a real tensor's storage is listed too
            return v
        if isinstance(v, (tuple, list)):
            return type(v)(self._like(x, keys) for x in v)
        return v

    def seed(self, template: fx.Node, val: Any) -> None:
        """A value read from outside: the template's storage is this block's."""
        tensors = [t for t in T.tree_flatten(val)[0] if isinstance(t, torch.Tensor)]
        for (key, _), b in zip(value_storages(template), tensors):
            self.storages.setdefault(key, b)


class _CopyStorages(dict):
    """One copy's storage for each of its template's: the one `_FreshValues` made or
    seeded for it, else an identity of the copy's own."""

    _serial = 0

    def __init__(self, fresh: _FreshValues):
        super().__init__()
        self.fresh = fresh
        _CopyStorages._serial += 1
        self.serial = _CopyStorages._serial

    def __missing__(self, key: Any) -> Any:
        base = self.fresh.storages.get(key)
        out = self[key] = T.storage_id(base) if base is not None else (self.serial, key)
        return out


class _Chained:
    """The storages of a copy of a copy: the inner copy's, then the outer's."""

    def __init__(self, inner: Any, outer: _CopyStorages):
        self.inner, self.outer = inner, outer

    def __getitem__(self, key: Any) -> Any:
        return self.outer[self.inner[key]]
