"""Approximate solver for pairwise Markov random fields (paper §4.3).

Once parameters are fully sharded on the non-DDP mesh axes, the placement problem has no
global constraint left and becomes a pairwise MRF: every decision group picks one label
(a strategy), paying a unary cost (compute + redistribution inside the group) and a
pairwise cost per neighbouring group (redistribution between them). This module solves
such an MRF without knowing anything about graphs or placements:

* sequential tree-reweighted message passing (TRW-S, Kolmogorov 2006) over the monotonic
  chains of a fixed node order, keeping the best assignment decoded over the sweeps;
* then local search: coordinate descent over single nodes, a "star" search that
  re-decides a high-degree node together with its neighbours, joint moves of the two
  ends of an edge, and exact re-decisions of whole induced forests (chains of layers).

Costs are plain numpy arrays.  Forbidden combinations are +inf in the input; internally
they are clamped to ``FORBIDDEN`` so that message arithmetic stays finite.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

FORBIDDEN = 1e15
"""Finite stand-in for an infinite cost (a forbidden label or label pair)."""


@dataclass
class PairwiseMRF:
    """A pairwise MRF: ``unary[i][a]`` and ``pairwise[(i, j)][a, b]`` with ``i < j``.

    Node indices are positions in the order used by the solver (a topological order of the
    graph gives the monotonic chains TRW-S wants).  Adding a pairwise term for a pair that
    already has one sums the two.
    """

    unary: list[np.ndarray]
    pairwise: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    factors: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Optional class structure of a pairwise term: ``pairwise[(i, j)] == C[ci][:, cj]``
    with small ``C``; message passing then works on classes (much faster for big menus)."""

    @classmethod
    def from_unary(cls, unary: list[np.ndarray]) -> PairwiseMRF:
        return cls([_clamp(np.asarray(u, dtype=np.float64)) for u in unary], {})

    @property
    def num_nodes(self) -> int:
        return len(self.unary)

    def num_labels(self, i: int) -> int:
        return int(self.unary[i].shape[0])

    def add_pairwise(self, i: int, j: int, cost: np.ndarray) -> None:
        """Add ``cost[a, b]`` for (label a of node i, label b of node j)."""
        cost = _clamp(np.asarray(cost, dtype=np.float64))
        if i == j:
            raise ValueError(f"pairwise term on a single node {i}: fold it into the unary")
        if i > j:
            i, j, cost = j, i, cost.T
        expected = (self.num_labels(i), self.num_labels(j))
        if cost.shape != expected:
            raise ValueError(f"pairwise ({i}, {j}) has shape {cost.shape}, expected {expected}")
        key = (i, j)
        if key in self.pairwise:
            self.pairwise[key] = _clamp(self.pairwise[key] + cost)
        else:
            self.pairwise[key] = cost

    def set_factor(self, i: int, j: int, cls_cost: np.ndarray, ci: np.ndarray, cj: np.ndarray) -> None:
        """Declare ``pairwise[(i, j)] == cls_cost[ci][:, cj]`` (i < j; only for a single term)."""
        if i > j:
            i, j, cls_cost, ci, cj = j, i, cls_cost.T, cj, ci
        self.factors[(i, j)] = (_clamp(np.asarray(cls_cost, dtype=np.float64)), np.asarray(ci), np.asarray(cj))

    def energy(self, labels: np.ndarray | list[int]) -> float:
        """Total cost of an assignment (``>= FORBIDDEN`` means it is infeasible)."""
        total = sum(float(self.unary[i][labels[i]]) for i in range(self.num_nodes))
        for (i, j), cost in self.pairwise.items():
            total += float(cost[labels[i], labels[j]])
        return total

    def neighbours(self) -> list[list[tuple[int, np.ndarray]]]:
        """For every node: ``(other, cost oriented [mine, other's])`` for each incident edge."""
        adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(self.num_nodes)]
        for (i, j), cost in self.pairwise.items():
            adj[i].append((j, cost))
            adj[j].append((i, cost.T))
        return adj


