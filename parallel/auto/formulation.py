"""Stage 3: Candidates + cost model + constraints -> Problem.

Groups tied nodes (`cluster.decision_groups`), prices every strategy and edge
(`pricing.StrategyPricer`), merges the edges of repeated-layer copies, applies the user
constraints and checks feasibility before any solver runs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from parallel.auto.cluster import decision_groups
from parallel.auto.feasibility import apply_constraint, check_feasible
from parallel.auto.placements import shard_factor
from parallel.auto.pricing import StrategyPricer
from parallel.auto.problem import Constraint, Edge, Problem
from parallel.auto.strategies import GETITEM, PLACEHOLDER, Candidates, NodeCandidates

log = logging.getLogger("parallel.auto.problem")


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


def build_problem(
    cands: Candidates,
    cost_model: Any,
    *,
    constraints: list[Constraint] | None = None,
    memory_low: float | None = None,
    memory_high: float | None = None,
    cluster_layers: bool = True,
    mp_dtype: torch.dtype | None = None,
) -> Problem:
    """Cost every strategy and edge, group tied nodes, apply constraints, prune."""
    t0 = time.perf_counter()
    constraints = list(constraints or [])
    groups, group_of = decision_groups(cands, cluster_layers)
    costs = StrategyPricer(cands, cost_model, mp_dtype)
    nodes = cands.nodes
    n_strat = [len(nodes[g[0]].specs) for g in groups]
    unary = [np.zeros(n) for n in n_strat]
    compute: dict[str, np.ndarray] = {}
    for name, c in nodes.items():
        arr = costs.compute(c)
        compute[name] = arr
        unary[group_of[name]] += arr

    # edges, merged across copies of repeated layers
    merged: dict[tuple, Edge] = {}
    edge_cache: dict[tuple, tuple] = {}  # holds the specs lists so their ids stay unique
    for name, c in nodes.items():
        if c.kind == PLACEHOLDER:
            continue
        dst_g = group_of[name]
        for k, src_node in enumerate(c.inputs):
            src_name = src_node.name
            src_c = nodes[src_name]
            idx = c.getitem_index if c.kind == GETITEM else None
            val = src_node.meta["val"]
            if isinstance(val, (tuple, list)):
                val = val[idx or 0]
            shape, dtype = tuple(val.shape), val.dtype
            src_g = group_of[src_name]
            # copies of one op in repeated layers share their specs lists: cost the edge once
            ek = (id(src_c.specs), idx, id(c.specs), k, shape, dtype)
            hit = edge_cache.get(ek)
            if hit is None:
                src_pl = _output_placements(src_c, idx)
                dst_pl = [s.input_specs[k].placements for s in c.specs]
                src_cls, src_uniq = _classes(src_pl)
                dst_cls, dst_uniq = _classes(dst_pl)
                m = costs.redistribution(shape, dtype, src_uniq, dst_uniq)
                hit = edge_cache[ek] = (src_cls, src_uniq, dst_cls, dst_uniq, m, src_c.specs, c.specs)
            src_cls, src_uniq, dst_cls, dst_uniq, m = hit[:5]
            if src_g == dst_g:  # tied producer/consumer: cost on the diagonal
                unary[dst_g] += m[src_cls, dst_cls]
                continue
            # members of a group share one menu, so copies of this edge share class arrays
            key = (src_g, dst_g, idx, k)
            e = merged.get(key)
            if e is None:
                e = Edge(src_g, dst_g, src_cls, dst_cls, src_uniq, dst_uniq,
                         np.zeros((len(src_uniq), len(dst_uniq))), [], (shape, dtype))
                merged[key] = e
            e.cost = e.cost + m
            e.members.append((src_name, name, k))
    # merge edges between the same pair of groups with identical class structure
    edges = list(merged.values())

    allowed = [np.isfinite(u) for u in unary]
    jg = cands.graph
    mesh_shape = tuple(cands.mesh.shape)
    param_groups: list[int] = []
    param_bytes: dict[int, np.ndarray] = {}
    total = 0.0
    for fqn, pnode in jg.params.items():
        g = group_of[pnode.name]
        b = float(jg.param_bytes[fqn])
        total += b
        pls = [s.output_specs.placements for s in nodes[pnode.name].specs]
        arr = np.array([b / shard_factor(p, mesh_shape) for p in pls])
        if g not in param_bytes:
            param_groups.append(g)
            param_bytes[g] = np.zeros(len(pls))
        param_bytes[g] = param_bytes[g] + arr

    prob = Problem(
        candidates=cands,
        cost_model=cost_model,
        groups=groups,
        group_of=group_of,
        n_strategies=n_strat,
        unary=unary,
        compute=compute,
        edges=edges,
        allowed=allowed,
        param_groups=param_groups,
        param_bytes=param_bytes,
        total_param_bytes=total,
        memory_low=memory_low,
        memory_high=memory_high,
        constraints=constraints,
        mp_dtype=mp_dtype,
    )
    for con in constraints:
        if con.kind != "memory":
            apply_constraint(prob, con)
    check_feasible(prob)
    prob.build_seconds = time.perf_counter() - t0
    log.info("problem: %s", prob.summary())
    return prob
