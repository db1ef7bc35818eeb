"""The coverage report: every ATen op of a joint graph and how the planner handles it.

For a model nobody here wrote, this is the first thing to read: each op of the traced
forward+backward graph with its node count, the modules it comes from and how it is planned

  * `DTensor rule (...)`: candidate placements from DTensor's own sharding rules;
  * `constant`: built from no data input (factory ops, ops on lifted constants): replicated;
  * `lifted constant`: a get_attr tensor (plain tensor attribute, `torch.tensor` in forward):
    a replicated input of the plan, every rank holds it;
  * `replicate fallback`: DTensor has no rule; the op runs on replicated inputs (correct,
    never sharded) - the reason is listed;

then the data-dependent reads kept out of the graph (folded at trace time, fold.py), one
note per attention call no fused kernel of the job's device takes (traced through torch's
math path, trace/attention.py), and the nodes the planner cannot place, with their modules
(`unhandled`; planning refuses them).

    report = coverage_report(graph, mesh)       # or AutoParallel(...).coverage()
    print(report); assert report.ok
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh

from parallel.auto.candidates.strategies import GETITEM, OP, PLACEHOLDER, Candidates, Unhandled, build_candidates
from parallel.auto.trace.fold import FoldedRead
from parallel.auto.trace.joint import JointGraph

_HOW = {"single_dim": "DTensor rule (single-dim)", "strategy_func": "DTensor rule (strategy function)",
        "decomp": "DTensor rule (decomposition)", "constant": "constant (no data input): replicated",
        "lifted_constant": "lifted constant: replicated input", "replicate_fallback": "replicate fallback"}
FALLBACK = _HOW["replicate_fallback"]


@dataclass
class OpUse:
    """One op handled one way: how many nodes, from which modules."""

    op: str
    how: str
    nodes: int = 0
    modules: set[str] = field(default_factory=set)
    reason: str = ""  # why a fallback fell back


@dataclass
class GraphCoverage:
    """How every op of one joint graph is handled on one mesh (module docstring)."""

    ops: list[OpUse]
    folded: list[FoldedRead]
    unhandled: list[Unhandled]
    attention_notes: list[str] = field(default_factory=list)  # SDPA calls planned through the math path

    @property
    def ok(self) -> bool:
        """True when every node can be planned."""
        return not self.unhandled

    def handled_as(self, how: str) -> list[str]:
        """The ops handled a given way (a value of `OpUse.how`, or a prefix such as "DTensor rule")."""
        return sorted({u.op for u in self.ops if u.how.startswith(how)})

    def __str__(self) -> str:
        lines = [f"coverage: {len(self.ops)} (op, handling) pairs, {sum(u.nodes for u in self.ops)} op nodes, "
                 f"{len(self.folded)} folded reads, {len(self.unhandled)} unhandled nodes, "
                 f"{len(self.attention_notes)} attention calls through the math path"]
        width = max((len(u.op) for u in self.ops), default=10)
        for u in sorted(self.ops, key=lambda u: (u.how != FALLBACK, u.how, u.op)):
            mods = ", ".join(sorted(m or "(root)" for m in u.modules)[:3]) + (" ..." if len(u.modules) > 3 else "")
            why = f"  [{u.reason}]" if u.reason else ""
            lines.append(f"  {u.op:<{width}} {u.nodes:>5}  {u.how}  ({mods}){why}")
        for f in self.folded:
            lines.append(f"  folded at trace time: {f.op} in '{f.module or '(root)'}' at {f.where} -> {f.value}")
        lines += [f"  note: {note}" for note in self.attention_notes]
        if self.unhandled:
            lines.append("unhandled (planning refuses the graph):")
            lines += [f"  {u}" for u in self.unhandled]
        else:
            lines.append("unhandled: none")
        return "\n".join(lines)


def coverage_of(cands: Candidates) -> GraphCoverage:
    """The report of already enumerated candidates."""
    uses: dict[tuple[str, str], OpUse] = {}
    reasons = cands.coverage.fallback
    module_of = cands.graph.module_of
    for name, c in cands.nodes.items():
        if c.kind == GETITEM or (c.kind == PLACEHOLDER and c.source != "lifted_constant"):
            continue
        if c.kind not in (OP, PLACEHOLDER):
            continue  # output slots
        op = str(c.node.target) if c.kind == OP else f"get_attr {c.node.target}"
        how = _HOW.get(c.source, c.source)
        u = uses.setdefault((op, how), OpUse(op, how, reason=reasons.get(op, "") if how == FALLBACK else ""))
        u.nodes += 1
        u.modules.add(module_of.get(name, ""))
    return GraphCoverage(list(uses.values()), list(cands.graph.folded), list(cands.unhandled),
                         list(cands.graph.attention_notes))


def coverage_report(graph: JointGraph, mesh: DeviceMesh) -> GraphCoverage:
    """Enumerate `graph` on `mesh` without refusing it and report how each op is handled."""
    return coverage_of(build_candidates(graph, mesh, strict=False))
