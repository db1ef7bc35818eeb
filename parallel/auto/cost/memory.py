"""Peak memory per device of a plan: a liveness walk over the step graph the runtime runs.

The runtime executes one training step per rank as ONE graph (runtime/step_graph.py:
forward, loss, backward, with the plan's functional collectives, overlap-scheduled), run
eagerly value by value, each freed after its last use. Its fake tensors carry this rank's
local sizes, and views share their base's storage, so walking the nodes in order gives the
bytes alive at every op:

  * a storage is alive from the first node that produces it to the last use of any value
    on it (a view keeps its base alive); graph outputs (the loss, the gradients) stay;
  * a collective's result is alive from its issue (its wait returns that same buffer),
    its input until the wait returns (the work holds it; an all-reduce works on a copy);
  * on gloo (CPU ranks) an all-gather also allocates a buffer of its output's size inside
    ProcessGroupGloo (a flat staging tensor), counted from the issue to the wait: invisible
    to a dispatch-level tracker, seen by the allocator (parallel.measure.AllocatorPeak: the
    debug LLaMA's logits gather for the loss, 4 MiB on 2 ranks and 8 MiB on 4, was exactly
    what the estimate missed before it was counted; scripts/bench_memory.py);
  * graph inputs (parameter shards, buffers, the batch) exist before the step and are
    counted as persistent state, not by the walk;
  * on top: the parameters, buffers and AdamW's two states per parameter (in the
    parameter's dtype: the fp32 master weights ARE the parameters; the bf16 copies of a
    mixed-precision plan are casts inside the graph, counted by the walk);
  * then the optimizer step: all gradients alive, plus foreach AdamW's one temporary per
    parameter (sqrt of the second moment), or two of the largest for the for-loop version.

At the peak every live byte gets one label: parameters, gradients, optimizer states,
activations (values the forward produced from the batch that are still alive), or
transient (gathered parameters and their casts, collective buffers, backward temporaries).
The labels sum to the peak. Eager execution only: Inductor plans its own buffers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import fx

from parallel import _torch as T

GIB = 2**30
OPTIMIZERS = ("foreach", "for-loop", "fused")
"""AdamW's implementations (`[optimizer] implementation`), one list for the config check and the estimate."""
_VIEWS = {"view", "_unsafe_view", "reshape", "alias", "detach", "squeeze", "unsqueeze", "expand", "clone", "_to_copy"}


def _unit(n: float) -> tuple[str, int]:
    return ("GiB", GIB) if n >= GIB // 4 else ("MiB", 2**20)


def format_bytes(n: float) -> str:
    """'12.34 GiB', or MiB below a quarter GiB."""
    unit, div = _unit(n)
    return f"{n / div:,.2f} {unit}"


@dataclass
class MemoryEstimate:
    """Bytes per device at the predicted peak of a training step, by what holds them."""

    params_bytes: int  # parameter shards (master dtype) and buffers
    grads_bytes: int  # gradients alive at the peak
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq
    activations_bytes: int  # forward values (from the batch) alive at the peak
    transient_bytes: int  # gathered parameters, collective buffers, temporaries at the peak
    peak_bytes: int  # the sum of the five above
    phase: str  # where the peak is: "forward", "backward", "gradient reduction" or "optimizer"
    saved_bytes: int = 0  # activations alive when the forward ends (saved for the backward)
    all_grads_bytes: int = 0  # every gradient (held until the next zero_grad)
    limit_bytes: int = 0  # the memory limit the plan was checked against (0: none)
    limit_source: str = ""  # where the limit comes from (a profile file, the API, a TOML key)
    # per layer ('layers.3'; OUTSIDE: embedding, head, loss), for the plan page; {} in plans
    # written before they were recorded
    activations_by_block: dict[str, int] = field(default_factory=dict)  # activations at the peak
    saved_by_block: dict[str, int] = field(default_factory=dict)  # activations when the forward ends
    recomputed_by_block: dict[str, int] = field(default_factory=dict)  # recomputed values the backward reads
    recompute: str = ""  # activation checkpointing: "none", "full", "selective op", "per block: full, op", ...
    # ("": not recorded); per layer, its choice ("none", "op", "full"): {} without checkpointing
    recompute_by_block: dict[str, str] = field(default_factory=dict)
    # a pipeline stage: the microbatches whose saved activations the schedule holds at its peak
    # (the others' `saved_bytes` are in `activations_bytes` and `peak_bytes`); 1 without a pipeline
    microbatches_held: int = 1

    def summary(self) -> str:
        """One line for the plan summary and logs."""
        limit = f" of limit {format_bytes(self.limit_bytes)} ({self.limit_source})" if self.limit_bytes else ""
        return f"memory per device: {self.parts()}; peak {format_bytes(self.peak_bytes)} (in the {self.phase}){limit}"

    def parts(self) -> str:
        """The peak's parts, in the peak's unit."""
        unit, div = _unit(self.peak_bytes)
        g = lambda b: f"{b / div:,.2f}"  # noqa: E731
        return (f"params {g(self.params_bytes)} {unit}, grads {g(self.grads_bytes)}, optimizer "
                f"{g(self.optimizer_bytes)}, activations {g(self.activations_bytes)}, transient "
                f"{g(self.transient_bytes)}")

    @property
    def fits(self) -> bool:
        return not self.limit_bytes or self.peak_bytes <= self.limit_bytes

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any, source: str = "the plan") -> "MemoryEstimate":
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or not {"params_bytes", "peak_bytes", "phase"} <= set(d) or set(d) - names:
            raise ValueError(f"{source}: 'memory' is not a memory estimate ({str(d)[:120]}); re-plan")
        return cls(**d)


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    return []


