"""Recomputation as a decision of the solve: one choice group beside the placement groups.

With `[activation_checkpoint] mode = "auto"` the Problem gains one more group whose labels
are per-block recomputation settings (`RecomputeChoice.options`: every block "none", then
the first k blocks per-op SAC, then the first k blocks fully recomputed, the rest per-op).
An edge joins it to every placement group a block's recomputation touches, priced per
(strategy class, option):

* `cost`: the forward time the backward spends again on the group's ops that the option
  recomputes, at the group's own strategy (a sharded op recomputes its shard);
* `memory`: the bytes of the group's outputs the option keeps from the forward to the
  backward, at the strategy's output placement (`Edge.memory`).

The exact ILP holds the activations of the chosen option, plus the model states of the
chosen parameter placements, under the memory limit in one row (solve/highs_model.py); the
MRF puts a multiplier on the same bytes, as it does for the parameter budget. Which values a
setting saves and recomputes is read off the joint graph with the runtime's own tags
(parallel/activation_checkpoint.py) and the partitioner's rule that a region's output read
by a later region is saved; the memory estimate of the chosen plan, from the step graph
torch's partitioner actually cuts, then corrects the row's constant (api.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import CheckpointPolicy

from parallel.activation_checkpoint import AC_CHOICES, tag_recomputation
from parallel.auto.candidates.placements import shard_factor
from parallel.auto.candidates.strategies import Candidates
from parallel.auto.problem.placement_problem import Edge
from parallel.auto.trace.blocks import block_indices
from parallel.auto.trace.joint import BWD, FWD

CHOICES = AC_CHOICES
"""Per-block settings: keep everything, per-op SAC (matmul and attention outputs kept), full."""

RECOMPUTE_GROUP = "activation checkpointing"
"""The member name of the choice group (no node of the graph has it)."""



@dataclass(frozen=True)
class BlockValues:
    """What one block keeps and recomputes under one setting (node names)."""

    saved: frozenset[str]
    recomputed: frozenset[str]


STATE_FACTOR = 4.0
"""Model-state bytes per local parameter byte: the fp32 parameter, its gradient, two AdamW states."""


@dataclass(frozen=True)
class RecomputeRow:
    """The memory row of a solve that chooses recomputation: the activations the chosen
    option keeps plus `state_factor` x the local parameter bytes (parameter, gradient and
    two AdamW states) stay under `limit` bytes. `limit` None: no row (memory is free, the
    solve then recomputes nothing)."""

    limit: float | None
    state_factor: float = STATE_FACTOR
    full_only: bool = False  # only the option that recomputes every block (no row)
    keep_choice: bool = False  # pose the choice even when memory is free (a replay reads a plan's choice into it)


@dataclass
class RecomputeChoice:
    """The choice group of a Problem: its index, its options (one setting per block), the
    per-block values each setting was priced from, and the build's memory row."""

    group: int
    options: list[tuple[str, ...]]
    values: dict[int, dict[str, BlockValues]]
    row: RecomputeRow | None = None

    def full_option(self) -> int:
        return self.options.index(("full",) * len(self.options[0]))

    @property
    def limited(self) -> bool:
        return self.row is not None and self.row.limit is not None

    def describe(self, label: int) -> str:
        """'full x4, op x28' for an option."""
        opt = self.options[label]
        return ", ".join(f"{c} x{opt.count(c)}" for c in CHOICES if opt.count(c))


def row_can_bind(prob: Any) -> bool:
    """Whether some plan's kept activations and model states could exceed the row's limit
    (if none can, the choice is moot: nothing is recomputed)."""
    choice = prob.recompute
    if not choice.limited:
        return False
    most = sum(float(e.memory.max()) for e in recompute_edges_of(prob) if e.memory is not None)
    most += choice.row.state_factor * sum(float(prob.param_bytes[g][prob.allowed[g]].max(initial=0.0))
                                          for g in prob.param_groups)
    return most > choice.row.limit


def recompute_edges_of(prob: Any) -> list[Any]:
    return [e for e in prob.edges if e.kind == "recompute"]


def _chosen(prob: Any, labels: Any, table: str) -> float:
    """The recomputation edges' `table` ("cost" or "memory") summed at the plan's labels."""
    choice = prob.recompute
    if choice is None:
        return 0.0
    a = int(labels[choice.group])
    return float(sum(getattr(e, table)[e.src_cls[int(labels[e.src])], a] for e in recompute_edges_of(prob)))


def activation_bytes(prob: Any, labels: Any) -> float:
    """Bytes the plan's recomputation option keeps (its placements' activations)."""
    return _chosen(prob, labels, "memory")