@dataclass
class MRFSolution:
    """The best assignment found, its energy, and how long TRW-S ran."""

    labels: np.ndarray
    energy: float
    sweeps: int
    seconds: float
    starts: list[np.ndarray] = field(default_factory=list)
    """Distinct good assignments decoded along the way (local-search starting points)."""

    @property
    def feasible(self) -> bool:
        return self.energy < FORBIDDEN


def _clamp(a: np.ndarray) -> np.ndarray:
    return np.minimum(np.nan_to_num(a, nan=FORBIDDEN, posinf=FORBIDDEN), FORBIDDEN)


def _local_costs(mrf_adj, unary, labels, i: int) -> np.ndarray:
    """Cost of every label of node i given its neighbours' current labels."""
    costs = unary[i].copy()
    for j, cost in mrf_adj[i]:
        costs += cost[:, labels[j]]
    return np.minimum(costs, FORBIDDEN)


def greedy(mrf: PairwiseMRF) -> np.ndarray:
    """Decide nodes in order, each taking its best label given the earlier ones."""
    adj = mrf.neighbours()
    labels = np.full(mrf.num_nodes, -1, dtype=np.int64)
    for i in range(mrf.num_nodes):
        costs = mrf.unary[i].copy()
        for j, cost in adj[i]:
            if labels[j] >= 0:
                costs += cost[:, labels[j]]
        labels[i] = int(np.argmin(costs))
    return labels


@dataclass
class _Chains:
    """TRW-S state. Pair k = (i, j), i < j, owns message slots 2k (i -> j) and 2k + 1 (j -> i)."""

    flat: np.ndarray  # every message, one after the other (a sweep's change is read off it at once)
    msgs: list[np.ndarray]  # per slot: its view of `flat`
    nbrs: list[list[tuple[int, np.ndarray, int, int]]]  # (other, cost [mine, other's], slot in, slot out)
    fac: list  # per slot: class reduction (`_factor`), or None for a dense message
    low: list  # per slot: the cost matrix a dense message reads, in float32 (None: factored)
    gamma: list[float]  # per node: the share of its unary on each monotonic chain through it


def _build_chains(mrf: PairwiseMRF) -> _Chains:
    """Zero messages, incident edges and chain weights ``1 / max(#earlier, #later edges)``."""
    n = mrf.num_nodes
    sizes: list[int] = []
    nbrs: list[list[tuple[int, np.ndarray, int, int]]] = [[] for _ in range(n)]
    fac: list = []  # per slot, as `_Chains.fac` and `_Chains.low`
    low: list = []
    for k, ((i, j), cost) in enumerate(mrf.pairwise.items()):
        sizes.extend((mrf.num_labels(j), mrf.num_labels(i)))
        nbrs[i].append((j, cost, 2 * k + 1, 2 * k))
        nbrs[j].append((i, cost.T, 2 * k, 2 * k + 1))
        f = mrf.factors.get((i, j))
        if f is not None and f[0].size * 4 < cost.size:
            C, ci, cj = f
            fac.extend((_factor(C, ci, cj), _factor(C.T, cj, ci)))
            low.extend((None, None))
        else:
            fac.extend((None, None))
            low.extend(((c32 := cost.astype(np.float32)), c32.T))
    earlier = [sum(1 for j, *_ in nbrs[i] if j < i) for i in range(n)]
    later = [sum(1 for j, *_ in nbrs[i] if j > i) for i in range(n)]
    gamma = [1.0 / max(earlier[i], later[i], 1) for i in range(n)]
    flat = np.zeros(sum(sizes))
    ends = np.cumsum(sizes)
    return _Chains(flat, [flat[e - m:e] for e, m in zip(ends, sizes)], nbrs, fac, low, gamma)


