"""Stage 3: Candidates + cost model + constraints -> Problem.

Groups tied nodes (`repeated_blocks.decision_groups`), prices every strategy and edge
(`pricing.StrategyPricer`), merges the edges of repeated-layer copies, applies the user
constraints and checks feasibility before any solver runs. The priced part is kept on the
candidates (`priced_problem`): a re-solve under another parameter budget only re-applies
the budget and the constraints.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from parallel.auto.candidates.placements import join_buckets, shard_factor
from parallel.auto.candidates.strategies import GETITEM, PLACEHOLDER, SLOT, Candidates, NodeCandidates
from parallel.auto.cost import CostModel
from parallel.auto.losses import NLL_BACKWARD, is_mean_nll_without_weights
from parallel.auto.problem.feasibility import apply_constraint, check_feasible
from parallel.auto.problem.placement_problem import Constraint, Edge, Problem
from parallel.auto.problem.pricing import ACTIVATION, LOSS, EdgeRole, StrategyPricer
from parallel.auto.problem.recompute import RECOMPUTE_GROUP, RecomputeRow, recompute_edges, row_can_bind
from parallel.auto.problem.repeated_blocks import decision_groups
from parallel.auto.trace.joint import BWD, FWD, layer_prefix

log = logging.getLogger("parallel.auto.problem.placement_problem")


def _classes(placements: list[tuple]) -> tuple[np.ndarray, list[tuple]]:
    index: dict[tuple, int] = {}
    cls = np.empty(len(placements), dtype=np.int64)
    for i, p in enumerate(placements):
        cls[i] = index.setdefault(p, len(index))
    return cls, list(index)


def _output_placements(c: NodeCandidates, idx: int | None) -> list[tuple]:
    out = []
    for s in c.specs:
        o = s.output_specs
        if isinstance(o, tuple):
            o = o[idx or 0]
        out.append(o.placements)
    return out


def _edge_tensor(src_node: Any, idx: int | None) -> tuple[tuple[int, ...], torch.dtype]:
    val = src_node.meta["val"]
    if isinstance(val, (tuple, list)):
        val = val[idx or 0]
    return tuple(val.shape), val.dtype


def joined_buckets(params: dict[str, Any], cap_bytes: int) -> dict[str, int]:
    """FQN -> tensors in its gradient's bucket when the runtime joins the blocks' buckets
    (`placements.join_buckets`, as runtime/runner.py `merge_small_buckets`). Sized by the
    whole gradients (a reduction's input), one bucket key for all: a plan that reduces
    some gradients one way and some another runs more buckets than this counts."""
    blocks: dict[str | None, list[str]] = {}
    for fqn in params:
        blocks.setdefault(layer_prefix(fqn) or fqn, []).append(fqn)
    out: dict[str, int] = {}
    backward_order = ((None, members, sum(_nbytes(params[f]) for f in members))
                      for members in reversed(blocks.values()))
    for _, members in join_buckets(backward_order, cap_bytes):
        out.update(dict.fromkeys(members, len(members)))
    return out


def _nbytes(node: Any) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


class _Roles:
    """The runtime role of each edge (pricing.EdgeRole): parameter gathers are bucketed per
    block, gradient reductions per joined bucket (`joined_buckets`), the rest is issued
    where it is needed."""

    def __init__(self, cands: Candidates, reshard: bool, reduce_bucket_bytes: int = 0):
        jg = cands.graph
        self.graph, self.reshard, self.nodes = jg, reshard, cands.nodes
        self.param_of = {n.name: fqn for fqn, n in jg.params.items()}
        blocks = Counter(layer_prefix(fqn) for fqn in jg.params)
        self.bucket = {fqn: blocks[layer_prefix(fqn)] for fqn in jg.params}
        self.grad_bucket = joined_buckets(jg.params, reduce_bucket_bytes)
        self.grad_of = {f"output[{s.index}]": s.of for s in jg.slots if s.kind == "grad_param"}
        self.loss_outputs = {f"output[{s.index}]" for s in jg.slots if s.kind == "output"}

    def __call__(self, src_name: str, c: NodeCandidates) -> EdgeRole:
        fqn = self.param_of.get(src_name)
        if fqn is not None:
            jg = self.graph
            again = (self.reshard and c.node is not None and jg.phase.get(c.name) == FWD
                     and any(jg.phase.get(u.name) == BWD for u in c.node.users))
            return EdgeRole("param", self.bucket[fqn], 2 if again else 1)
        if c.name in self.grad_of:
            return EdgeRole("grad", self.grad_bucket[self.grad_of[c.name]])
        if self._loss_scalar(src_name, c):
            return LOSS
        return ACTIVATION

    def _loss_scalar(self, src_name: str, c: NodeCandidates) -> bool:
        """The mean loss or its token count on its way to the step's output or to the loss's
        backward: their all-reduces run beside the step's compute (runtime/loss_sync.py)."""
        src = self.nodes[src_name].node
        fwd = src.args[0] if src is not None and src.target is operator.getitem else src
        if not is_mean_nll_without_weights(fwd):
            return False
        if c.kind == SLOT:
            return c.name in self.loss_outputs
        return c.kind == GETITEM or (c.node is not None and c.node.target is NLL_BACKWARD)


def edge_roles(cands: Candidates, cost_model: CostModel) -> _Roles:
    """The runtime role of every edge of `cands` under `cost_model`'s schedule."""
    schedule = getattr(cost_model, "schedule", None)
    return _Roles(cands, bool(schedule and schedule.reshard_after_forward),
                  schedule.reduce_bucket_bytes if schedule is not None else 0)


def _price_edges(cands: Candidates, group_of: dict[str, int], unary: list[np.ndarray],
                 pricer: StrategyPricer, roles: _Roles) -> list[Edge]:
    """One Edge per (producer group, consumer group, getitem index, input position), summed
    over the copies of repeated layers; a producer tied to its consumer pays on the diagonal."""
    nodes = cands.nodes
    merged: dict[tuple, Edge] = {}
    edge_cache: dict[tuple, tuple] = {}  # holds the specs lists so their ids stay unique
    class_cache: dict[tuple, tuple] = {}  # (id(specs), "out"/"in", index) -> (classes, placements, specs)

    def classes(specs: list, side: str, i: int | None, placements: Any) -> tuple[np.ndarray, list[tuple]]:
        ck = (id(specs), side, i)
        hit = class_cache.get(ck)
        if hit is None:
            hit = class_cache[ck] = (*_classes(placements()), specs)
        return hit[0], hit[1]
    for name, c in nodes.items():
        if c.kind == PLACEHOLDER:
            continue
        dst_g = group_of[name]
        idx = c.getitem_index if c.kind == GETITEM else None
        for k, src_node in enumerate(c.inputs):
            src_c, src_g = nodes[src_node.name], group_of[src_node.name]
            shape, dtype = _edge_tensor(src_node, idx)
            # copies of one op in repeated layers share their specs lists: price the edge once
            role = roles(src_node.name, c)
            ek = (id(src_c.specs), idx, id(c.specs), k, shape, dtype, role)
            hit = edge_cache.get(ek)
            if hit is None:
                src_cls, src_uniq = classes(src_c.specs, "out", idx, lambda: _output_placements(src_c, idx))
                dst_cls, dst_uniq = classes(c.specs, "in", k, lambda: [s.input_specs[k].placements for s in c.specs])
                m = pricer.redistribution(shape, dtype, src_uniq, dst_uniq, role)
                hit = edge_cache[ek] = (src_cls, src_uniq, dst_cls, dst_uniq, m, src_c.specs, c.specs)
            src_cls, src_uniq, dst_cls, dst_uniq, m = hit[:5]
            if src_g == dst_g:  # tied producer/consumer: cost on the diagonal
                unary[dst_g] += m[src_cls, dst_cls]
                continue
            # members of a group share one menu, so copies of this edge share class arrays
            e = merged.get((src_g, dst_g, idx, k))
            if e is None:
                e = merged[(src_g, dst_g, idx, k)] = Edge(src_g, dst_g, src_cls, dst_cls, src_uniq, dst_uniq,
                                                           np.zeros((len(src_uniq), len(dst_uniq))), [], (shape, dtype))
            e.cost = e.cost + m
            e.members.append((src_node.name, name, k))
    return list(merged.values())


def _parameter_bytes(cands: Candidates, group_of: dict[str, int]) -> tuple[list[int], dict[int, np.ndarray], float]:
    """(parameter groups, local parameter bytes per strategy of each, total parameter bytes)."""
    jg = cands.graph
    mesh_shape = tuple(cands.mesh.shape)
    groups: list[int] = []
    per_group: dict[int, np.ndarray] = {}
    total = 0.0
    for fqn, pnode in jg.params.items():
        g = group_of[pnode.name]
        b = float(jg.param_bytes[fqn])
        total += b
        pls = [s.output_specs.placements for s in cands.nodes[pnode.name].specs]
        if g not in per_group:
            groups.append(g)
            per_group[g] = np.zeros(len(pls))
        per_group[g] = per_group[g] + np.array([b / shard_factor(p, mesh_shape) for p in pls])
    return groups, per_group, total


def _price_optimizer(cands: Candidates, group_of: dict[str, int], cost_model: CostModel,
                     compute: dict[str, np.ndarray], unary: list[np.ndarray]) -> None:
    """A parameter node's work is its optimizer update on the local shard (the step runs
    AdamW on every rank's own bytes): a sharded parameter updates faster."""
    if not hasattr(cost_model, "optimizer_cost"):  # a duck-typed model without it
        return
    mesh_shape = tuple(cands.mesh.shape)
    for fqn, pnode in cands.graph.params.items():
        b = float(cands.graph.param_bytes[fqn])
        us = np.array([cost_model.optimizer_cost(b / shard_factor(s.output_specs.placements, mesh_shape))
                       for s in cands.nodes[pnode.name].specs])
        compute[pnode.name] = compute[pnode.name] + us
        unary[group_of[pnode.name]] += us


def _add_recompute_choice(cands: Candidates, groups: list[list[str]], group_of: dict[str, int],
                          compute: dict[str, np.ndarray], mp_dtype: torch.dtype | None, n_strat: list[int],
                          unary: list[np.ndarray], edges: list[Edge]) -> Any:
    """The recomputation choice as the last group, and its edges (recompute.py); None for a
    graph without transformer blocks (nothing to recompute)."""
    made = recompute_edges(cands, group_of, compute, mp_dtype, len(groups))
    if made is None:
        log.info("activation checkpointing: the graph has no transformer blocks; nothing to choose")
        return None
    choice, rc_edges = made
    groups.append([RECOMPUTE_GROUP])
    n_strat.append(len(choice.options))
    unary.append(np.zeros(len(choice.options)))
    edges.extend(rc_edges)
    return choice


def without_recompute(prob: Problem) -> Problem:
    """`prob` without its recomputation choice (the last group and its edges)."""
    g = prob.recompute.group
    return dataclasses.replace(prob, groups=prob.groups[:g], n_strategies=prob.n_strategies[:g],
                               unary=prob.unary[:g], allowed=prob.allowed[:g],
                               edges=[e for e in prob.edges if e.kind != "recompute"], recompute=None)


PRICED_KEPT = 2
"""Priced problems kept per Candidates (formulation of one plan's budget rounds, a sweep's budget points)."""


def priced_problem(cands: Candidates, cost_model: CostModel, *, repeated_blocks: bool = True,
                   mp_dtype: torch.dtype | None = None, recompute: bool = False) -> Problem:
    """Every strategy and edge of `cands` priced and grouped, without constraints or budget.

    Kept on `cands` by the cost model's pricing key: the prices do not depend on the
    parameter budget or the user constraints, so the budget rounds of one plan and the
    budget points of a sweep price once. The result is read-only: `build_problem` copies
    what it changes (`allowed`)."""
    # a duck-typed cost model without a pricing key is priced every time (an id could be reused)
    key = ((cost_model.pricing_key(), repeated_blocks, str(mp_dtype), recompute)
           if hasattr(cost_model, "pricing_key") else None)
    hit = cands.priced.get(key) if key is not None else None
    if hit is not None:
        return dataclasses.replace(hit, candidates=cands)
    t0 = time.perf_counter()
    groups, group_of = decision_groups(cands, repeated_blocks)
    pricer = StrategyPricer(cands, cost_model, mp_dtype)
    n_strat = [len(cands.nodes[g[0]].specs) for g in groups]
    unary = [np.zeros(n) for n in n_strat]
    compute: dict[str, np.ndarray] = {}
    for name, c in cands.nodes.items():
        compute[name] = pricer.compute(c)
        unary[group_of[name]] += compute[name]
    edges = _price_edges(cands, group_of, unary, pricer, edge_roles(cands, cost_model))
    param_groups, param_bytes, total = _parameter_bytes(cands, group_of)
    _price_optimizer(cands, group_of, cost_model, compute, unary)
    choice = _add_recompute_choice(cands, groups, group_of, compute, mp_dtype, n_strat, unary, edges) \
        if recompute else None
    prob = Problem(candidates=cands, cost_model=cost_model, groups=groups, group_of=group_of, n_strategies=n_strat,
                   unary=unary, compute=compute, edges=edges, allowed=[np.isfinite(u) for u in unary],
                   param_groups=param_groups, param_bytes=param_bytes, total_param_bytes=total,
                   memory_low=None, memory_high=None, constraints=[], mp_dtype=mp_dtype,
                   build_seconds=time.perf_counter() - t0, recompute=choice)
    if key is None:
        return prob
    while len(cands.priced) >= PRICED_KEPT:
        cands.priced.pop(next(iter(cands.priced)))
    # kept without its candidates: no reference cycle, so candidates a re-seeding round drops
    # are freed at once (the collector is paused while planning)
    cands.priced[key] = dataclasses.replace(prob, candidates=None)
    return prob


def build_problem(cands: Candidates, cost_model: CostModel, *, constraints: list[Constraint] | None = None,
                  memory_low: float | None = None, memory_high: float | None = None, repeated_blocks: bool = True,
                  mp_dtype: torch.dtype | None = None, recompute: RecomputeRow | None = None) -> Problem:
    """The priced problem (`priced_problem`, kept) with the constraints and budget applied,
    checked for feasibility. `recompute`: the recomputation of each block is chosen in the
    solve, its kept activations and the model states under `recompute.limit` bytes."""
    t0 = time.perf_counter()
    priced = priced_problem(cands, cost_model, repeated_blocks=repeated_blocks, mp_dtype=mp_dtype,
                            recompute=recompute is not None)
    constraints = list(constraints or [])
    choice = priced.recompute
    if choice is not None:  # the kept problem's choice is shared: the row is this build's
        choice = dataclasses.replace(choice, row=recompute)
    prob = dataclasses.replace(priced, cost_model=cost_model, allowed=[a.copy() for a in priced.allowed],
                               memory_low=memory_low, memory_high=memory_high, constraints=constraints,
                               recompute=choice)
    if choice is not None and recompute.full_only:
        only = np.zeros(len(choice.options), dtype=bool)
        only[choice.full_option()] = True
        prob.allowed[choice.group] = only
    elif choice is not None and not recompute.keep_choice and not row_can_bind(prob):
        log.info("activation checkpointing: every plan's activations and model states fit the memory limit; "
                 "nothing is recomputed")
        prob = without_recompute(prob)
    for con in constraints:
        if con.kind != "memory":
            apply_constraint(prob, con)
    check_feasible(prob)
    prob.build_seconds = time.perf_counter() - t0
    log.info("problem: %s", prob.summary())
    return prob