def row_bytes(prob: Any, labels: Any) -> float:
    """The memory row's value of a plan: kept activations + model states."""
    choice = prob.recompute
    states = sum(float(prob.param_bytes[g][int(labels[g])]) for g in prob.param_groups)
    return activation_bytes(prob, labels) + choice.row.state_factor * states


def row_holds(prob: Any, labels: Any) -> bool:
    """Whether a plan keeps the memory row (always, without one)."""
    choice = prob.recompute
    if choice is None or not choice.limited:
        return True
    return row_bytes(prob, labels) <= choice.row.limit * (1 + 1e-9)


def recompute_us(prob: Any, labels: Any) -> float:
    """Forward time the plan's backward spends again (µs, all copies)."""
    return _chosen(prob, labels, "cost")


def recompute_options(n_blocks: int) -> list[tuple[str, ...]]:
    """Every block "none"; the first k per-op SAC (k = 1..n); the first k fully recomputed,
    the rest per-op (k = 1..n). Earlier blocks recompute more: their activations live longest
    (for the peak at the backward's start every saved byte counts the same)."""
    out = [("none",) * n_blocks]
    out += [("op",) * k + ("none",) * (n_blocks - k) for k in range(1, n_blocks + 1)]
    out += [("full",) * k + ("op",) * (n_blocks - k) for k in range(1, n_blocks + 1)]
    return out


def _forward_nodes(jg: Any) -> list[Any]:
    return [n for n in jg.gm.graph.nodes if jg.phase.get(n.name) == FWD and n.op == "call_function"]


def _recomputed_here(n: Any, block_of: dict[str, int]) -> bool:
    """Tagged for recomputation and not a region's output read by a later region (torch's
    partitioner saves those: two checkpointed blocks in a row stash their boundary)."""
    if n.meta.get("recompute") != CheckpointPolicy.PREFER_RECOMPUTE:
        return False
    b = block_of.get(n.name)
    return not any(u.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE and block_of.get(u.name, b) != b
                   for u in n.users)


def _walk(jg: Any, forward: list[Any], block_of: dict[str, int]) -> tuple[set[str], set[str]]:
    """(saved, recomputed) forward values under the graph's current tags: from what the
    backward reads, through recomputed nodes to what they read."""
    fwd = {n.name for n in forward}
    stack = [n for n in forward if any(jg.phase.get(u.name) == BWD for u in n.users)]
    seen: set[str] = set()
    saved: set[str] = set()
    recomputed: set[str] = set()
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if _recomputed_here(n, block_of):
            recomputed.add(n.name)
            stack.extend(a for a in n.all_input_nodes if a.name in fwd)
        else:
            saved.add(n.name)
    return saved, recomputed


def block_values(jg: Any, block_of: dict[str, int]) -> dict[int, dict[str, BlockValues]]:
    """Per block, per setting: the values it keeps and recomputes (every block tagged alike;
    blocks are regions of their own, so one block's values do not depend on the others')."""
    forward = _forward_nodes(jg)
    blocks = sorted(set(block_of.values()))
    out: dict[int, dict[str, BlockValues]] = {b: {} for b in blocks}
    n_blocks = max(blocks) + 1
    try:
        for choice in CHOICES:
            tag_recomputation(forward, block_of, (choice,) * n_blocks)
            saved, recomputed = _walk(jg, forward, block_of)
            for b in blocks:
                out[b][choice] = BlockValues(frozenset(n for n in saved if block_of.get(n) == b),
                                             frozenset(n for n in recomputed if block_of.get(n) == b))
    finally:
        tag_recomputation(forward, block_of, ("none",) * n_blocks)  # the runtime tags its own partition
    return out


def _output_bytes(c: Any, mesh_shape: tuple[int, ...], mp_dtype: torch.dtype | None) -> np.ndarray:
    """Local bytes of a node's (first) output per strategy, floats in the compute dtype."""
    val = c.node.meta.get("val") if c.node is not None else None
    if isinstance(val, (tuple, list)):
        val = val[0] if val else None
    if not isinstance(val, torch.Tensor):
        return np.zeros(len(c.specs))
    item = val.dtype.itemsize
    if mp_dtype is not None and val.dtype.is_floating_point and item > mp_dtype.itemsize:
        item = mp_dtype.itemsize
    nbytes = float(val.numel() * item)
    out = np.empty(len(c.specs))
    for j, s in enumerate(c.specs):
        o = s.output_specs
        if isinstance(o, tuple):
            o = o[c.getitem_index or 0] if len(o) > (c.getitem_index or 0) else None
        out[j] = nbytes / shard_factor(o.placements, mesh_shape) if o is not None else nbytes
    return out


