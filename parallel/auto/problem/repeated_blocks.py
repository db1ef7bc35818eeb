"""Repeated blocks (the paper's "graph clustering", §4.3): identical copies of a repeated
block share one decision.

A transformer's L layers produce L copies of the same sub-problem. Copies are found by
content hashing, not by names: every node gets a hash of

  * its own content: phase (forward / backward, never mixed), node kind, op target, the
    enumeration key (op, input shapes/strides/dtypes, static args), the tensor shape of
    placeholders, the getitem index and its candidate menu (output and input placements
    of every strategy, in order, so copies share strategy indices);
  * the structure of its inputs relative to its layer: an input produced inside the same
    layer instance contributes its own (recursive) hash, an input from outside the layer
    only its tensor shape and dtype (so layer 0, fed by the embedding, and layer i, fed
    by layer i-1, still hash alike).

The layer instance of a node is the first ``.<index>`` prefix of its module path (or of
its parameter FQN), e.g. ``layers.3``; nodes outside indexed modules are never copies.
Within one instance, equal hashes are told apart by their order of appearance, and nodes
with the same (hash, ordinal) in different instances form one set of copies.

Flow-coupled producers: the producers feeding the same input position of a set of copies
(e.g. the embedding and layers 0..L-2 feeding layer i's first norm) are merged too when
their candidate menus are identical, so the copied consumer sees one producer decision
(paper: "flow-coupled producers ... share one placement decision").

`find_repeated_blocks(cands)` returns the sets of copies; `build_problem(repeated_blocks=True)`
unions them with the forward/backward ties, so the exact ILP and the MRF solve the same
reduced problem. `RepeatedBlocks.summary()` reports how many decisions remain.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from parallel.auto.candidates.placements import menu_of
from parallel.auto.candidates.strategies import PLACEHOLDER, SLOT, Candidates, NodeCandidates
from parallel.auto.problem.placement_problem import PlanningError
from parallel.auto.trace.joint import layer_prefix

log = logging.getLogger("parallel.auto.problem.placement_problem")


@dataclass
class RepeatedBlocks:
    """Sets of identical copies (each a list of node names, >= 2 members)."""

    copies: list[list[str]]
    flow_coupled: list[list[str]] = field(default_factory=list)  # producer sets merged
    num_nodes: int = 0
    num_instances: int = 0  # layer instances seen (e.g. 32 for LLaMA 3 8B)

    @property
    def num_copied_nodes(self) -> int:
        """Nodes that share their decision with at least one copy."""
        return sum(len(c) for c in self.copies)

    def summary(self, num_decisions: int | None = None) -> str:
        """One line for the log: sets of copies, layer instances and decisions saved."""
        saved = self.num_copied_nodes - len(self.copies)
        s = (f"repeated blocks: {len(self.copies)} sets of copies over {self.num_instances} "
             f"layer instances ({self.num_copied_nodes} nodes share {len(self.copies)} decisions, "
             f"{saved} decisions saved), {len(self.flow_coupled)} flow-coupled producer sets")
        if num_decisions is not None:
            s = f"{self.num_nodes:,} nodes -> {num_decisions:,} decisions; " + s
        return s


def layer_instance(cands: Candidates, name: str, param_fqn: dict[str, str] | None = None) -> str | None:
    """'layers.3' for a node of layer 3 (module path or parameter FQN), else None."""
    jg = cands.graph
    if param_fqn is None:
        param_fqn = {n.name: fqn for fqn, n in jg.params.items()}
    path = param_fqn.get(name) or jg.module_of.get(name, "")
    return layer_prefix(path)


def _tensor_sig(node: Any, idx: int | None = None) -> tuple:
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = v[idx or 0] if v else None
    if v is None or not hasattr(v, "shape"):
        return ("?",)
    return (tuple(v.shape), str(v.dtype))


class _MenuHash:
    """Hash of a node's candidate menu, computed once per shared specs list (copies share them)."""

    def __init__(self) -> None:
        self.hashes: dict[int, int] = {}  # id(specs) -> hash
        self.menus: dict[int, tuple] = {}

    def __call__(self, c: NodeCandidates) -> int:
        k = id(c.specs)
        h = self.hashes.get(k)
        if h is None:
            h = self.hashes[k] = hash(self.menu(c))
        return h

    def menu(self, c: NodeCandidates) -> tuple:
        """The node's menu (`menu_of`), once per shared specs list."""
        k = id(c.specs)
        m = self.menus.get(k)
        if m is None:
            m = self.menus[k] = menu_of(c)
        return m


@dataclass
class _Hashed:
    """Per node: its layer instance; copies bucketed by (structural hash, ordinal within the instance)."""

    instance: dict[str, str | None] = field(default_factory=dict)
    struct: dict[str, int] = field(default_factory=dict)
    buckets: dict[tuple, list[str]] = field(default_factory=lambda: defaultdict(list))
    ordinal: dict[tuple, int] = field(default_factory=lambda: defaultdict(int))
    instances: set[str] = field(default_factory=set)


