"""Stage 3: Candidates + cost model + constraints -> Problem (unary + pairwise costs).

A Problem is solver-agnostic: decision *groups* (nodes that must choose the same
strategy index: forward/backward pairs, and the copies of one op in repeated layers)
each pick one strategy; a group pays a unary cost (compute, weighted by its copies) and
every edge pays a redistribution cost that depends only on the producer's output
placement class and the consumer's expected input placement class. Keeping the edge
cost at the placement-class level (not strategy x strategy) is what keeps the exact ILP
small. User constraints restrict `allowed`; the parameter-memory budget is a linear
constraint over parameter groups.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parallel.auto import _torch as T
from parallel.auto.cost.comm import placement_ids
from parallel.auto.cost.model import CostModel
from parallel.auto.strategies import GETITEM, OP, PLACEHOLDER, Candidates, NodeCandidates, placement_str

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"(^|\.)(\d+)(?=\.|$)")


class PlanningError(ValueError):
    """The planning problem cannot be solved; the message names the conflicting user constraints."""


@dataclass
class Constraint:
    """A user constraint, kept with its description for error messages."""

    kind: str  # "input" | "output" | "node" | "memory"
    description: str
    node: str | None = None  # node (candidate) name it restricts
    placements: tuple | None = None  # required output placements (per mesh axis)
    input_placements: tuple | None = None  # optional: required placements of each tensor input


@dataclass
class Edge:
    """Redistribution cost between two groups, at placement-class level.

    full cost matrix = cost[src_cls[:, None], dst_cls[None, :]] (src strategy x dst strategy).
    """

    src: int
    dst: int
    src_cls: np.ndarray  # src strategy -> output placement class
    dst_cls: np.ndarray  # dst strategy -> input placement class
    src_placements: list[tuple]
    dst_placements: list[tuple]
    cost: np.ndarray  # [n_src_classes, n_dst_classes], weighted, inf = not allowed
    members: list[tuple[str, str, int]] = field(default_factory=list)  # (producer, consumer, input pos)
    tensor: tuple = ()  # (global shape, dtype) of the tensor crossing the edge

    def full(self) -> np.ndarray:
        return self.cost[np.ix_(self.src_cls, self.dst_cls)]


@dataclass
class Problem:
    """Everything a solver needs; indices are group indices in topological order."""

    candidates: Candidates
    cost_model: Any
    groups: list[list[str]]  # group -> member node names (first is the representative)
    group_of: dict[str, int]
    n_strategies: list[int]
    unary: list[np.ndarray]  # weighted compute (+ intra-group redistribution) per strategy
    compute: dict[str, np.ndarray]  # per node, unweighted compute µs per strategy
    edges: list[Edge]
    allowed: list[np.ndarray]  # bool per strategy, after constraints and pruning
    param_groups: list[int]  # groups holding parameters
    param_bytes: dict[int, np.ndarray]  # group -> local parameter bytes per strategy (all copies)
    total_param_bytes: float
    memory_low: float | None
    memory_high: float | None
    constraints: list[Constraint]
    build_seconds: float = 0.0
    mp_dtype: torch.dtype | None = None

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def num_edge_vars(self) -> int:
        return int(sum(np.isfinite(e.cost).sum() for e in self.edges))

    def num_node_vars(self) -> int:
        return int(sum(a.sum() for a in self.allowed))

    def summary(self) -> str:
        n_nodes = sum(len(g) for g in self.groups)
        return (
            f"Problem: {n_nodes} nodes in {self.num_groups} groups, {len(self.edges)} edges, "
            f"{self.num_node_vars()} strategy vars, {self.num_edge_vars()} edge vars, "
            f"built in {self.build_seconds:.2f}s"
        )

    def energy(self, labels: list[int] | np.ndarray) -> float:
        """Objective of an assignment (one strategy index per group)."""
        total = sum(float(self.unary[g][labels[g]]) for g in range(self.num_groups))
        for e in self.edges:
            total += float(e.cost[e.src_cls[labels[e.src]], e.dst_cls[labels[e.dst]]])
        return total

    def to_mrf(self) -> Any:
        """The same problem as a pairwise MRF (disallowed strategies cost +inf)."""
        from parallel.auto.solve.mrf import PairwiseMRF

        unary = [np.where(a, u, np.inf) for u, a in zip(self.unary, self.allowed)]
        mrf = PairwiseMRF.from_unary(unary)
        for e in self.edges:
            mrf.add_pairwise(e.src, e.dst, e.full())
        return mrf


# ---------------------------------------------------------------------------
# Grouping
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


def _menu(c: NodeCandidates, cache: dict[int, tuple[list, tuple]] | None = None) -> tuple:
    """(output placements, input placements) per strategy; cached per shared specs list."""
    from parallel.auto.solve.cluster import menu_of  # solve/ imports this module

    if cache is None:
        return menu_of(c)
    hit = cache.get(id(c.specs))
    if hit is not None and hit[0] is c.specs:
        return hit[1]
    menu = menu_of(c)
    cache[id(c.specs)] = (c.specs, menu)
    return menu


def _tie_groups(cands: Candidates, cluster_layers: bool) -> tuple[list[list[str]], dict[str, int]]:
    """Union-find groups: fwd/bwd pairs always; copies of repeated layers if asked."""
    jg = cands.graph
    uf = _UnionFind()
    names = list(cands.nodes)
    for n in names:
        uf.find(n)
    menus: dict[str, tuple] = {}

    by_specs: dict[int, tuple[list, tuple]] = {}

    def menu(n: str) -> tuple:
        if n not in menus:
            menus[n] = _menu(cands.nodes[n], by_specs)
        return menus[n]

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

    clustering = None
    if cluster_layers:  # content-hash clustering of repeated layers (solve/cluster.py)
        from parallel.auto.solve.cluster import find_clusters

        clustering = find_clusters(cands)
        for members in clustering.clusters + clustering.flow_coupled:
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
    if clustering is not None:
        log.info("%s", clustering.summary(len(groups)))
    return groups, group_of


# ---------------------------------------------------------------------------
# Costs
# ---------------------------------------------------------------------------


def _local_shape(shape: tuple[int, ...], placements: tuple, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    local = list(shape)
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, T.Shard):
            local[p.dim] //= size
    return tuple(local)


def _comm_dtype(dtype: torch.dtype, mp_dtype: torch.dtype | None) -> torch.dtype:
    if mp_dtype is not None and dtype.is_floating_point and dtype.itemsize > mp_dtype.itemsize:
        return mp_dtype
    return dtype


class _Costs:
    def __init__(self, cands: Candidates, cm: Any, mp_dtype: torch.dtype | None):
        self.cands = cands
        self.cm = cm
        self.mp_dtype = mp_dtype
        self.mesh_shape = tuple(cands.mesh.shape)
        self.compute_cache: dict[Any, np.ndarray] = {}
        self.redist_cache: dict[Any, np.ndarray] = {}
        self.pair_cache: dict[tuple, float] = {}  # (shape, dtype, src id, dst id) -> µs
        self.placement_ids: dict[tuple, int] = {}
        self.id_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        # the id-based fast path prices exactly like redistribute_cost; a cost model that
        # overrides redistribute_cost is asked through it
        self.fast_pricing = (hasattr(cm, "redistribute_cost_ids") and
                             getattr(type(cm), "redistribute_cost", None) is CostModel.redistribute_cost)

    def compute(self, c: NodeCandidates) -> np.ndarray:
        if c.kind != OP:
            return np.zeros(len(c.specs))
        key = (c.key, id(c.specs))
        hit = self.compute_cache.get(key)
        if hit is not None:
            return hit
        node = c.node
        arr = np.zeros(len(c.specs))
        for j, s in enumerate(c.specs):
            local = {a.name: (_local_shape(tuple(a.meta["val"].shape), spec.placements, self.mesh_shape), a.meta["val"].dtype)
                     for a, spec in zip(c.inputs, s.input_specs)}

            def conv(a: Any) -> Any:
                if isinstance(a, torch.fx.Node):
                    if a.name in local:
                        return local[a.name]
                    return a.meta.get("val")
                return a

            args = T.tree_map(conv, node.args)
            kwargs = T.tree_map(conv, dict(node.kwargs))
            outs = s.output_specs
            if isinstance(outs, tuple):
                out_meta = [(_local_shape(tuple(o.tensor_meta.shape), o.placements, self.mesh_shape), o.tensor_meta.dtype)
                            for o in outs if o is not None]
            else:
                out_meta = [(_local_shape(tuple(outs.tensor_meta.shape), outs.placements, self.mesh_shape), outs.tensor_meta.dtype)]
            try:
                arr[j] = self.cm.compute_cost(node.target, args, local_kwargs_meta=kwargs, out_meta=out_meta)
            except Exception:  # noqa: BLE001 - cost model could not run the op: charge bytes only
                arr[j] = self.cm.compute_cost(node.target, args, flops=0.0, local_kwargs_meta=kwargs, out_meta=out_meta)
        self.compute_cache[key] = arr
        return arr

    def redistribution(self, shape: tuple, dtype: torch.dtype, src: list[tuple], dst: list[tuple]) -> np.ndarray:
        key = (shape, dtype, tuple(src), tuple(dst))
        hit = self.redist_cache.get(key)
        if hit is not None:
            return hit
        cdt = _comm_dtype(dtype, self.mp_dtype)
        meta = (shape, cdt)
        m = np.empty((len(src), len(dst)))
        sid = [self._intern(p) for p in src]
        did = [self._intern(p) for p in dst]
        pairs = self.pair_cache
        by_ids = self.fast_pricing  # interned placement ids: no placement hashing in the hot loop
        if by_ids:
            ndim = len(shape)
            s_ids = [self._ids(i, p, ndim) for i, p in zip(sid, src)]
            d_ids = [self._ids(i, p, ndim) for i, p in zip(did, dst)]
        for a, sp in enumerate(src):
            for b, dp in enumerate(dst):
                if sid[a] == did[b]:
                    m[a, b] = 0.0
                    continue
                k = (shape, dtype, sid[a], did[b])
                c = pairs.get(k)
                if c is None:
                    if by_ids:
                        c = self.cm.redistribute_cost_ids(s_ids[a], d_ids[b], shape, cdt.itemsize)
                    else:
                        c = self.cm.redistribute_cost(sp, dp, meta)
                    pairs[k] = c
                m[a, b] = c
        self.redist_cache[key] = m
        return m

    def _ids(self, sid: int, placements: tuple, ndim: int) -> tuple[int, ...]:
        k = (sid, ndim)
        hit = self.id_cache.get(k)
        if hit is None:
            hit = self.id_cache[k] = placement_ids(placements, ndim)
        return hit

    def _intern(self, placements: tuple) -> int:
        i = self.placement_ids.get(placements)
        if i is None:
            i = self.placement_ids[placements] = len(self.placement_ids)
        return i


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


def shard_factor(placements: tuple, mesh_shape: tuple[int, ...]) -> int:
    f = 1
    for size, p in zip(mesh_shape, placements):
        if isinstance(p, T.Shard):
            f *= size
    return f


# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------


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
    groups, group_of = _tie_groups(cands, cluster_layers)
    costs = _Costs(cands, cost_model, mp_dtype)
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
            _apply(prob, con)
    check_feasible(prob)
    prob.build_seconds = time.perf_counter() - t0
    log.info("problem: %s", prob.summary())
    return prob


def constraint_mask(prob: Problem, con: Constraint) -> np.ndarray:
    """Strategies of the constrained node's group that satisfy `con`."""
    c = prob.candidates.nodes[con.node]
    mask = np.ones(len(c.specs), dtype=bool)
    for j, s in enumerate(c.specs):
        o = s.output_specs
        if con.placements is not None:
            op = tuple(x.placements if x is not None else None for x in o) if isinstance(o, tuple) else o.placements
            want = tuple(con.placements)
            if isinstance(o, tuple) and want and not isinstance(want[0], tuple):
                op = op[0]
            if op != want:
                mask[j] = False
        if con.input_placements is not None:
            got = tuple(i.placements for i in s.input_specs)
            for k, want_k in enumerate(con.input_placements):
                if want_k is not None and (k >= len(got) or got[k] != tuple(want_k)):
                    mask[j] = False
    return mask


