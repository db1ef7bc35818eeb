"""Stage 4: the Plan - one strategy per node, its cost breakdown, and how to read it.

A Plan is what the user inspects, saves and replays: chosen placements per node
(inputs -> outputs), the objective with its breakdown (compute; communication per
collective kind and mesh axis), solver and timings, plus the identity of what it was
made for (model fingerprint, input shapes, mesh, hardware, torch version) so that a
replay on a different model or mesh is refused with a clear message.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.auto.cost import CostModel
from parallel.auto.cost.memory import MemoryEstimate
from parallel.auto.formulation import edge_roles
from parallel.auto.placements import placement_str, placement_words, spec_placement_strs
from parallel.auto.pricing import StrategyPricer, comm_dtype
from parallel.auto.problem import Problem
from parallel.auto.regions import option_names
from parallel.auto.strategies import PLACEHOLDER, SLOT
from parallel.auto.trace import layer_prefix

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class PlanMismatchError(ValueError):
    """A saved plan was made for a different model, inputs or mesh."""


@dataclass
class NodePlan:
    """Chosen strategy of one node, in words that survive JSON."""

    name: str
    kind: str  # placeholder | op | getitem | slot
    target: str  # op name, or the placeholder / output label
    label: str  # "param layers.0.attention.wq.weight", "grad of param ...", ""
    phase: str  # fwd | bwd
    module: str  # innermost module FQN ("" = top level)
    strategy: int  # index into the node's candidate list
    inputs: list[str]  # input node names, aligned with input_placements
    input_placements: list[str]
    output_placements: list[str]  # one entry per output (tuple outputs have several)
    compute_us: float = 0.0


@dataclass
class Plan:
    """A solved placement plan."""

    nodes: dict[str, NodePlan]
    objective_us: float
    compute_us: float
    comm_us: dict[str, float]  # "kind@axis_name" -> µs
    comm_bytes: dict[str, float]
    solver: str
    status: str
    timings: dict[str, float]  # trace / candidates / build / solve seconds
    num_vars: int
    fingerprint: str
    input_shapes: list
    mesh_shape: list[int]
    mesh_axis_names: list[str]
    hardware: str
    torch_version: str
    mp_param_dtype: str | None = None
    memory_fraction: float = 0.0  # parameter bytes per device / total parameter bytes
    memory_budget: list = field(default_factory=list)  # [low, high]
    constraints: list[str] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)  # local_map regions of the traced graph (regions/)
    memory: MemoryEstimate | None = None  # peak bytes per device (cost/memory.py); None: not estimated
    # in-memory only (not saved): the problem and solution behind the plan
    problem: Any = field(default=None, repr=False, compare=False)
    labels: list[int] | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ lookup
    def _resolve(self, node: Any) -> str:
        if isinstance(node, torch.fx.Node):
            return node.name
        if node in self.nodes:
            return node
        for n in self.nodes.values():
            if n.label in (f"param {node}", f"buffer {node}", f"input {node}", node):
                return n.name
        raise KeyError(f"no node or parameter named {node!r} in the plan")

    def node(self, node: Any) -> NodePlan:
        return self.nodes[self._resolve(node)]

    def placement(self, node: Any) -> str:
        """Output placement of a node or parameter (by FQN), e.g. '(S(0), S(1))'."""
        return self.node(node).output_placements[0]

    def param_placements(self) -> dict[str, str]:
        return {n.label[len("param "):]: n.output_placements[0]
                for n in self.nodes.values() if n.label.startswith("param ")}

    def grad_placement(self, fqn: str) -> str:
        for n in self.nodes.values():
            if n.kind == SLOT and n.label == f"grad of param {fqn}":
                return n.output_placements[0]
        raise KeyError(f"no gradient output for parameter {fqn!r}")

    def collectives(self) -> list[dict]:
        """Every redistribution the plan implies (needs the in-memory problem)."""
        prob = self._need_problem("collectives")
        cm = prob.cost_model
        out = []
        for e in prob.edges:
            a = e.src_cls[self.labels[e.src]]
            b = e.dst_cls[self.labels[e.dst]]
            src, dst = e.src_placements[a], e.dst_placements[b]
            if src == dst:
                continue
            meta = (e.tensor[0], comm_dtype(e.tensor[1], prob.mp_dtype))
            for producer, consumer, k in e.members:
                for c in cm.redistribute_collectives(src, dst, meta):
                    out.append({
                        "producer": producer, "consumer": consumer, "input": k,
                        "src": placement_str(src), "dst": placement_str(dst),
                        "kind": c.kind, "axis": c.axis_name, "bytes": c.bytes, "time_us": c.time_us,
                        "phase": self.nodes[consumer].phase if consumer in self.nodes else "",
                    })
        # redistributions inside tied groups (a producer and consumer tied together)
        return out

    # ------------------------------------------------------------------ save / load
    def to_json(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
             if f.name not in ("problem", "labels", "nodes", "memory")}
        d["memory"] = self.memory.to_json() if self.memory is not None else None
        d["format_version"] = FORMAT_VERSION
        d["nodes"] = [asdict(n) for n in self.nodes.values()]
        return d

    def save(self, path: str) -> None:
        """Write the plan as JSON (to `path.tmp`, then renamed: never half-written)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, d: dict, source: str = "the plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanMismatchError(f"{source} is not a plan (a JSON object was expected); re-plan")
        d = dict(d)
        if d.pop("format_version", None) != FORMAT_VERSION:
            raise PlanMismatchError(f"{source}: plan file format is not version {FORMAT_VERSION}; re-plan")
        try:
            nodes = {n["name"]: NodePlan(**n) for n in d.pop("nodes")}
            memory = d.pop("memory", None)  # plans written before the estimate have none
            return cls(nodes=nodes, memory=MemoryEstimate.from_json(memory, source) if memory else None, **d)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanMismatchError(f"{source} is not a complete plan ({type(e).__name__}: {e}); re-plan") from None

    @classmethod
    def load(cls, path: str, *, model: nn.Module | None = None, mesh: DeviceMesh | None = None,
             input_shapes: list | None = None) -> "Plan":
        """Load a plan; refuse it (PlanMismatchError) if unreadable or made for another model, inputs or mesh."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise PlanMismatchError(f"cannot read the plan file {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanMismatchError(f"{path} is not a plan file (invalid JSON: {e}); "
                                    "point plan_file at a plan.json written by the planner, or re-plan") from None
        plan = cls.from_json(data, source=path)
        plan.check_compatible(model=model, mesh=mesh, input_shapes=input_shapes, source=path)
        return plan

    def check_compatible(self, *, model: nn.Module | None = None, mesh: DeviceMesh | None = None,
                         input_shapes: list | None = None, source: str = "plan") -> None:
        if model is not None:
            from parallel.auto.trace import model_fingerprint

            fp = model_fingerprint(model)
            if fp != self.fingerprint:
                raise PlanMismatchError(
                    f"{source} was made for a different model (fingerprint {self.fingerprint}, this model "
                    f"{fp}: class or parameter names/shapes/dtypes differ); re-plan for this model"
                )
        if mesh is not None:
            shape = list(mesh.shape)
            names = list(mesh.mesh_dim_names or [])
            if shape != list(self.mesh_shape) or (names and names != list(self.mesh_axis_names)):
                raise PlanMismatchError(
                    f"{source} was made for mesh {tuple(self.mesh_shape)} {tuple(self.mesh_axis_names)}, "
                    f"not {tuple(shape)} {tuple(names)}; re-plan for this mesh"
                )
        if input_shapes is not None and [list(map(list, x)) if isinstance(x, tuple) else x for x in input_shapes] != [
            list(map(list, x)) if isinstance(x, tuple) else x for x in self.input_shapes
        ]:
            raise PlanMismatchError(f"{source} was made for inputs {self.input_shapes}, not {input_shapes}; re-plan "
                                    "for this shape (or price its placements here: AutoParallel.replay_placement)")

    # ------------------------------------------------------------------ reports
    def breakdown(self) -> str:
        lines = [f"objective {self.objective_us:,.1f} µs = compute {self.compute_us:,.1f} µs "
                 f"+ comm {sum(self.comm_us.values()):,.1f} µs"]
        for k in sorted(self.comm_us):
            lines.append(f"  {k:<28} {self.comm_us[k]:>12,.1f} µs  {self.comm_bytes.get(k, 0) / 2**20:>10,.1f} MiB")
        return "\n".join(lines)

    def summary(self) -> str:
        """Per-layer table: what each projection does on each mesh axis, in words."""
        rows = linear_roles(self)
        by_module: dict[str, list[str]] = defaultdict(list)
        for fqn, words in rows:
            layer = layer_prefix(fqn.rpartition(".")[0], innermost=True) or ""
            short = fqn[len(layer) + 1:] if layer else fqn
            by_module[layer].append(f"{short.removesuffix('.weight')}: {words}")
        lines = [
            f"Plan for mesh {tuple(self.mesh_shape)} {tuple(self.mesh_axis_names)} on {self.hardware} "
            f"({self.solver}, {self.status}, {self.timings.get('solve', 0):.2f}s)",
            self.breakdown(),
            f"parameter memory per device: {self.memory_fraction:.4f} of all parameter bytes",
        ]
        if self.memory is not None:
            lines.append(self.memory.summary())
        collapsed = _collapse_layers(by_module)
        for layer, items in collapsed:
            lines.append(f"{layer or '(top)'}:")
            lines.extend(f"  {it}" for it in items)
        return "\n".join(lines)

    def costs_for_node(self, node: Any) -> list[dict]:
        """Every candidate of a node: compute and redistribution µs given the neighbours' choices."""
        prob = self._need_problem("costs_for_node")
        name = self._resolve(node)
        g = prob.group_of[name]
        cands = prob.candidates.nodes[name]
        comm = np.zeros(prob.n_strategies[g])
        for e in prob.edges:
            if e.src == g:
                b = e.dst_cls[self.labels[e.dst]]
                comm += e.cost[e.src_cls, b]
            elif e.dst == g:
                a = e.src_cls[self.labels[e.src]]
                comm += e.cost[a, e.dst_cls]
        rows = []
        pbytes = prob.param_bytes.get(g)
        for s, spec in enumerate(cands.specs):
            outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
            rows.append({
                "strategy": s,
                "param_bytes": float(pbytes[s]) if pbytes is not None else 0.0,
                "inputs": [placement_str(i.placements) for i in (spec.input_specs or [])],
                "outputs": [placement_str(o.placements) if o is not None else "-" for o in outs],
                "compute_us": float(prob.unary[g][s]),
                "comm_us": float(comm[s]),
                "total_us": float(prob.unary[g][s] + comm[s]),
                "allowed": bool(prob.allowed[g][s]),
                "chosen": s == self.labels[g],
            })
        return rows

    def explain(self, node: Any, top: int = 5) -> str:
        """Why this strategy: its cost vs the best alternatives, all else fixed."""
        name = self._resolve(node)
        prob = self._need_problem("explain")
        g = prob.group_of[name]
        rows = self.costs_for_node(name)
        chosen = next(r for r in rows if r["chosen"])
        others = sorted((r for r in rows if not r["chosen"]), key=lambda r: r["total_us"])
        n = self.nodes[name]
        copies = len(prob.groups[g])
        lines = [
            f"{name} ({n.label or n.target}, {n.phase}, module {n.module or '-'}): "
            f"{' , '.join(chosen['inputs']) or '-'} -> {', '.join(chosen['outputs'])}",
            f"  chosen: compute {chosen['compute_us']:.1f} µs + redistribution {chosen['comm_us']:.1f} µs "
            f"= {chosen['total_us']:.1f} µs (decided jointly for {copies} tied node(s))",
        ]
        for r in others[:top]:
            why = "forbidden by a constraint" if not r["allowed"] else (
                "not allowed (needs a Replicate->Partial redistribution)" if not math.isfinite(r["total_us"])
                else f"+{r['total_us'] - chosen['total_us']:.1f} µs")
            if r["param_bytes"] > chosen["param_bytes"] and r["total_us"] < chosen["total_us"]:
                why += f", but {r['param_bytes'] / 2**20:,.1f} MiB of parameters per device: over the memory budget"
            lines.append(
                f"  alt {r['strategy']}: {', '.join(r['inputs']) or '-'} -> {', '.join(r['outputs'])}: "
                f"compute {r['compute_us']:.1f} + comm {r['comm_us']:.1f} = {r['total_us']:.1f} µs ({why})"
            )
        if len(others) > top:
            lines.append(f"  ... {len(others) - top} more")
        return "\n".join(lines)

    def diff(self, other: "Plan") -> "PlanDiff":
        changed = []
        for name, a in self.nodes.items():
            b = other.nodes.get(name)
            if b is None:
                continue
            if a.output_placements != b.output_placements or a.input_placements != b.input_placements:
                changed.append((name, a, b))
        return PlanDiff(self.objective_us, other.objective_us, changed,
                        sorted(set(other.nodes) - set(self.nodes)), sorted(set(self.nodes) - set(other.nodes)))

    def _need_problem(self, what: str) -> Any:
        if self.problem is None or self.labels is None:
            raise RuntimeError(f"Plan.{what} needs the in-memory plan from optimize_placement "
                               "(a loaded plan has no costs)")
        return self.problem

    def __str__(self) -> str:
        return self.summary()