OUTSIDE = "(outside blocks)"
"""`MemoryEstimate.activations_by_block`'s key for values made outside the transformer blocks."""
BLOCK = "memory_block"
"""Node meta key of a step-graph node: the layer ('layers.3') of the phase-graph node that made it
(runtime/interpreter.TraceTags), None outside the blocks."""
RECOMPUTED = "memory_recomputed"
"""Node meta key of a step-graph node: True where it recomputes a forward op in the backward."""

COPIED_STORAGES = "copied_storages"
"""Node meta key of a step-graph node that is a copy of a repeated block's node
(runtime/repeated_blocks.py): such a node's value is its template's own fake tensor (a fresh
one per copy costs more than the rest of the copy), and this mapping gives, for each
storage of that value, the storage the copy stands for."""


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(identity, bytes) of a tensor's storage; views share their base's."""
    try:
        return T.storage_id(t), t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def value_storages(n: fx.Node) -> list[tuple[Hashable, int]]:
    """(identity, bytes) of the storage of each tensor of a node's value, in order: two
    values on one storage (a view and its base) have one identity, and a copied block's
    node has the identity its copy stands for (`COPIED_STORAGES`), not its template's."""
    remap = n.meta.get(COPIED_STORAGES)
    out = []
    for t in _tensors(n.meta.get("val")):
        k = _storage(t)
        if k is not None:
            out.append((k if remap is None else (remap[k[0]], k[1])))
    return out


def _is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional" \
        and T.op_name(n.target) == "wait_tensor"


def _is_collective(n: fx.Node) -> bool:
    return getattr(n.target, "namespace", "") == "_c10d_functional" and T.op_name(n.target) != "wait_tensor"


def _forward_end(loss: fx.Node) -> fx.Node:
    """The op that computes the loss: behind its reduction's wait (deferred to the end of
    the step by the overlap pass), the collective and views."""
    n = loss
    while n.op == "call_function" and n.all_input_nodes and (
            getattr(n.target, "namespace", "") == "_c10d_functional" or T.op_name(n.target) in _VIEWS):
        n = n.all_input_nodes[0]
    return n