def _apply(prob: Problem, con: Constraint) -> None:
    if con.node not in prob.candidates.nodes:
        raise PlanningError(f"{con.description}: no node named {con.node!r}")
    g = prob.group_of[con.node]
    mask = constraint_mask(prob, con)
    if not mask.any():
        c = prob.candidates.nodes[con.node]
        menu = sorted({placement_str(_first_out(s)) for s in c.specs})
        raise PlanningError(f"{con.description}: no candidate strategy has this placement; valid placements: {', '.join(menu)}")
    prob.allowed[g] = prob.allowed[g] & mask


def _first_out(s: Any) -> tuple:
    o = s.output_specs
    if isinstance(o, tuple):
        o = next(x for x in o if x is not None)
    return o.placements


# ---------------------------------------------------------------------------
# Feasibility (before solving), with errors in user terms
# ---------------------------------------------------------------------------


def _propagate(prob: Problem, allowed: list[np.ndarray]) -> int | None:
    """Arc consistency over finite edge costs; returns a group left with no strategy, or None."""
    changed = True
    rounds = 0
    while changed and rounds < 20:
        changed = False
        rounds += 1
        for e in prob.edges:
            fin = np.isfinite(e.cost)
            a_src, a_dst = allowed[e.src], allowed[e.dst]
            src_cls_ok = np.zeros(e.cost.shape[0], dtype=bool)
            src_cls_ok[e.src_cls[a_src]] = True
            dst_cls_ok = np.zeros(e.cost.shape[1], dtype=bool)
            dst_cls_ok[e.dst_cls[a_dst]] = True
            # a dst class is supported if some allowed src class reaches it with finite cost
            dst_sup = (fin & src_cls_ok[:, None]).any(axis=0)
            src_sup = (fin & dst_cls_ok[None, :]).any(axis=1)
            new_dst = a_dst & dst_sup[e.dst_cls]
            new_src = a_src & src_sup[e.src_cls]
            if not new_dst.all() or not new_src.all():
                if (new_dst != a_dst).any():
                    allowed[e.dst] = new_dst
                    changed = True
                if (new_src != a_src).any():
                    allowed[e.src] = new_src
                    changed = True
                if not new_dst.any():
                    return e.dst
                if not new_src.any():
                    return e.src
    return None