@dataclass
class PlanDiff:
    """Nodes whose placements differ between two plans, and the objective change."""

    objective_a: float
    objective_b: float
    changed: list[tuple[str, NodePlan, NodePlan]]
    only_in_b: list[str]
    only_in_a: list[str]

    @property
    def objective_delta(self) -> float:
        return self.objective_b - self.objective_a

    def __len__(self) -> int:
        return len(self.changed)

    def __str__(self) -> str:
        lines = [f"{len(self.changed)} nodes changed; objective {self.objective_a:,.1f} -> {self.objective_b:,.1f} µs "
                 f"({self.objective_delta:+,.1f})"]
        for name, a, b in self.changed[:50]:
            lines.append(f"  {name} [{a.label or a.target}]: {', '.join(a.input_placements) or '-'} -> "
                         f"{', '.join(a.output_placements)}  =>  "
                         f"{', '.join(b.input_placements) or '-'} -> {', '.join(b.output_placements)}")
        if len(self.changed) > 50:
            lines.append(f"  ... {len(self.changed) - 50} more")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Building a Plan from a solved Problem
# ---------------------------------------------------------------------------


def _node_plan(prob: Problem, name: str, s: int) -> NodePlan:
    c = prob.candidates.nodes[name]
    jg = prob.candidates.graph
    out_strs, in_strs = spec_placement_strs(c.specs[s])
    if c.kind == SLOT:
        slot = next(sl for sl in jg.slots if sl.index == c.slot_index)
        label = {"grad_param": f"grad of param {slot.of}", "grad_input": f"grad of input {slot.of}",
                 "output": f"output {slot.of}"}.get(slot.kind, slot.kind)
        target, phase, module = "output", "bwd" if slot.kind != "output" else "fwd", ""
    else:
        label = jg.labels.get(name, "") if c.kind == PLACEHOLDER else ""
        target = str(c.node.target) if c.kind != PLACEHOLDER else "placeholder"
        phase, module = jg.phase.get(name, "fwd"), jg.module_of.get(name, "")
    return NodePlan(name=name, kind=c.kind, target=target, label=label, phase=phase, module=module, strategy=int(s),
                    inputs=[a.name for a in c.inputs], input_placements=in_strs if c.kind != PLACEHOLDER else [],
                    output_placements=out_strs, compute_us=float(prob.compute[name][s]))