class _Liveness:
    """Live ranges of the storages of a graph's values (node positions, inclusive)."""

    def __init__(self, gm: fx.GraphModule, gather_staging: bool = False,
                 held: Sequence[tuple[fx.Node, fx.Node, int]] = ()):
        self.nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(self.nodes)}
        self.size: dict[Hashable, int] = {}
        self.start: dict[Hashable, int] = {}
        self.end: dict[Hashable, int] = {}
        self.external: set[Hashable] = set()  # storages of the graph's inputs (exist before the step)
        self.producer: dict[Hashable, fx.Node] = {}
        self.alias: dict[Hashable, Hashable] = {}  # a wait's result is its collective's output (traced as a new tensor)
        for i, n in enumerate(self.nodes):
            if _is_wait(n):
                for (own, _), (base, _) in zip(self.keys(n), self.keys(n.args[0])):
                    self.alias[own] = base
            last = max((pos[u] for u in n.users), default=i)  # FX frees a value after its last user
            for key, nbytes in self.keys(n):
                if n.op == "placeholder":
                    self.external.add(key)
                if key not in self.start:
                    self.start[key], self.producer[key] = i, n
                self.size[key] = max(self.size.get(key, 0), nbytes)
                self.end[key] = max(self.end.get(key, i), last)
        self._hold_collective_inputs(pos)
        self.staging: set[Hashable] = set()  # gloo's flat all-gather buffers (synthetic keys, negative)
        if gather_staging:
            self._stage_gathers(pos)
        for j, (a, b, nbytes) in enumerate(held):  # kept outside the graph's values, from a to b
            key = ("held", j)
            self.size[key], self.start[key], self.end[key], self.producer[key] = nbytes, pos[a], pos[b], a

    def keys(self, n: fx.Node) -> list[tuple[Hashable, int]]:
        """(storage, bytes) of a node's tensors, a wait's result as its collective's output."""
        return [(self.alias.get(k, k), nbytes) for k, nbytes in value_storages(n)]

    def _hold_collective_inputs(self, pos: dict[fx.Node, int]) -> None:
        """An issued collective keeps its input buffer until its wait (the work holds it and
        lets go when the wait returns); an all-reduce copies its input first and works on
        the copy (its output)."""
        for n in self.nodes:
            if not _is_collective(n) or T.op_name(n.target) == "all_reduce":
                continue
            wait = max((pos[u] for u in n.users), default=pos[n] + 1)
            for a in n.all_input_nodes:
                for key, _ in self.keys(a):
                    self.end[key] = max(self.end[key], wait - 1)

    def _stage_gathers(self, pos: dict[fx.Node, int]) -> None:
        """gloo's all-gather: a flat buffer of the output's bytes from the issue to the wait."""
        for n in self.nodes:
            if not _is_collective(n) or "all_gather" not in T.op_name(n.target):
                continue
            key = -1 - pos[n]
            self.size[key] = sum(b for _, b in self.keys(n))
            self.start[key], self.producer[key] = pos[n], n
            self.end[key] = max((pos[u] for u in n.users), default=pos[n] + 1) - 1
            self.staging.add(key)

    def internal(self) -> list[Hashable]:
        return [k for k in self.start if k not in self.external]