def _message(outgoing: np.ndarray, cost: np.ndarray | None, f: tuple | None) -> np.ndarray:
    """m(b) = min_a outgoing(a) + cost[a, b], normalised to min 0 (on classes when factored);
    dense: summed in float32 (57 vs 97 µs on 387 x 387; decoding reads the float64 costs)."""
    if f is None:
        msg = np.minimum((outgoing.astype(np.float32)[:, None] + cost).min(axis=0), FORBIDDEN).astype(np.float64)
    else:  # min over source classes first, then the small class matrix
        C, order, starts, dst_cls = f
        per_cls = np.minimum.reduceat(outgoing[order], starts)
        msg = np.minimum((per_cls[:, None] + C).min(axis=0)[dst_cls], FORBIDDEN)
    msg -= msg.min()
    return msg


def _visit(mrf: PairwiseMRF, ch: _Chains, i: int, forward: bool, labels: np.ndarray) -> None:
    """Decode node i (forward pass only) and send its messages along the pass."""
    nb = ch.nbrs[i]
    belief = mrf.unary[i].copy()
    for _, _, s_in, _ in nb:
        belief += ch.msgs[s_in]
    if forward:  # decode: earlier nodes are fixed, later ones speak through messages
        decode = mrf.unary[i].copy()
        for j, cost, s_in, _ in nb:
            decode += cost[:, labels[j]] if j < i else ch.msgs[s_in]
        labels[i] = int(np.argmin(decode))
    belief *= ch.gamma[i]
    for j, _, s_in, s_out in nb:
        if (j > i) == forward:
            ch.msgs[s_out][:] = _message(belief - ch.msgs[s_in], ch.low[s_out], ch.fac[s_out])


def _sweep(mrf: PairwiseMRF, ch: _Chains) -> tuple[np.ndarray, float]:
    """One forward and one backward pass: (labels decoded on the forward pass, max message change)."""
    n = mrf.num_nodes
    old = ch.flat.copy()
    labels = np.zeros(n, dtype=np.int64)
    for forward in (True, False):
        order = range(n) if forward else range(n - 1, -1, -1)
        for i in order:
            _visit(mrf, ch, i, forward, labels)  # each message is sent once a sweep
    cut = FORBIDDEN / 16
    fin = (ch.flat < cut) & (old < cut)  # forbidden entries carry no signal
    return labels, float(np.abs(ch.flat[fin] - old[fin]).max()) if fin.any() else 0.0


def trws(
    mrf: PairwiseMRF,
    max_sweeps: int = 1000,
    tol: float = 1e-6,
    patience: int = 60,
    num_starts: int = 4,
    time_budget: float | None = None,
) -> MRFSolution:
    """Sequential tree-reweighted message passing with decoding after every forward pass.

    Nodes are visited in index order (forward) then reverse order (backward); every edge
    (i, j), i < j, lies on the monotonic chain through it, and the node weight
    ``1 / max(#edges to earlier nodes, #edges to later nodes)`` splits each unary among
    its chains.  Stops when messages no longer change (relative ``tol``), when the best
    decoded energy has not improved for ``patience`` sweeps, or after ``time_budget``
    seconds. Patience 60: on the seeded 3-D and 4-D LLaMA 3 8B and 70B jobs of
    scripts/bench_planner.py the last improvement came by sweep 27 (of 150-280 run with
    patience 250), and the 34 meshes of the 32-GPU 8B mesh search plan identically with 60.
    """
    start = time.perf_counter()
    ch = _build_chains(mrf)
    best_labels = greedy(mrf)
    best_energy = mrf.energy(best_labels)
    decoded: dict[bytes, tuple[float, np.ndarray]] = {best_labels.tobytes(): (best_energy, best_labels)}
    stale, sweeps = 0, 0
    for sweeps in range(1, max_sweeps + 1):
        labels, change = _sweep(mrf, ch)
        energy = mrf.energy(labels)
        decoded.setdefault(labels.tobytes(), (energy, labels))
        if energy < best_energy - 1e-12 * max(1.0, abs(best_energy)):
            best_labels, best_energy, stale = labels, energy, 0
        else:
            stale += 1
        scale = max(1.0, abs(best_energy) if best_energy < FORBIDDEN else 1.0)
        if change <= tol * scale or stale >= patience:
            break
        if time_budget is not None and time.perf_counter() - start > time_budget:
            break
    starts = [lab for _, lab in sorted(decoded.values(), key=lambda t: t[0])[:num_starts]]
    return MRFSolution(best_labels, best_energy, sweeps, time.perf_counter() - start, starts)