def _add_collectives(acc: tuple[dict, dict], cm: CostModel, src: tuple, dst: tuple, meta: tuple, copies: int,
                     priced_us: float) -> None:
    """Add one redistribution's collectives, their µs scaled so that they sum to what the
    problem priced (bucketed and overlapped collectives cost less than issued alone)."""
    cols = [c for c in cm.redistribute_collectives(src, dst, meta) if c.kind != "local"]
    raw = sum(c.time_us for c in cols) * copies
    for col in cols:
        key = f"{col.kind}@{col.axis_name}"
        acc[0][key] += col.time_us * copies * (priced_us / raw if raw else 0.0)
        acc[1][key] += col.bytes * copies


def _comm_breakdown(prob: Problem, labels: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    """(µs, bytes) per "kind@axis": the edges between groups, and the redistributions inside
    a group (a producer tied to its consumer, folded into the unary cost), at their prices."""
    acc: tuple[dict, dict] = (defaultdict(float), defaultdict(float))
    cm = prob.cost_model
    for e in prob.edges:
        a, b = e.src_cls[labels[e.src]], e.dst_cls[labels[e.dst]]
        src, dst = e.src_placements[a], e.dst_placements[b]
        if src != dst:
            meta = (e.tensor[0], comm_dtype(e.tensor[1], prob.mp_dtype))
            _add_collectives(acc, cm, src, dst, meta, len(e.members), float(e.cost[a, b]))
    cands = prob.candidates
    pricer, roles = StrategyPricer(cands, cm, prob.mp_dtype), edge_roles(cands, cm)
    for name, c in cands.nodes.items():
        if c.kind == PLACEHOLDER:
            continue
        s = labels[prob.group_of[name]]
        for k, src_node in enumerate(c.inputs):
            if prob.group_of[src_node.name] != prob.group_of[name]:
                continue
            src_spec = cands.nodes[src_node.name].specs[s].output_specs
            if isinstance(src_spec, tuple):
                src_spec = src_spec[c.getitem_index or 0]
            dst_pl = c.specs[s].input_specs[k].placements
            if src_spec.placements != dst_pl:
                val = src_node.meta["val"]
                val = val[c.getitem_index or 0] if isinstance(val, (tuple, list)) else val
                meta = (tuple(val.shape), comm_dtype(val.dtype, prob.mp_dtype))
                priced = pricer.redistribution(meta[0], val.dtype, [src_spec.placements], [dst_pl],
                                               roles(src_node.name, c))[0, 0]
                _add_collectives(acc, cm, src_spec.placements, dst_pl, meta, 1, float(priced))
    return dict(acc[0]), dict(acc[1])


def build_plan(prob: Problem, labels: list[int], *, solver: str, status: str, timings: dict[str, float], num_vars: int,
               hardware: str, memory_budget: tuple, constraints: list[str]) -> Plan:
    """The Plan of a solved Problem: one NodePlan per node, the objective and its breakdown."""
    cands = prob.candidates
    jg, mesh = cands.graph, cands.mesh
    nodes = {name: _node_plan(prob, name, labels[prob.group_of[name]]) for name in cands.nodes}
    comm_us, comm_bytes = _comm_breakdown(prob, labels)
    mem = sum(float(prob.param_bytes[g][labels[g]]) for g in prob.param_groups)
    return Plan(
        nodes=nodes, objective_us=float(prob.energy(labels)), compute_us=sum(n.compute_us for n in nodes.values()),
        comm_us=comm_us, comm_bytes=comm_bytes, solver=solver, status=status, timings=dict(timings),
        num_vars=int(num_vars), fingerprint=jg.fingerprint, input_shapes=[[list(s), d] for s, d in jg.input_shapes],
        mesh_shape=list(mesh.shape),
        mesh_axis_names=list(mesh.mesh_dim_names or [f"axis{i}" for i in range(mesh.ndim)]),
        hardware=hardware, torch_version=torch.__version__,
        mp_param_dtype=str(prob.mp_dtype) if prob.mp_dtype is not None else None,
        memory_fraction=mem / prob.total_param_bytes if prob.total_param_bytes else 0.0,
        memory_budget=list(memory_budget), constraints=list(constraints), problem=prob, labels=list(labels),
        regions=list(jg.regions),
    )


# ---------------------------------------------------------------------------
# Words for what a projection does
# ---------------------------------------------------------------------------


def linear_roles(plan: Plan) -> list[tuple[str, str]]:
    """(param FQN, words) for every parameter, from its forward use.

    A 2-D weight used through `t` by a forward mm: S(out) on an axis is column-parallel,
    S(in) row-parallel; used Replicate while stored sharded is FSDP (all-gather), stored
    Replicate with a sharded activation is data parallel (gradient all-reduce).
    """
    consumers: dict[str, list[NodePlan]] = defaultdict(list)
    for n in plan.nodes.values():
        for i, src in enumerate(n.inputs):
            consumers[src].append(n)
    names = plan.mesh_axis_names
    out = []
    for n in plan.nodes.values():
        if not n.label.startswith("param "):
            continue
        fqn = n.label[len("param "):]
        stored = placement_words(n.output_placements[0])
        region = _region_use(n, consumers)
        if region is not None:
            out.append((fqn, "; ".join(f"{w} on {name}" for w, name in zip(region, names))))
            continue
        use, act, weight_dims = _forward_use(n, consumers)
        words = []
        for ax, name in enumerate(names):
            st = stored[ax] if ax < len(stored) else "R"
            if use is None:
                words.append(f"{_store_words(st)} on {name}")
                continue
            u = use[ax]
            a = act[ax] if act is not None else "R"
            if u.startswith("S("):
                d = int(u[2:-1])
                role = weight_dims.get(d, f"sharded dim {d}")
                w = role
            elif st.startswith("S("):
                w = "FSDP (all-gather)" if a.startswith("S(") else "gathered, replicated compute"
            else:
                w = "data parallel (replicated, grad all-reduce)" if a.startswith("S(") else "replicated"
            words.append(f"{w} on {name}")
        out.append((fqn, "; ".join(words)))
    return out


def _region_use(param: NodePlan, consumers: dict[str, list[NodePlan]]) -> list[str] | None:
    """Per mesh axis "option of region r (stored ...)" when a local_map region consumes the
    parameter in the forward (directly or through a dtype cast), else None."""
    frontier = [param.name]
    while frontier:
        name = frontier.pop(0)
        for c in consumers.get(name, []):
            if c.phase != "fwd":
                continue
            if c.target == "aten._to_copy.default":
                frontier.append(c.name)
                continue
            opts = option_names(c.target, c.input_placements)
            if opts is None:
                return None
            stored = placement_words(param.output_placements[0])
            region = c.target.split(".")[1]
            return [f"{o} (region {region}, {_store_words(st)})" for o, st in zip(opts, stored)]
    return None


def _store_words(st: str) -> str:
    return "stored replicated" if st == "R" else f"stored {st}"


def _forward_use(param: NodePlan,
                 consumers: dict[str, list[NodePlan]]) -> tuple[list[str] | None, list[str] | None, dict[int, str]]:
    """Weight placement seen by its first forward matmul/embedding, the activation's, and dim roles."""
    frontier = [(param.name, False)]
    seen = set()
    while frontier:
        name, transposed = frontier.pop(0)
        if name in seen:
            continue
        seen.add(name)
        for c in consumers.get(name, []):
            if c.phase != "fwd":
                continue
            op = c.target
            k = c.inputs.index(name)
            if op in ("aten.t.default", "aten.transpose.int") and not transposed:
                frontier.append((c.name, True))
            elif op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default"):
                use = placement_words(c.input_placements[k])
                act = placement_words(c.input_placements[1 - k]) if len(c.input_placements) > 1 else None
                # Linear weight [out, in] used as t(W) = [in, out]
                # Linear weight [out, in] is used as t(W) = [in, out]; X @ W uses W = [in, out]
                return use, act, {1: "column-parallel", 0: "row-parallel"}
            elif op == "aten.embedding.default" and k == 0:
                use = placement_words(c.input_placements[0])
                act = placement_words(c.input_placements[1])
                return use, act, {0: "vocab-parallel", 1: "embedding-dim sharded"}
            elif op in ("aten._to_copy.default", "aten.view.default", "aten._unsafe_view.default",
                        "aten.detach.default"):
                frontier.append((c.name, transposed))
            elif c.kind == "op":
                use = placement_words(c.input_placements[k])
                others = [p for i, p in enumerate(c.input_placements) if i != k]
                act = placement_words(others[0]) if others else None
                return use, act, {}
    return None, None, {}


def _collapse_layers(by_layer: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """Merge consecutive layers with identical descriptions ("layers.0-31")."""
    out: list[tuple[str, list[str]]] = []
    for layer, items in by_layer.items():
        m = re.match(r"(.*\.)(\d+)$", layer)
        if out and m:
            prev_name, prev_items = out[-1]
            pm = re.match(r"(.*\.)(\d+)(?:-(\d+))?$", prev_name)
            if (pm and pm.group(1) == m.group(1) and prev_items == items
                    and int(pm.group(3) or pm.group(2)) + 1 == int(m.group(2))):
                out[-1] = (f"{pm.group(1)}{pm.group(2)}-{m.group(2)}", prev_items)
                continue
        out.append((layer, items))
    return out
