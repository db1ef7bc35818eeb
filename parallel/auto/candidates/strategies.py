"""Stage 2: JointGraph + mesh -> Candidates (valid strategies per node).

Op strategies come from DTensor's own sharding-propagation rules (enumeration.py). Besides
ATen ops there are three node kinds: placeholders (params, buffers, inputs, tangents) get
every evenly-divisible placement (parameters and their gradients also the uneven ones that
leave no rank empty, gathered before any op reads them); getitem picks one output of a tuple; and one virtual
"slot" per graph output (loss, gradients) where the output placement is decided, so a
Partial gradient can be reduce-scattered or all-reduced into it. Lifted constants
(get_attr: plain tensor attributes, `torch.tensor(...)` in forward) are placeholders with one
strategy, Replicate: every rank holds them (a consumer that wants a shard slices it locally,
for free). Ops computed from no data input at all (factory ops, causal masks, scalars, ops on
lifted constants) are constants: replicated by design. Nodes the planner cannot place (an op
returning no tensor) are collected and refused together with `UnsupportedGraphError`,
naming each op and its module (coverage.py reports them without raising).
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from parallel import _torch as T
from parallel.auto.candidates.enumeration import CoverageReport, OpEnumerator, make_spec, out_meta_of, tensor_meta
from parallel.auto.candidates.placements import Placements, evenly_divisible, fills_every_rank, tensor_placements
from parallel.auto.trace.joint import JointGraph

log = logging.getLogger("parallel.auto.candidates.strategies")

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
class Candidates:
    """Per-node candidate strategies for one joint graph on one mesh."""

    graph: JointGraph
    mesh: DeviceMesh
    nodes: dict[str, NodeCandidates]  # name -> candidates, in topological order (slots last)
    coverage: CoverageReport
    unique_keys: int
    seconds: float
    unhandled: list[Unhandled] = field(default_factory=list)  # only when built with strict=False
    # problems priced on these candidates, by cost model and repeated_blocks (formulation.py): the
    # parameter-budget rounds of one plan and the budget points of a sweep price them once
    priced: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getitem__(self, name: str) -> NodeCandidates:
        return self.nodes[name]

    def summary(self) -> str:
        n_specs = sum(len(c.specs) for c in self.nodes.values())
        return (
            f"Candidates: {len(self.nodes)} nodes, {n_specs} strategies, "
            f"{self.unique_keys} unique op keys, {self.seconds:.2f}s"
        )


CONSTANT_REASON = "constant built without data inputs (causal mask, scalar): replicated on every rank by design"


class UnsupportedGraphError(NotImplementedError):
    """The joint graph holds nodes the planner cannot place (listed with their modules)."""


@dataclass(frozen=True)
class Unhandled:
    """A node without candidate strategies: what it is, where it comes from, why."""

    node: str
    op: str
    module: str
    reason: str

    def __str__(self) -> str:
        return f"{self.op} (node {self.node}) in module '{self.module or '(root)'}': {self.reason}"


class _CandidateBuilder:
    """Walks the joint graph once, node kind by node kind (see the module docstring)."""

    def __init__(self, mesh: DeviceMesh, restrict: dict[str, list[tuple]] | None,
                 module_of: dict[str, str] | None = None, uneven: frozenset[str] = frozenset()):
        self.mesh = mesh
        # parameters and their gradients' slots: they may be split unevenly (FSDP2 pads the
        # collectives); every op still takes even shards, so an uneven one is gathered first
        self.uneven = uneven
        self.module_of = module_of or {}
        self.mesh_shape = tuple(mesh.shape)
        self.restrict = restrict or {}
        self.en = OpEnumerator(mesh)
        self.nodes: dict[str, NodeCandidates] = {}
        self.placeholder_cache: dict[Any, list[Any]] = {}
        # (id of the producer's specs, output index) -> (those specs, the getitem's): copies of a
        # layer share their producers' spec lists, so their getitems share one list too
        self.getitem_cache: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}
        self.constants: set[str] = set()  # nodes computed from no data input at all
        self.unhandled: list[Unhandled] = []

    def placeholder_specs(self, val: torch.Tensor, shard: bool = True, uneven: bool = False) -> list[Any]:
        key = (tuple(val.shape), tuple(val.stride()), val.dtype, shard, uneven)
        if key not in self.placeholder_cache:
            rep = tuple(Replicate() for _ in self.mesh_shape)
            pls = tensor_placements(tuple(val.shape), self.mesh_shape, uneven=uneven) if shard else [rep]
            self.placeholder_cache[key] = [T.OpSpec(make_spec(self.mesh, p, tensor_meta(val)), []) for p in pls]
        return self.placeholder_cache[key]

    def restricted_placeholder(self, val: torch.Tensor, keys: list[tuple], uneven: bool = False) -> list[Any]:
        outs = tuple(dict.fromkeys(k[0] for k in keys))
        ck = ("restricted", tuple(val.shape), tuple(val.stride()), val.dtype, outs, uneven)
        fits = fills_every_rank if uneven else evenly_divisible
        if ck not in self.placeholder_cache:
            self.placeholder_cache[ck] = [T.OpSpec(make_spec(self.mesh, p, tensor_meta(val)), []) for p in outs
                                          if fits(tuple(val.shape), p, self.mesh_shape)]
        return self.placeholder_cache[ck]

    def add_placeholder(self, n: fx.Node) -> None:
        val = n.meta["val"]
        shard, uneven = val.ndim > 0, n.name in self.uneven
        specs = (self.restricted_placeholder(val, self.restrict[n.name], uneven) if shard and n.name in self.restrict
                 else self.placeholder_specs(val, shard, uneven))
        self.nodes[n.name] = NodeCandidates(n.name, PLACEHOLDER, n, [], specs, key=None, source=PLACEHOLDER)

    def add_constant(self, n: fx.Node) -> None:
        """A lifted constant (get_attr): a replicated input of the plan, like a placeholder."""
        self.constants.add(n.name)
        specs = self.placeholder_specs(n.meta["val"], shard=False)
        self.nodes[n.name] = NodeCandidates(n.name, PLACEHOLDER, n, [], specs, key=None, source="lifted_constant")

    def add_getitem(self, n: fx.Node) -> None:
        src, idx = n.args[0], n.args[1]
        src_specs = self.nodes[src.name].specs
        hit = self.getitem_cache.get((id(src_specs), idx))
        if hit is None:
            seen: dict[Any, Any] = {}
            for s in src_specs:
                o = s.output_specs[idx] if isinstance(s.output_specs, tuple) else s.output_specs
                if o is not None and o.placements not in seen:
                    spec = make_spec(self.mesh, o.placements, o.tensor_meta)
                    seen[o.placements] = T.OpSpec(spec, [make_spec(self.mesh, o.placements, o.tensor_meta)])
            hit = self.getitem_cache[(id(src_specs), idx)] = (src_specs, list(seen.values()))
        self.nodes[n.name] = NodeCandidates(n.name, GETITEM, n, [src], hit[1], source=GETITEM, getitem_index=idx)

    def add_op(self, n: fx.Node) -> None:
        val = n.meta.get("val")
        if not isinstance(val, (torch.Tensor, tuple, list)):
            self.skip(n, f"returns {type(val).__name__}, not a tensor (a data-dependent scalar or a side effect)")
            return
        en = self.en
        ins = en.tensor_inputs(n)
        key = en.key(n)
        if all(a.name in self.constants for a in ins):
            self.constants.add(n.name)
            en.coverage.explained[str(n.target)] = CONSTANT_REASON
            specs, source = (en.replicate_only(n, [tensor_meta(a.meta["val"]) for a in ins], out_meta_of(val)),
                             "constant")
        elif n.name in self.restrict:
            specs, source = en.restricted(n, self.restrict[n.name], key)
        else:
            specs, source = en.enumerate(n, key)
        self.nodes[n.name] = NodeCandidates(n.name, OP, n, ins, specs, key=key, source=source)

    def skip(self, n: fx.Node, reason: str) -> None:
        self.unhandled.append(Unhandled(n.name, str(n.target), self.module_of.get(n.name, ""), reason))

    def add_slot(self, slot: Any) -> None:
        val = slot.node.meta["val"]
        name = f"output[{slot.index}]"
        uneven = name in self.uneven
        if name in self.restrict and val.ndim > 0:
            specs = self.restricted_placeholder(val, self.restrict[name], uneven)
        else:  # a gradient takes the same menu as its parameter; a scalar stays replicated
            specs = self.placeholder_specs(val, shard=val.ndim > 0, uneven=uneven)
        self.nodes[name] = NodeCandidates(name, SLOT, None, [slot.node],
                                          [T.OpSpec(s.output_specs, [s.output_specs]) for s in specs], source=SLOT,
                                          slot_index=slot.index)


def uneven_splittable(graph: JointGraph) -> frozenset[str]:
    """The nodes whose menu holds uneven shards: the parameters and their gradients' slots
    (the placements of the model's state, which only collectives read and write)."""
    names = {n.name for n in graph.params.values()}
    names.update(f"output[{s.index}]" for s in graph.slots if s.kind == "grad_param")
    return frozenset(names)


def mesh_candidates(graph: JointGraph, mesh: DeviceMesh) -> Candidates:
    """The candidates of `graph` on `mesh`, enumerated once per mesh object and kept on the
    graph (the last mesh's only): plans on one trace and one mesh -- a sweep's budget or
    hardware points, a plan and its replay -- share one enumeration and, through it, their
    priced problems (formulation.py). The candidates are read-only once built."""
    kept = graph.kept_candidates
    if kept is not None and kept.mesh is mesh:
        log.info("candidates: reused (%d nodes, enumerated earlier on this mesh)", len(kept.nodes))
        return kept
    graph.kept_candidates = None  # release the previous mesh's before enumerating
    cands = build_candidates(graph, mesh)
    graph.kept_candidates = cands
    return cands


def build_candidates(graph: JointGraph, mesh: DeviceMesh, restrict: dict[str, list[tuple]] | None = None, *,
                     strict: bool = True) -> Candidates:
    """Enumerate the candidate strategies of every node of `graph` on `mesh`.

    `restrict` (split-dimension seeding, solve/seed.py): node name -> the only strategy
    keys (output placements, input placements per tensor input) that node may take; the
    full product over the mesh is then never expanded for it. `strict`: refuse a graph with
    nodes the planner cannot place (UnsupportedGraphError listing all of them); otherwise
    they are left out and listed in `Candidates.unhandled` (the coverage report).
    """
    T.register_planner_ops()
    t0 = time.perf_counter()
    b = _CandidateBuilder(mesh, restrict, graph.module_of, uneven_splittable(graph))
    for n in graph.gm.graph.nodes:
        if n.op == "placeholder":
            b.add_placeholder(n)
        elif n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor):
            b.add_constant(n)
        elif n.op == "call_function" and n.target is operator.getitem:
            b.add_getitem(n)
        elif n.op == "call_function" and isinstance(n.target, T.OpOverload):
            b.add_op(n)
        elif n.op != "output":
            b.skip(n, f"{n.op} node the planner cannot place")
    if b.unhandled and strict:
        raise UnsupportedGraphError(
            f"{len(b.unhandled)} node(s) of the joint graph cannot be planned:\n  "
            + "\n  ".join(map(str, b.unhandled[:20]))
            + "\nsee parallel.auto.candidates.coverage.coverage_report(graph, mesh) for every op and how it is handled")
    for slot in graph.slots:
        if slot.node is not None:
            b.add_slot(slot)
    cands = Candidates(graph, mesh, b.nodes, b.en.coverage, len(b.en.cache), time.perf_counter() - t0,
                       unhandled=b.unhandled)
    log.info("candidates: %s", cands.summary())
    if not b.en.coverage.ok:
        log.info("%s", b.en.coverage)
    return cands