def _factor(C: np.ndarray, src_cls: np.ndarray, dst_cls: np.ndarray) -> tuple:
    """Precomputed class reduction for messages src -> dst (classes absent from the labels dropped)."""
    present = np.unique(src_cls)
    remap = np.full(C.shape[0], -1, dtype=np.int64)
    remap[present] = np.arange(present.size)
    order = np.argsort(remap[src_cls], kind="stable")
    sorted_cls = remap[src_cls][order]
    starts = np.flatnonzero(np.r_[True, sorted_cls[1:] != sorted_cls[:-1]])
    return C[present], order, starts, np.asarray(dst_cls)


def coordinate_descent(mrf: PairwiseMRF, labels: np.ndarray, max_rounds: int = 100) -> np.ndarray:
    """Move single nodes to their best label until no move lowers the energy."""
    adj = mrf.neighbours()
    labels = labels.copy()
    for _ in range(max_rounds):
        improved = False
        for i in range(mrf.num_nodes):
            costs = _local_costs(adj, mrf.unary, labels, i)
            best = int(np.argmin(costs))
            if costs[best] < costs[labels[i]] - 1e-12:
                labels[i] = best
                improved = True
        if not improved:
            break
    return labels


def edge_search(mrf: PairwiseMRF, labels: np.ndarray, max_rounds: int = 10) -> np.ndarray:
    """Re-decide both ends of every edge jointly, the rest fixed, until nothing improves.

    Catches pairs that must switch together (a producer and its one consumer), which
    single-node moves cannot reach when the half-way state is forbidden.
    """
    adj = mrf.neighbours()
    labels = labels.copy()
    for _ in range(max_rounds):
        improved = False
        for i, j in mrf.pairwise:
            total = _pair_costs(mrf, adj, labels, i, j)
            a, b = np.unravel_index(int(np.argmin(total)), total.shape)
            if total[a, b] < total[labels[i], labels[j]] - 1e-9:
                labels[i], labels[j] = int(a), int(b)
                improved = True
        if not improved:
            break
    return labels


def _pair_costs(mrf: PairwiseMRF, adj, labels: np.ndarray, i: int, j: int) -> np.ndarray:
    """The energy terms touching i or j for every (label of i, label of j), the rest fixed (i < j)."""

    def without(node: int, other: int) -> np.ndarray:  # unary + edges to fixed neighbours, not to `other`
        costs = mrf.unary[node].copy()
        for k, cost in adj[node]:
            if k != other:
                costs += cost[:, labels[k]]
        return costs

    total = without(i, j)[:, None] + without(j, i)[None, :]
    pair = mrf.pairwise.get((i, j))
    return np.minimum(total if pair is None else total + pair, FORBIDDEN)


def _best_star(mrf: PairwiseMRF, adj, labels: np.ndarray, centre: int, nbrs: list[int],
               centre_labels: Iterable[int]) -> tuple[np.ndarray | None, float]:
    """Best move of `centre` to one of `centre_labels`, each neighbour then taking its best
    label given the rest: (new labels, energy change), or (None, 0.0) when none improves."""
    best_move, best_delta = None, 0.0
    for a in centre_labels:
        trial = labels.copy()
        trial[centre] = a
        for j in nbrs:
            trial[j] = int(np.argmin(_local_costs(adj, mrf.unary, trial, j)))
        d = _energy_delta(mrf, adj, labels, trial, [centre] + nbrs)
        if d < best_delta - 1e-9:
            best_move, best_delta = trial, d
    return best_move, best_delta