def _memory_range(prob: Problem, allowed: list[np.ndarray]) -> tuple[float, float]:
    lo = hi = 0.0
    for g in prob.param_groups:
        b = prob.param_bytes[g][allowed[g]]
        if b.size == 0:
            return math.inf, -math.inf
        lo += float(b.min())
        hi += float(b.max())
    return lo, hi


def _feasible_with(prob: Problem, base: list[np.ndarray], cons: list[Constraint], memory: bool) -> str | None:
    allowed = [a.copy() for a in base]
    for con in cons:
        if con.kind == "memory":
            continue
        g = prob.group_of[con.node]
        allowed[g] = allowed[g] & constraint_mask(prob, con)
        if not allowed[g].any():
            return f"no strategy of {prob.groups[g][0]} satisfies them"
    bad = _propagate(prob, allowed)
    if bad is not None:
        return f"node {prob.groups[bad][0]} is left without a valid strategy"
    if memory:
        lo, hi = _memory_range(prob, allowed)
        total = prob.total_param_bytes
        if prob.memory_high is not None and lo > prob.memory_high * total * (1 + 1e-9):
            return f"parameters need at least {lo / total:.4g} of their bytes per device, above high={prob.memory_high:.4g}"
        if prob.memory_low is not None and hi < prob.memory_low * total * (1 - 1e-9):
            return f"parameters take at most {hi / total:.4g} of their bytes per device, below low={prob.memory_low:.4g}"
    return None


