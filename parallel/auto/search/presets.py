"""Constraint sets that shape a plan like a hand-written recipe (on the planner's own terms).

What a user asks for to compare the planner's free choice with a recipe ("what would
FSDP cost here?"), and what the fidelity benchmark and the tests use to make distinct
plans of one job. Each function adds constraints to an open `AutoParallel`; the planner
still decides everything the preset leaves free.

  * `fsdp`: every forward matmul (x @ W.t()) and the embedding take a batch-sharded input
    and a gathered weight on the data axes; parameters fully sharded (the default budget);
  * `ddp`: every parameter replicated;
  * `megatron`: the projections column / row sharded on one mesh axis (attention q/k/v and
    MLP w1/w3 by output features, o and w2 by input features);
  * `replicated`: some parameters (by FQN fragment) replicated, e.g. the embeddings;
  * `context_parallel`: causal-attention regions with the sequence sharded on one axis
    (and the batch on the others), K/V gathered (needs the region traced, regions/cp_attention.py);
  * `expert_parallel`: the EP recipe (parallel/recipes/ep.py): FSDP on the data axes, every MoE
    dispatch region with its experts split over one axis and its tokens sent there all-to-all.

Projection names follow the LLaMA family's modules (`COLUMN`, `ROW`); pass your own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from parallel.auto.api import AutoParallel
from parallel.auto.regions import CP_ATTENTION, MOE_DISPATCH, forward_op
from parallel.auto.selection import replicate_every_parameter
from parallel.auto.trace.joint import FWD

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def _matches(fqn: str, fragments: Iterable[str]) -> bool:
    return any(f".{p}." in f".{fqn}" for p in fragments)


def fsdp(autop: AutoParallel, data_axes: Sequence[int] = (0,), fragments: Iterable[str] | None = None) -> None:
    """FSDP: fully sharded parameters (the default budget), gathered for compute; activations
    batch-sharded on `data_axes`; `fragments`: only the matmuls of weights whose FQN
    contains one of these."""
    ndim = autop.mesh.ndim
    autop.add_parameter_memory_constraint()  # FSDP's storage: fully sharded (the default budget)
    data = tuple(Shard(0) if i in data_axes else Replicate() for i in range(ndim))
    rep = (Replicate(),) * ndim
    jg = autop.graph
    frags = list(fragments) if fragments is not None else None
    params = {n.name: fqn for fqn, n in jg.params.items()
              if frags is None or any(f in fqn for f in frags)}
    for n in jg.gm.graph.nodes:
        if n.op != "call_function" or jg.phase.get(n.name) != FWD:
            continue
        if n.target is torch.ops.aten.mm.default:
            w = n.args[1]
            if w.op == "call_function" and w.target is torch.ops.aten.t.default and w.args[0].name in params:
                autop.add_node_constraint(n.name, data, input_placements=[data, rep])
        elif n.target is torch.ops.aten.embedding.default and n.args[0].name in params:
            autop.add_node_constraint(n.name, data, input_placements=[rep, data])


def ddp(autop: AutoParallel) -> None:
    """Every parameter replicated on every mesh axis (gradients all-reduced)."""
    replicate_every_parameter(autop)


def megatron(autop: AutoParallel, axis: int, column: Sequence[str] = COLUMN, row: Sequence[str] = ROW,
             fragments: Iterable[str] | None = None, fsdp_other_axes: bool = False,
             data_axes: Sequence[int] = ()) -> None:
    """Megatron tensor parallel on mesh `axis`: column projections (weights sharded by output
    features) compute on the full activation and give feature-sharded outputs; row
    projections take those and give partial sums. On the other axes the weights are
    replicated, or sharded on their other dim (`fsdp_other_axes`: FSDP + TP), and the
    activations batch-sharded on `data_axes`. `fragments`: only the projections whose FQN
    contains one of these (e.g. "attention")."""
    ndim = autop.mesh.ndim
    roles: dict[str, int] = {}
    for fqn in autop.graph.params:
        if fragments is not None and not any(f in fqn for f in fragments):
            continue
        dim = 0 if _matches(fqn, column) else 1 if _matches(fqn, row) else None
        if dim is None:
            continue
        roles[fqn] = dim
        other = Shard(1 - dim) if fsdp_other_axes else Replicate()
        autop.add_node_constraint(fqn, tuple(Shard(dim) if i == axis else other for i in range(ndim)))
    _megatron_compute(autop, axis, roles, data_axes)


def _megatron_compute(autop: AutoParallel, axis: int, roles: dict[str, int], data_axes: Sequence[int]) -> None:
    """The forward matmuls of the projections in `roles` (FQN -> 0 column, 1 row) compute
    Megatron-style on `axis` (x @ W.t(): the transposed weight is sharded the other way)."""
    ndim = autop.mesh.ndim
    jg = autop.graph
    fqn_of = {n.name: fqn for fqn, n in jg.params.items()}

    def act(axis_p: object) -> tuple:  # an activation: batch-sharded on the data axes
        return tuple(axis_p if i == axis else (Shard(0) if i in data_axes else Replicate()) for i in range(ndim))

    def weight(axis_p: object) -> tuple:  # a (transposed) weight: whole on the other axes
        return tuple(axis_p if i == axis else Replicate() for i in range(ndim))

    for n in jg.gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.mm.default or jg.phase.get(n.name) != FWD:
            continue
        w = n.args[1]
        if not (w.op == "call_function" and w.target is torch.ops.aten.t.default and w.args[0].name in fqn_of):
            continue
        dim = roles.get(fqn_of[w.args[0].name])
        if dim == 0:  # column: full x, W.t() sharded by columns -> output sharded by features
            autop.add_node_constraint(n.name, act(Shard(1)), input_placements=[act(Replicate()), weight(Shard(1))])
        elif dim == 1:  # row: feature-sharded x, W.t() sharded by rows -> partial sums
            autop.add_node_constraint(n.name, act(Partial()), input_placements=[act(Shard(1)), weight(Shard(0))])


def replicated(autop: AutoParallel, fragments: Iterable[str]) -> None:
    """The parameters whose FQN contains one of `fragments` replicated on every axis."""
    frags = list(fragments)
    autop.add_parameter_memory_constraint(high=1.0)
    for fqn in autop.graph.params:
        if any(f in fqn for f in frags):
            autop.add_node_constraint(fqn, (Replicate(),) * autop.mesh.ndim)


def context_parallel(autop: AutoParallel, axis: int, batch_axes: Sequence[int] = ()) -> int:
    """Every causal-attention region runs sequence-sharded on mesh axis `axis` (CP) and
    batch-sharded on `batch_axes` (replicated on the rest). Returns the number of regions."""
    fwd = forward_op(CP_ATTENTION)
    nodes = [n for n in autop.graph.gm.graph.nodes if n.target == fwd]
    if not nodes:
        raise ValueError("context_parallel: no causal-attention region in the traced graph; trace with "
                         f"AutoParallel(..., regions=({CP_ATTENTION!r},))")
    pl = tuple(Shard(2) if i == axis else Shard(0) if i in batch_axes else Replicate()
               for i in range(autop.mesh.ndim))
    for n in nodes:
        autop.add_node_constraint(n.name, pl)
    return len(nodes)


def expert_parallel(autop: AutoParallel, ep_axis: int, data_axes: Sequence[int]) -> int:
    """The EP recipe on the planner's terms: `fsdp` on `data_axes` for every dense weight, and
    every MoE dispatch region with batch-sharded tokens, its experts split over `ep_axis`
    (`expert_parallel` there: E/n experts a rank, token-slots all-to-all) and gathered on the
    other data axes (`dense_experts`: FSDP-stored, gathered for compute). Returns the number
    of regions."""
    fwd = forward_op(MOE_DISPATCH)
    nodes = [n for n in autop.graph.gm.graph.nodes if n.target == fwd]
    if not nodes:
        raise ValueError("expert_parallel: no MoE dispatch region in the traced graph; trace with "
                         f"AutoParallel(..., regions=({MOE_DISPATCH!r},))")
    fsdp(autop, data_axes)
    ndim = autop.mesh.ndim
    tokens = tuple(Shard(0) if i in data_axes or i == ep_axis else Replicate() for i in range(ndim))
    experts = tuple(Shard(0) if i == ep_axis else Replicate() for i in range(ndim))
    for n in nodes:  # (x, top_scores, selected, w1, w2, w3) -> y
        autop.add_node_constraint(n.name, tokens, input_placements=[tokens] * 3 + [experts] * 3)
    return len(nodes)