def _hash_nodes(cands: Candidates, menu_h: _MenuHash) -> _Hashed:
    """Content + structure hash of every node (inputs from its own layer instance recursively)."""
    jg = cands.graph
    param_fqn = {n.name: fqn for fqn, n in jg.params.items()}
    out = _Hashed()
    for name, c in cands.nodes.items():
        if c.kind == SLOT:
            continue
        inst = layer_instance(cands, name, param_fqn)
        out.instance[name] = inst
        target = str(c.node.target) if c.kind != PLACEHOLDER else ""
        own = (jg.phase.get(name, ""), c.kind, target, repr(c.key) if c.key is not None else "",
               _tensor_sig(c.node) if c.kind == PLACEHOLDER else (), c.getitem_index, menu_h(c), len(c.inputs))
        ins = []
        for a in c.inputs:
            if inst is not None and out.instance.get(a.name) == inst:
                ins.append(("L", out.struct[a.name]))
            else:
                ins.append(("X", _tensor_sig(a, c.getitem_index)))
        h = hash((hash(own), tuple(ins)))
        out.struct[name] = h
        if inst is None:
            continue
        out.instances.add(inst)
        i = out.ordinal[(inst, h)]
        out.ordinal[(inst, h)] += 1
        out.buckets[(h, i)].append(name)
    return out


def _flow_coupled(cands: Candidates, copies: list[list[str]], menu_h: _MenuHash) -> list[list[str]]:
    """Producer sets feeding the same input position of a set of copies, with one menu and phase."""
    nodes = cands.nodes
    coupled: list[list[str]] = []
    copy_set = {n: i for i, m in enumerate(copies) for n in m}
    for members in copies:
        rep = nodes[members[0]]
        for k in range(len(rep.inputs)):
            by_menu: dict[tuple, list[str]] = defaultdict(list)
            for n in members:
                p = nodes[n].inputs[k].name
                # sharing a strategy index needs the same menu; never mix fwd and bwd
                key = (cands.graph.phase.get(p, ""), menu_h(nodes[p]))
                if p not in by_menu[key]:
                    by_menu[key].append(p)
            for producers in by_menu.values():
                ids = {copy_set.get(p, p) for p in producers}
                if len(ids) > 1 and producers not in coupled:  # not already one set of copies
                    coupled.append(producers)
    return coupled


def find_repeated_blocks(cands: Candidates, *, flow_coupling: bool = True,
                         menu_h: _MenuHash | None = None) -> RepeatedBlocks:
    """Content-hash the nodes and group identical copies across layer instances."""
    menu_h = menu_h if menu_h is not None else _MenuHash()
    hashed = _hash_nodes(cands, menu_h)
    copies = [m for m in hashed.buckets.values() if len(m) > 1 and len({hashed.instance[n] for n in m}) == len(m)]
    coupled = _flow_coupled(cands, copies, menu_h) if flow_coupling else []
    return RepeatedBlocks(copies, coupled, num_nodes=len(cands.nodes), num_instances=len(hashed.instances))


# ---------------------------------------------------------------------------
# Decision groups: fwd/bwd ties and repeated blocks, by union-find
# ---------------------------------------------------------------------------


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, a: str) -> str:
        p = self.parent.setdefault(a, a)
        if p != a:
            p = self.parent[a] = self.find(p)
        return p

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def decision_groups(cands: Candidates, repeated_blocks: bool) -> tuple[list[list[str]], dict[str, int]]:
    """Union-find groups: fwd/bwd pairs always; copies of repeated layers if asked."""
    jg = cands.graph
    uf = _UnionFind()
    names = list(cands.nodes)
    for n in names:
        uf.find(n)
    menu_h = _MenuHash()  # menus once per shared specs list, for the ties and the copies

    def menu(n: str) -> tuple:
        return menu_h.menu(cands.nodes[n])

    def tie(a: str, b: str, why: str) -> None:
        # a placeholder and its output slot: same placements, strategy for strategy
        if [m[0] for m in menu(a)] != [m[0] for m in menu(b)]:
            raise PlanningError(f"cannot tie {a} and {b} ({why}): their candidate placements differ")
        uf.union(a, b)

    slot_name = {s.index: f"output[{s.index}]" for s in jg.slots if s.node is not None}
    for s in jg.slots:
        if s.node is None:
            continue
        if s.kind == "grad_param":
            tie(jg.params[s.of].name, slot_name[s.index], f"parameter {s.of} and its gradient")
        elif s.kind == "grad_input":
            tie(jg.inputs[s.of].name, slot_name[s.index], f"input {s.of} and its gradient")
    out_slot = {s.of: slot_name[s.index] for s in jg.slots if s.kind == "output" and s.node is not None}
    for out_idx, tangent in jg.output_tangents:
        if out_idx in out_slot:
            tie(out_slot[out_idx], tangent.name, f"output {out_idx} and its tangent")

    blocks = None
    if repeated_blocks:  # content-hashed copies of repeated blocks
        blocks = find_repeated_blocks(cands, menu_h=menu_h)
        for members in blocks.copies + blocks.flow_coupled:
            first = members[0]
            for other in members[1:]:
                if menu(first) == menu(other):
                    uf.union(first, other)
    root_index: dict[str, int] = {}
    groups: list[list[str]] = []
    for n in names:  # topological order of the first member
        r = uf.find(n)
        if r not in root_index:
            root_index[r] = len(groups)
            groups.append([])
        groups[root_index[r]].append(n)
    group_of = {n: root_index[uf.find(n)] for n in names}
    if blocks is not None:
        log.info("%s", blocks.summary(len(groups)))
    return groups, group_of
