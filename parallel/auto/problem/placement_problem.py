"""Stage 3's product: the placement Problem (unary + pairwise costs), solver-agnostic.

Decision *groups* (nodes that must choose the same strategy index: forward/backward
pairs, and the copies of one op in repeated layers) each pick one strategy; a group pays
a unary cost (compute, weighted by its copies) and every edge pays a redistribution cost
that depends only on the producer's output placement class and the consumer's expected
input placement class. Keeping the edge cost at the placement-class level (not strategy x
strategy) is what keeps the exact ILP small. User constraints restrict `allowed`; the
parameter-memory budget is a linear constraint over parameter groups.

Built by `formulation.build_problem`; checked by `feasibility`; solved by `solve/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parallel.auto.candidates.placements import shard_factor
from parallel.auto.candidates.strategies import Candidates


class PlanningError(ValueError):
    """The planning problem cannot be solved; the message names the conflicting user constraints."""


class MemoryLimitError(PlanningError):
    """No plan's predicted peak memory per device fits in the memory limit (the message
    gives the peak, its parts, the limit and where the limit comes from); `estimate` is the
    MemoryEstimate of the most sharded plan tried, for callers that tabulate it (sweeps)."""

    def __init__(self, message: str, estimate: Any = None) -> None:
        super().__init__(message)
        self.estimate = estimate


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
    kind: str = "redistribution"  # or "recompute": a placement group to the recomputation choice (recompute.py)
    memory: np.ndarray | None = None  # "recompute": activation bytes kept, same shape as cost

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
    recompute: Any = None  # recompute.RecomputeChoice: the last group chooses each block's recomputation

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


def min_parameter_fraction(cands: Candidates) -> float:
    """Smallest achievable per-device share of parameter bytes (every param at its most sharded)."""
    jg = cands.graph
    shape = tuple(cands.mesh.shape)
    total = sum(jg.param_bytes.values())
    if not total:
        return 0.0
    need = 0.0
    for fqn, node in jg.params.items():
        best = max(shard_factor(s.output_specs.placements, shape) for s in cands.nodes[node.name].specs)
        need += jg.param_bytes[fqn] / best
    return need / total
