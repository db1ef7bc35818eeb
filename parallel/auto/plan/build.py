"""A Plan built from a solved Problem: one NodePlan per node (with its role), the objective,
and its breakdown per collective kind and mesh axis priced once here, at the problem's prices
(the plan keeps the numbers, not the pricing)."""

from __future__ import annotations

from collections import defaultdict

import torch

from parallel.auto.candidates.placements import spec_placement_strs
from parallel.auto.candidates.strategies import PLACEHOLDER, SLOT
from parallel.auto.cost import CostModel
from parallel.auto.plan.costs import PlanCosts
from parallel.auto.plan.data import NodePlan, Plan
from parallel.auto.problem.formulation import edge_roles
from parallel.auto.problem.placement_problem import Problem
from parallel.auto.problem.pricing import StrategyPricer, comm_dtype
from parallel.auto.problem.recompute import activation_bytes, recompute_us
from parallel.auto.trace.joint import GRAD_PARAM, OTHER, OUTPUT


def _node_plan(prob: Problem, name: str, s: int) -> NodePlan:
    c = prob.candidates.nodes[name]
    jg = prob.candidates.graph
    out_strs, in_strs = spec_placement_strs(c.specs[s])
    if c.kind == SLOT:
        slot = next(sl for sl in jg.slots if sl.index == c.slot_index)
        role = slot.role
        label = role.label() if slot.kind != OTHER else OTHER
        target, phase, module = "output", "bwd" if slot.kind != OUTPUT else "fwd", ""
    else:
        role = jg.roles.get(name) if c.kind == PLACEHOLDER else None
        label = role.label() if role is not None else ""
        target = str(c.node.target) if c.kind != PLACEHOLDER else "placeholder"
        phase, module = jg.phase.get(name, "fwd"), jg.module_of.get(name, "")
    return NodePlan(name=name, kind=c.kind, target=target, label=label, phase=phase, module=module, strategy=int(s),
                    inputs=[a.name for a in c.inputs], input_placements=in_strs if c.kind != PLACEHOLDER else [],
                    output_placements=out_strs, compute_us=float(prob.compute[name][s]), role=role)


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


def _grad_slots(prob: Problem) -> set[str]:
    """Names of the output slots that are parameter gradients."""
    kinds = {sl.index: sl.kind for sl in prob.candidates.graph.slots}
    return {name for name, c in prob.candidates.nodes.items()
            if c.kind == SLOT and kinds.get(c.slot_index) == GRAD_PARAM}


def comm_breakdown(prob: Problem, labels: list[int]) -> tuple[dict[str, float], dict[str, float], float]:
    """(µs, bytes) per "kind@axis": the edges between groups, and the redistributions inside
    a group (a producer tied to its consumer, folded into the unary cost), at their prices;
    and the µs of those that bring gradients to their parameters' placements (the gradient
    reductions: done once per optimizer step however many micro-batches it has)."""
    acc: tuple[dict, dict] = (defaultdict(float), defaultdict(float))
    grad_us = 0.0
    grad_slots = _grad_slots(prob)
    cm = prob.cost_model
    for e in prob.edges:
        if e.kind == "recompute":  # not a collective: recompute.py
            continue
        a, b = e.src_cls[labels[e.src]], e.dst_cls[labels[e.dst]]
        src, dst = e.src_placements[a], e.dst_placements[b]
        if src != dst:
            meta = (e.tensor[0], comm_dtype(e.tensor[1], prob.mp_dtype))
            _add_collectives(acc, cm, src, dst, meta, len(e.members), float(e.cost[a, b]))
            grads = sum(1 for _, consumer, _ in e.members if consumer in grad_slots)
            grad_us += float(e.cost[a, b]) * grads / len(e.members)
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
                grad_us += float(priced) if name in grad_slots else 0.0
    return dict(acc[0]), dict(acc[1]), grad_us


def recompute_summary(prob: Problem, labels: list[int]) -> dict:
    """What the solve chose to recompute (empty when the problem had no choice): the setting
    of each block, the forward time the backward spends again and the activation bytes kept."""
    choice = prob.recompute
    if choice is None:
        return {}
    label = int(labels[choice.group])
    kept_all = list(labels)
    kept_all[choice.group] = 0  # the same placements, every block kept whole
    kept = activation_bytes(prob, labels)
    return {"blocks": list(choice.options[label]), "summary": choice.describe(label),
            "recompute_us": recompute_us(prob, labels), "activation_bytes": kept,
            "saved_bytes": activation_bytes(prob, kept_all) - kept}


def build_plan(prob: Problem, labels: list[int], *, solver: str, status: str, timings: dict[str, float], num_vars: int,
               hardware: str, memory_budget: tuple, constraints: list[str]) -> Plan:
    """The Plan of a solved Problem: one NodePlan per node, the objective and its breakdown."""
    cands = prob.candidates
    jg, mesh = cands.graph, cands.mesh
    nodes = {name: _node_plan(prob, name, labels[prob.group_of[name]]) for name in cands.nodes}
    comm_us, comm_bytes, grad_us = comm_breakdown(prob, labels)
    mem = sum(float(prob.param_bytes[g][labels[g]]) for g in prob.param_groups)
    return Plan(
        nodes=nodes, objective_us=float(prob.energy(labels)), compute_us=sum(n.compute_us for n in nodes.values()),
        comm_us=comm_us, comm_bytes=comm_bytes, grad_reduction_us=grad_us, solver=solver, status=status,
        timings=dict(timings),
        num_vars=int(num_vars), fingerprint=jg.fingerprint, input_shapes=[[list(s), d] for s, d in jg.input_shapes],
        mesh_shape=list(mesh.shape),
        mesh_axis_names=list(mesh.mesh_dim_names or [f"axis{i}" for i in range(mesh.ndim)]),
        hardware=hardware, torch_version=torch.__version__,
        mp_param_dtype=str(prob.mp_dtype) if prob.mp_dtype is not None else None,
        memory_fraction=mem / prob.total_param_bytes if prob.total_param_bytes else 0.0,
        total_param_bytes=float(prob.total_param_bytes or 0.0),
        memory_budget=list(memory_budget), constraints=list(constraints), regions=list(jg.regions),
        recompute=recompute_summary(prob, labels), costs=PlanCosts(prob, list(labels)),
    )