def recompute_edges(cands: Candidates, group_of: dict[str, int], compute: dict[str, np.ndarray],
                    mp_dtype: torch.dtype | None, choice_group: int) -> tuple[RecomputeChoice, list[Edge]] | None:
    """The choice group's options and one edge from every placement group its options touch
    (cost: recompute µs, memory: kept bytes, per strategy class x option); None for a graph
    without transformer blocks."""
    jg = cands.graph
    block_of = block_indices(jg)
    if not block_of:
        return None
    values = block_values(jg, block_of)
    blocks = sorted(values)
    options = recompute_options(len(blocks))
    position = {b: i for i, b in enumerate(blocks)}
    # per option and block: the setting's index in CHOICES
    setting = np.array([[CHOICES.index(opt[position[b]]) for b in blocks] for opt in options])
    touched: dict[int, list[str]] = {}
    for b in blocks:
        for bv in values[b].values():
            for name in bv.saved | bv.recomputed:
                if name in cands.nodes:
                    touched.setdefault(group_of[name], []).append(name)
    mesh_shape = tuple(cands.mesh.shape)
    edges = []
    for g, names in sorted(touched.items()):
        names = sorted(set(names))
        t, m = _group_tables(cands, names, values, block_of, position, setting, compute, mesh_shape, mp_dtype)
        table = np.concatenate([t, m], axis=1)
        uniq, cls = np.unique(table, axis=0, return_inverse=True)
        k = len(options)
        edges.append(Edge(g, choice_group, cls.reshape(-1).astype(np.int64), np.arange(k), [], [],
                          uniq[:, :k].copy(), kind="recompute", memory=uniq[:, k:].copy()))
    return RecomputeChoice(choice_group, options, values), edges


def _group_tables(cands: Candidates, names: list[str], values: dict, block_of: dict[str, int],
                  position: dict[int, int], setting: np.ndarray, compute: dict[str, np.ndarray],
                  mesh_shape: tuple[int, ...], mp_dtype: torch.dtype | None) -> tuple[np.ndarray, np.ndarray]:
    """[strategies x options] recompute µs and kept bytes of one group's members."""
    n_opt = setting.shape[0]
    first = cands.nodes[names[0]]
    time = np.zeros((len(first.specs), n_opt))
    memory = np.zeros((len(first.specs), n_opt))
    for name in names:
        b = block_of[name]
        col = setting[:, position[b]]  # the member's setting under each option
        rec = np.array([name in values[b][c].recomputed for c in CHOICES])[col]
        kept = np.array([name in values[b][c].saved for c in CHOICES])[col]
        if rec.any():  # (a strategy priced inf stays inf where it is recomputed)
            time += np.where(rec[None, :], compute[name][:, None], 0.0)
        if kept.any():
            memory += np.where(kept[None, :], _output_bytes(cands.nodes[name], mesh_shape, mp_dtype)[:, None], 0.0)
    return time, memory


class RowTracker:
    """The memory row's value under single-group moves (a local search keeps it)."""

    def __init__(self, prob: Any, labels: Any) -> None:
        choice = prob.recompute
        self.prob, self.choice, self.limit = prob, choice, choice.row.limit
        self.kept = [e for e in recompute_edges_of(prob) if e.memory is not None and e.memory.any()]
        self.edges_of: dict[int, list[Any]] = {}
        for e in self.kept:
            self.edges_of.setdefault(e.src, []).append(e)
        self.params = set(prob.param_groups)
        self.groups = set(self.edges_of) | self.params | {choice.group}
        self.value = row_bytes(prob, labels)

    def after(self, g: int, idx: np.ndarray, labels: Any) -> np.ndarray:
        """The row's value with group `g` moved to each of the strategies `idx`."""
        a = int(labels[self.choice.group])
        if g == self.choice.group:
            now = sum(float(e.memory[e.src_cls[int(labels[e.src])], a]) for e in self.kept)
            new = sum(e.memory[e.src_cls[int(labels[e.src])], idx] for e in self.kept)
            return self.value - now + new
        delta = np.zeros(len(idx))
        cur = int(labels[g])
        for e in self.edges_of.get(g, []):
            delta += e.memory[e.src_cls[idx], a] - e.memory[e.src_cls[cur], a]
        if g in self.params:
            delta += self.choice.row.state_factor * (self.prob.param_bytes[g][idx] - self.prob.param_bytes[g][cur])
        return self.value + delta