def _energy_delta(mrf: PairwiseMRF, adj, old: np.ndarray, new: np.ndarray, changed: list[int]) -> float:
    """energy(new) - energy(old) when only the nodes in `changed` differ (local terms only)."""
    inside = set(changed)
    d = 0.0
    for i in inside:
        d += float(mrf.unary[i][new[i]]) - float(mrf.unary[i][old[i]])
        for j, cost in adj[i]:
            if j in inside and j < i:
                continue  # counted from j's side
            d += float(cost[new[i], new[j]]) - float(cost[old[i], old[j]])
    return d


def star_search(mrf: PairwiseMRF, labels: np.ndarray, top: int = 32, max_neighbours: int = 64) -> np.ndarray:
    """Re-decide each high-degree node jointly with its neighbours.

    For every label of the centre, each neighbour takes its best label given the centre and
    its own other neighbours (exact when the neighbours are not linked to each other); the
    best joint move is taken when it lowers the energy.  This escapes the local minima of
    coordinate descent where a producer and all its consumers must switch together.
    """
    adj = mrf.neighbours()
    labels = labels.copy()
    degree_order = sorted(range(mrf.num_nodes), key=lambda i: (-len(adj[i]), i))
    for centre in degree_order[:top]:
        nbrs = [j for j, _ in adj[centre]][:max_neighbours]
        if not nbrs:
            continue
        best_move, _ = _best_star(mrf, adj, labels, centre, nbrs, range(mrf.num_labels(centre)))
        if best_move is not None:
            labels = best_move
    return labels


def _find(parent_of: list[int], x: int) -> int:
    """Union-find root of x, halving the path on the way."""
    while parent_of[x] != x:
        parent_of[x] = parent_of[parent_of[x]]
        x = parent_of[x]
    return x


def _grow_forest(adj, num_nodes: int, order: list[int]) -> tuple[np.ndarray, dict[int, list[tuple[int, np.ndarray]]]]:
    """Take nodes in `order` while the block stays a forest: (in-block mask, tree adjacency)."""
    parent_of = list(range(num_nodes))
    in_block = np.zeros(num_nodes, dtype=bool)
    tree_adj: dict[int, list[tuple[int, np.ndarray]]] = {}
    for v in order:
        roots = [_find(parent_of, u) for u, _ in adj[v] if in_block[u]]
        if len(roots) != len(set(roots)):
            continue  # would close a cycle
        in_block[v] = True
        tree_adj[v] = []
        for u, cost in adj[v]:
            if in_block[u]:
                tree_adj[v].append((u, cost))
                tree_adj[u].append((v, cost.T))
                parent_of[_find(parent_of, u)] = v
    return in_block, tree_adj


def _tree_order(root: int, tree_adj: dict[int, list[tuple[int, np.ndarray]]],
                visited: set[int]) -> tuple[list[int], dict[int, int]]:
    """Iterative DFS from `root`: (visit order, parents before children; parent of each node, -1 at the root)."""
    stack, seen, parent = [root], [], {root: -1}
    visited.add(root)
    while stack:
        v = stack.pop()
        seen.append(v)
        for u, _ in tree_adj[v]:
            if u not in visited:
                visited.add(u)
                parent[u] = v
                stack.append(u)
    return seen, parent