def _derived_from_state(nodes: list[fx.Node], n_inputs: int) -> set[fx.Node]:
    """Nodes computed from parameter shards and buffers only (gathers, casts, views of
    them): what the forward keeps of them is not an activation. The batch is the last
    `n_inputs` graph inputs."""
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out: set[fx.Node] = set(placeholders[:len(placeholders) - n_inputs])
    for n in nodes:
        if n.op == "call_function" and n.all_input_nodes and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def optimizer_temp_bytes(local_param_bytes: list[int], optimizer: str = "foreach") -> int:
    """AdamW's temporaries in its step, in parameter order: foreach computes sqrt(exp_avg_sq)
    for every parameter at once (one tensor per parameter); the for-loop version holds sqrt
    and the divided denominator of one parameter while the previous one's last temporary is
    not yet freed; the fused kernel updates in place. The CPU allocator agrees for each
    (test_memory_measured.py)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer implementation {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if optimizer == "foreach":
        return sum(local_param_bytes)
    if optimizer == "fused":
        return 0
    b = list(local_param_bytes)
    return max((2 * x + (b[i - 1] if i else 0) for i, x in enumerate(b)), default=0)


@dataclass
class _Peak:
    total: int = -1
    at: int = 0
    parts: dict[str, int] | None = None


def _labels(lv: _Liveness, grad_keys: set[Hashable], boundary: int, state: set[fx.Node]) -> dict[Hashable, str]:
    out = {}
    for k in lv.internal():
        if k in grad_keys:
            out[k] = "grads"
        elif k in lv.staging:
            out[k] = "transient"
        elif lv.start[k] <= boundary and lv.producer[k] not in state:
            out[k] = "activations"
        else:
            out[k] = "transient"
    return out


def _sweep(lv: _Liveness, labels: dict[Hashable, str], boundary: int) -> tuple[_Peak, int]:
    """(the peak of live bytes with its parts, activations alive when the forward ends)."""
    allocs: dict[int, list[Hashable]] = {}
    frees: dict[int, list[Hashable]] = {}
    for k in labels:
        allocs.setdefault(lv.start[k], []).append(k)
        frees.setdefault(lv.end[k], []).append(k)
    live = {"grads": 0, "activations": 0, "transient": 0}
    peak, saved = _Peak(), 0
    for i in range(len(lv.nodes)):
        for k in allocs.get(i, ()):
            live[labels[k]] += lv.size[k]
        total = sum(live.values())
        if total > peak.total:
            peak = _Peak(total, i, dict(live))
        if i == boundary:
            saved = live["activations"]
        for k in frees.get(i, ()):
            live[labels[k]] -= lv.size[k]
    return peak, saved


def step_graph_memory(gm: fx.GraphModule, *, n_inputs: int, n_outputs: int, state_bytes: int,
                      optimizer_bytes: int, optimizer_temp: int, gather_staging: bool = False,
                      reduced_grad_bytes: int | None = None,
                      held: Sequence[tuple[fx.Node, fx.Node, int]] = ()) -> MemoryEstimate:
    """The peak of one training step of `gm` (a rank's step graph: `(param locals, buffer
    locals, input locals) -> (outputs..., gradients...)`), see the module docstring.

    `state_bytes`: local parameter and buffer bytes; `optimizer_bytes`: the AdamW states;
    `optimizer_temp`: the optimizer step's temporaries (`optimizer_temp_bytes`);
    `gather_staging`: the collectives run on gloo (all-gathers stage their output).
    `reduced_grad_bytes`: `gm` is a micro-batch's graph without gradient reductions
    (gradient accumulation): the earlier micro-batches' summed unreduced gradients (as large
    as this graph's) are held through it, then reduced once into gradients of this many bytes.
    `held`: memory the run keeps beside the graph's values, (from node, to node, bytes): a
    region's forward kept for its backward (regions/tape.py).
    """
    lv = _Liveness(gm, gather_staging, held)
    outs = [a for a in gm.graph.output_node().args[0] if isinstance(a, fx.Node)]
    pos = {n: i for i, n in enumerate(lv.nodes)}
    boundary = max(pos[_forward_end(n)] for n in outs[:n_outputs])  # the loss: the forward ends there
    grad_keys = {k for n in outs[n_outputs:] for k, _ in lv.keys(n)}
    state = _derived_from_state(lv.nodes, n_inputs)
    labels = _labels(lv, grad_keys, boundary, state)
    peak, saved = _sweep(lv, labels, boundary)
    all_grads = sum(lv.size[k] for k in grad_keys if k in labels)
    parts = dict(peak.parts or {"grads": 0, "activations": 0, "transient": 0})
    phase = "forward" if peak.at <= boundary else "backward"
    if reduced_grad_bytes is not None:  # the sum so far, alive through the whole graph
        parts["grads"] += all_grads
        if all_grads + reduced_grad_bytes > sum(parts.values()):  # the whole sum and its reduced gradients
            parts, phase = {"grads": all_grads + reduced_grad_bytes, "activations": 0, "transient": 0}, \
                "gradient reduction"
        all_grads = reduced_grad_bytes
    if all_grads + optimizer_temp > sum(parts.values()):  # the optimizer step holds more than any op of the graph
        parts, phase = {"grads": all_grads, "activations": 0, "transient": optimizer_temp}, "optimizer"
    acts = [k for k, label in labels.items() if label == "activations"]
    return MemoryEstimate(
        params_bytes=state_bytes, grads_bytes=parts["grads"], optimizer_bytes=optimizer_bytes,
        activations_bytes=parts["activations"], transient_bytes=parts["transient"],
        peak_bytes=state_bytes + optimizer_bytes + sum(parts.values()), phase=phase, saved_bytes=saved,
        all_grads_bytes=all_grads,
        activations_by_block=_alive_by_block(lv, acts, peak.at) if parts["activations"] else {},
        saved_by_block=_alive_by_block(lv, acts, boundary),
        recomputed_by_block=_recomputed_by_block(lv, labels, boundary, state))


def _block(n: fx.Node) -> str:
    return n.meta.get(BLOCK) or OUTSIDE


def _alive_by_block(lv: _Liveness, keys: list[Hashable], at: int) -> dict[str, int]:
    """Bytes of `keys` alive at node `at`, by the layer that made them (the sweep's rule: alive
    from the node that makes a storage to its last use, both included)."""
    out: dict[str, int] = {}
    for k in keys:
        if lv.start[k] <= at <= lv.end[k]:
            b = _block(lv.producer[k])
            out[b] = out.get(b, 0) + lv.size[k]
    return out


def _recomputed_by_block(lv: _Liveness, labels: dict[Hashable, str], boundary: int,
                         state: set[fx.Node]) -> dict[str, int]:
    """Per layer, the bytes of the values the backward recomputes (activation checkpointing)
    and reads in its own ops: what the forward would otherwise have kept for it, read off
    this graph (the partition without recomputation is not traced, so it is an estimate of
    what recomputation saves, not a second walk)."""
    seen: set[Hashable] = set()
    out: dict[str, int] = {}
    for n in lv.nodes[boundary + 1:]:
        if n.op != "call_function" or n.meta.get(RECOMPUTED):
            continue
        for a in n.all_input_nodes:
            if not a.meta.get(RECOMPUTED) or a in state:
                continue
            for k, _ in lv.keys(a):
                if k in labels and k not in seen and lv.producer[k].meta.get(RECOMPUTED):
                    seen.add(k)
                    b = _block(lv.producer[k])
                    out[b] = out.get(b, 0) + lv.size[k]
    return out