def check_feasible(prob: Problem) -> None:
    """Raise PlanningError naming the smallest conflicting set of user constraints."""
    base = [np.isfinite(u) for u in prob.unary]
    user = [c for c in prob.constraints if c.kind != "memory"]
    has_memory = prob.memory_high is not None or prob.memory_low is not None
    why = _feasible_with(prob, base, user, has_memory)
    if why is None:
        prob.allowed = _propagated(prob)
        return
    # deletion filter: drop constraints that are not needed for the conflict
    needed = list(user)
    memory_needed = has_memory
    for con in list(user):
        trial = [c for c in needed if c is not con]
        if _feasible_with(prob, base, trial, memory_needed) is not None:
            needed = trial
    if memory_needed and _feasible_with(prob, base, needed, False) is not None:
        memory_needed = False
    parts = [c.description for c in needed]
    if memory_needed:
        parts.append(_memory_description(prob))
    if not parts:
        raise PlanningError(f"the planning problem is infeasible without any user constraint: {why}")
    joined = " and ".join(parts)
    raise PlanningError(f"{joined} cannot all hold: {_feasible_with(prob, base, needed, memory_needed) or why}")


def _memory_description(prob: Problem) -> str:
    return f"parameter memory constraint (low={prob.memory_low}, high={prob.memory_high:.4g})" if prob.memory_high is not None else f"parameter memory constraint (low={prob.memory_low})"


def _propagated(prob: Problem) -> list[np.ndarray]:
    allowed = [a.copy() for a in prob.allowed]
    _propagate(prob, allowed)
    return allowed