def _solve_tree(tree_adj: dict[int, list[tuple[int, np.ndarray]]], cond: dict[int, np.ndarray], seen: list[int],
                parent: dict[int, int], new: np.ndarray) -> None:
    """Exact min-sum DP over one tree: messages leaves to root, then back-track into `new`."""
    belief = {v: cond[v].copy() for v in seen}
    choice = {}  # child -> best child label for each parent label
    for v in reversed(seen):
        p = parent[v]
        if p < 0:
            continue
        cost_vp = next(c for u, c in tree_adj[v] if u == p)  # [v labels, p labels]
        table = belief[v][:, None] + cost_vp
        choice[v] = np.argmin(table, axis=0)
        belief[p] += np.minimum(table.min(axis=0), FORBIDDEN)
    root = seen[0]
    new[root] = int(np.argmin(belief[root]))
    for v in seen[1:]:
        new[v] = int(choice[v][new[parent[v]]])


def forest_search(mrf: PairwiseMRF, labels: np.ndarray, order: list[int]) -> np.ndarray:
    """Re-decide a whole induced forest of nodes exactly, the rest fixed (min-sum DP).

    Nodes are taken in ``order`` into the block while the block stays a forest (a node may
    join when its neighbours already in the block lie in different trees).  With the rest
    fixed, dynamic programming over each tree gives the block's exact best labels, so the
    energy never rises and long chains can switch together.
    """
    adj = mrf.neighbours()
    in_block, tree_adj = _grow_forest(adj, mrf.num_nodes, order)
    cond = {}  # unary conditioned on the fixed neighbours outside the block
    for v in tree_adj:
        c = mrf.unary[v].copy()
        for u, cost in adj[v]:
            if not in_block[u]:
                c += cost[:, labels[u]]
        cond[v] = np.minimum(c, FORBIDDEN)
    new = labels.copy()
    visited: set[int] = set()
    for root in tree_adj:
        if root not in visited:
            seen, parent = _tree_order(root, tree_adj, visited)
            _solve_tree(tree_adj, cond, seen, parent, new)
    return new if mrf.energy(new) < mrf.energy(labels) - 1e-9 else labels


def local_search(mrf: PairwiseMRF, labels: np.ndarray, max_rounds: int = 5) -> np.ndarray:
    """Alternate the three kinds of moves until a full round improves nothing."""
    energy = mrf.energy(labels)
    n = mrf.num_nodes
    orders = [list(range(n)), list(reversed(range(n))), list(range(0, n, 2)) + list(range(1, n, 2))]
    for _ in range(max_rounds):
        refined = coordinate_descent(mrf, labels)
        refined = coordinate_descent(mrf, edge_search(mrf, star_search(mrf, refined)))
        for order in orders:
            refined = forest_search(mrf, refined, order)
        e = mrf.energy(refined)
        if e >= energy - 1e-9:
            break
        labels, energy = refined, e
    return labels


def block_resolve(mrf: PairwiseMRF, labels: np.ndarray, block: list[int],
                  time_budget: float | None = 30.0, patience: int = 60) -> np.ndarray:
    """Re-solve the nodes of `block` jointly (TRW-S + local search) with every other node
    fixed at its label; returns the better of the old and the new assignment.

    Conditioning on the rest turns the edges leaving the block into unary terms, which
    changes what message passing converges to: it finds whole-block switches (a layer's
    attention changing its sharding everywhere at once) that neither the full solve nor
    local search reaches.
    """
    block = sorted(block)  # keeps the topological order TRW-S's chains follow
    inside = set(block)
    if not inside:
        return labels
    index = {g: i for i, g in enumerate(block)}
    adj = mrf.neighbours()
    unary = []
    for g in block:
        u = mrf.unary[g].copy()
        for j, cost in adj[g]:
            if j not in inside:
                u = u + cost[:, labels[j]]
        unary.append(u)
    sub = PairwiseMRF.from_unary(unary)
    for (i, j), cost in mrf.pairwise.items():
        if i in inside and j in inside:
            sub.add_pairwise(index[i], index[j], cost)  # block is sorted: same orientation
            f = mrf.factors.get((i, j))
            if f is not None:
                sub.set_factor(index[i], index[j], *f)
    sol = solve_mrf(sub, time_budget=time_budget, patience=patience)
    new = labels.copy()
    for g in block:
        new[g] = sol.labels[index[g]]
    return new if mrf.energy(new) < mrf.energy(labels) - 1e-9 else labels


def budgeted_search(mrf: PairwiseMRF, labels: np.ndarray, weight: dict[int, np.ndarray], low: float | None,
                    high: float | None, max_rounds: int = 50) -> np.ndarray:
    """Local search that keeps a linear resource within [low, high].

    `weight[i][l]` is what label l of node i uses (nodes not in `weight` use nothing); the
    start must already be within the bounds. Moves: single nodes (coordinate descent),
    then pairs of weighted nodes re-decided together, which trade the resource between
    them (e.g. un-shard one parameter and shard another further). Repairs the duality gap
    a Lagrangian penalty leaves when the budget lies between two of its plans.
    """
    adj = mrf.neighbours()
    labels = labels.copy()
    lo = -np.inf if low is None else low - 1e-12
    hi = np.inf if high is None else high + 1e-12
    used = sum(float(w[labels[i]]) for i, w in weight.items())
    heavy = sorted(weight)
    for _ in range(max_rounds):
        improved = False
        for i in range(mrf.num_nodes):
            costs = _local_costs(adj, mrf.unary, labels, i)
            if i in weight:
                after = used - float(weight[i][labels[i]]) + weight[i]
                costs = np.where((after >= lo) & (after <= hi), costs, np.inf)
            best = int(np.argmin(costs))
            if costs[best] < costs[labels[i]] - 1e-12:
                if i in weight:
                    used += float(weight[i][best] - weight[i][labels[i]])
                labels[i] = best
                improved = True
        for i in heavy:  # star moves: a weighted node and its (unweighted) neighbours switch together
            nbrs = [j for j, _ in adj[i] if j not in weight]
            others = used - float(weight[i][labels[i]])
            fits = [a for a in range(mrf.num_labels(i)) if a != labels[i] and lo <= others + weight[i][a] <= hi]
            move, _ = _best_star(mrf, adj, labels, i, nbrs, fits)
            if move is not None:
                labels, used = move, others + float(weight[i][move[i]])
                improved = True
        for a_pos, i in enumerate(heavy):  # pair moves: two weighted nodes trade the resource
            for j in heavy[a_pos + 1:]:
                others = used - float(weight[i][labels[i]]) - float(weight[j][labels[j]])
                after = others + weight[i][:, None] + weight[j][None, :]
                total = np.where((after >= lo) & (after <= hi), _pair_costs(mrf, adj, labels, i, j), np.inf)
                a, b = np.unravel_index(int(np.argmin(total)), total.shape)
                if total[a, b] < total[labels[i], labels[j]] - 1e-9:
                    used = float(after[a, b])
                    labels[i], labels[j] = int(a), int(b)
                    improved = True
        if not improved:
            break
    return labels


def solve_mrf(mrf: PairwiseMRF, max_sweeps: int = 1000, refine: bool = True, patience: int = 60,
              time_budget: float | None = None) -> MRFSolution:
    """TRW-S, then local search from its best few decoded assignments; the best wins."""
    start = time.perf_counter()
    sol = trws(mrf, max_sweeps=max_sweeps, patience=patience, time_budget=time_budget)
    labels, energy = sol.labels, sol.energy
    if refine:
        for seed in sol.starts:
            refined = local_search(mrf, seed)
            e = mrf.energy(refined)
            if e < energy - 1e-9:
                labels, energy = refined, e
    logger.info(
        "MRF: %d nodes, %d edges, %d TRW-S sweeps, energy %.6g (TRW-S alone %.6g), %.2fs",
        mrf.num_nodes, len(mrf.pairwise), sol.sweeps, energy, sol.energy,
        time.perf_counter() - start,
    )
    return MRFSolution(labels, energy, sol.sweeps, time.perf_counter() - start)
