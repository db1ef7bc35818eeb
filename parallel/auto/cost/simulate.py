"""Step time of what the runtime runs: a per-device step graph simulated on the cost model.

The runtime executes a plan as ONE graph per rank (forward, loss, backward; runtime/
step_graph.py): plain ATen ops on local shards and functional collectives whose waits sit
where their result is first needed. This module walks such a graph in order with two
clocks, one for compute and one for communication:

  * an op advances the compute clock by its roofline time (local shapes from the graph);
  * a collective starts when issued (or when the link is free) and occupies the link for
    its NCCL-style time on its mesh axis (bucketed collectives are one collective: latency
    once, bytes summed, as they run);
  * its wait advances the compute clock to the collective's end: the communication that
    compute did not hide is the exposed part.

`comm_overlap` (a profile figure, 1 on GPUs with their own copy engines, measured on CPUs
whose cores also drive gloo) is the share of a collective's time that runs beside compute;
the rest also holds the compute clock; the functional all-reduce first clones its input
(torch's out-of-place all_reduce), a memory-bound copy on the compute lane (~5 ms a step of
the debug LLaMA's gradients on 2 CPU ranks). The optimizer step and the gradient-norm all-reduce
are added from the local parameter bytes; a calibrated profile's measured correction
(cost/correction.py) and the host's other work when the job started (cost/contention.py)
multiply the whole. The ILP prices the same schedule with additive
per-edge costs (model.py); this simulation is the step time a plan is predicted to take.

The same walk records the step as a `StepTimeline` (timeline.py, what the plan page draws):
the compute lane holds the ops (consecutive ones of one layer and phase merged into one
event), the cores' share of driving collectives, the exposed waits and the optimizer, so
its events tile [0, step_us]; each mesh axis's lane holds its collectives at the link
clock's times. The backward starts at the loss's tangent (`BACKWARD_SEED`).
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from parallel import _torch as T

from .comm import AxisLink, collective_time
from .compute import roofline_us
from .correction import step_time_ratio
from .timeline import COMPUTE_LANE, StepTimeline, TimelineEvent, scaled

BACKWARD_SEED = "backward_seed"  # node.meta key of the backward's first op (runtime/loss_sync.py sets it)

_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_to_all_single": "all_to_all"}


@dataclass
class StepPrediction:
    """Predicted time of one training step on one rank, and where it goes (µs)."""

    step_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    optimizer_us: float
    comm_cpu_us: float = 0.0  # what the cores spend driving collectives (1 - comm_overlap of their time)
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)  # "kind@axis" -> count, bytes, us
    correction: float = 1.0  # the profile's measured step_time_ratio, already in step_us
    contention: float = 1.0  # the host's other work when the job started (cost/contention.py), already in step_us
    timeline: StepTimeline | None = field(default=None, repr=False)  # the walk in time (the plan page's lanes)

    def summary(self) -> str:
        base = self.step_us / self.correction / self.contention
        corrected = f" x {self.correction:.2f} (this machine's measured correction)" if self.correction != 1.0 else ""
        if self.contention != 1.0:
            corrected += f" x {self.contention:.2f} (other work on the host as the job started)"
        if corrected:
            corrected = f" = {base / 1e3:,.1f} ms{corrected}"
        return (f"predicted step {self.step_us / 1e3:,.1f} ms{corrected} = compute {self.compute_us / 1e3:,.1f} ms "
                f"+ driving collectives {self.comm_cpu_us / 1e3:,.1f} ms "
                f"+ waiting for them {self.exposed_comm_us / 1e3:,.1f} ms "
                f"(of {self.comm_us / 1e3:,.1f} ms communicating) + optimizer {self.optimizer_us / 1e3:,.1f} ms")


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _collective(n: fx.Node, links: Mapping[str, AxisLink]) -> tuple[str, AxisLink, int] | None:
    """(kind, link, nccl-tests bytes) of a functional collective node; None for others."""
    if getattr(n.target, "namespace", "") != "_c10d_functional":
        return None
    kind = _KINDS.get(T.op_name(n.target))
    group = next((a for a in n.args if isinstance(a, str) and a in links), None)
    if kind is None or group is None:
        return None
    out, inp = n.meta.get("val"), n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    size = {"all_gather": _nbytes(out), "reduce_scatter": _nbytes(inp), "all_reduce": _nbytes(inp),
            "all_to_all": _nbytes(inp)}[kind]
    return kind, links[group], size


def _size(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


class _Lanes:
    """The timeline the walk records: compute runs merged per (phase, layer), collectives per axis."""

    def __init__(self, lanes: list[str]):
        self.lanes = lanes
        self.events: list[TimelineEvent] = []
        self.run: list[Any] | None = None  # [phase, layer, start, end, ops, us per op name]

    def op(self, phase: str, layer: str, start: float, us: float, name: str) -> None:
        r = self.run
        if r is None or r[0] != phase or r[1] != layer or r[3] != start:
            self.flush()
            r = self.run = [phase, layer, start, start, 0, defaultdict(float)]
        r[3], r[4] = start + us, r[4] + 1
        r[5][name] += us

    def flush(self) -> None:
        r, self.run = self.run, None
        if r is None:
            return
        phase, layer, start, end, ops, per_op = r
        if end <= start:
            return  # views and other free ops only
        label = f"{layer} {phase}: {ops} op{'s' if ops > 1 else ''}"
        top = max(per_op, key=per_op.__getitem__)
        label += f", top: {top} {100 * per_op[top] / (end - start):.0f} %"
        self.events.append(TimelineEvent(COMPUTE_LANE, start, end, label, phase))

    def add(self, lane: str, start: float, end: float, label: str, phase: str, nbytes: int = 0) -> None:
        if end <= start:
            return
        if lane == COMPUTE_LANE:
            self.flush()
        self.events.append(TimelineEvent(lane, start, end, label, phase, nbytes))


class _Clocks:
    def __init__(self, overlap: float, lanes: _Lanes):
        self.compute = 0.0
        self.link_free: dict[int, float] = defaultdict(float)  # per mesh axis
        self.done: dict[fx.Node, float] = {}
        self.what: dict[fx.Node, str] = {}  # collective -> "kind@axis", for its wait's label
        self.overlap = overlap
        self.comm = self.exposed = self.driving = 0.0
        self.lanes = lanes
        self.phase = "forward"

    def issue(self, n: fx.Node, link: AxisLink, kind: str, size: int, us: float) -> None:
        start = max(self.compute, self.link_free[link.axis])
        self.link_free[link.axis] = self.done[n] = start + us
        self.what[n] = f"{kind}@{link.name}"
        self.lanes.add(link.name, start, start + us, f"{kind} {_size(size)}", self.phase, size)
        self.comm += us
        drive = us * (1.0 - self.overlap)  # what the cores spend driving the collective
        self.lanes.add(COMPUTE_LANE, self.compute, self.compute + drive, f"driving {kind}@{link.name}", self.phase)
        self.compute += drive
        self.driving += drive

    def wait(self, producer: fx.Node) -> None:
        end = self.done.get(producer, 0.0)
        if end > self.compute:
            self.lanes.add(COMPUTE_LANE, self.compute, end, f"waiting for {self.what[producer]}", self.phase)
            self.exposed += end - self.compute
            self.compute = end


def _backward_start(gm: fx.GraphModule) -> fx.Node | None:
    """The loss's tangent: the first op of the backward (the step graph marks it,
    runtime/loss_sync.py; else `ones_like` of a graph output)."""
    seed = next((n for n in gm.graph.nodes if n.meta.get(BACKWARD_SEED)), None)
    if seed is not None:
        return seed
    outs = set(gm.graph.output_node().all_input_nodes)
    return next((n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.ones_like.default)
                 if n.args and n.args[0] in outs), None)


class _Layers:
    """Which layer (or top-level module) an op works for: the last one whose parameters a
    compute op read, directly or through the views, casts and gathers of them. Building a
    gather's bucket (before the collective) is prefetching, not the layer's work: it does
    not switch; unpacking the gathered bucket does."""

    def __init__(self, gm: fx.GraphModule, param_groups: list[str] | None):
        self.of: dict[fx.Node, str] = dict(zip(gm.graph.find_nodes(op="placeholder"), param_groups or []))
        self.gathered: set[fx.Node] = set()
        self.current = "(top level)"

    def see(self, n: fx.Node, compute: bool, collective: bool) -> str:
        ins = n.all_input_nodes
        groups = {self.of.get(i) for i in ins}
        if ins and len(groups) == 1 and None not in groups:
            self.of[n] = next(iter(groups))  # a view, cast or gather of one layer's parameters
            if collective or any(i in self.gathered for i in ins):
                self.gathered.add(n)
        if compute and (n not in self.of or n in self.gathered):
            self.current = next((self.of[i] for i in ins if i in self.of), self.current)
        return self.current


def simulate_step(gm: fx.GraphModule, cost_model: Any, links: Mapping[str, AxisLink], *,
                  optimizer_param_bytes: int = 0, optimizer_tensors: int = 0,
                  param_groups: list[str] | None = None,
                  region_us: Callable[[Any, fx.Node], float | None] | None = None) -> StepPrediction:
    """Predicted time of one step of `gm` (a rank's step graph) on `cost_model`'s hardware,
    with its timeline (`StepPrediction.timeline`).

    `links`: process-group name -> the link of its mesh axis (CostModel.links[axis]).
    `optimizer_param_bytes` / `optimizer_tensors`: this rank's local fp32 parameter bytes
    and parameter count, for the AdamW step and the gradient-norm clipping.
    `param_groups`: the layer or module ("layers.3", "output") of each of the graph's first
    placeholders (the parameters), to name the timeline's compute events.
    `region_us(cost_model, node)`: the price of a call whose inside the op-by-op price cannot
    see (a local_map region: regions.step_region_us), None for any other node.
    """
    hw = cost_model.hw
    axes = sorted({link.axis: link.name for link in links.values()}.items())
    lanes = _Lanes([COMPUTE_LANE] + [name for _, name in axes])
    clocks, layers, backward = _Clocks(getattr(hw, "comm_overlap", 1.0), lanes), _Layers(gm, param_groups), \
        _backward_start(gm)
    compute, per_kind = 0.0, defaultdict(lambda: {"count": 0, "bytes": 0, "us": 0.0})
    for n in gm.graph.nodes:
        if n is backward:
            clocks.phase = "backward"
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        coll = _collective(n, links)
        layer = layers.see(n, coll is None and T.op_name(n.target) != "wait_tensor", coll is not None)
        if coll is not None:
            kind, link, size = coll
            src = n.args[0]
            bucket = getattr(src, "op", "") == "call_function" and len(src.users) == 1
            if T.op_name(n.target) == "all_reduce" and not bucket:
                # the functional all-reduce clones its input first; a fresh buffer nothing else reads
                # (a gradient bucket) the eager runtime reduces in place (runtime/step_graph.py
                # `reduce_buffers_in_place`), so the analysis graph's reduction is priced as that one
                copy = roofline_us(hw, 0.0, 2 * size, None, op_class="elementwise")
                lanes.op(clocks.phase, layer, clocks.compute, copy, "all_reduce input copy")
                clocks.compute, compute = clocks.compute + copy, compute + copy
            us = collective_time(kind, size, link)[0]
            clocks.issue(n, link, kind, size, us)
            row = per_kind[f"{kind}@{link.name}"]
            row["count"], row["bytes"], row["us"] = row["count"] + 1, row["bytes"] + size, row["us"] + us
        elif T.op_name(n.target) == "wait_tensor":
            clocks.wait(n.args[0])
        else:
            us = region_us(cost_model, n) if region_us is not None else None
            us = cost_model.compute_cost(n) if us is None else us
            lanes.op(clocks.phase, layer, clocks.compute, us, T.op_name(n.target))
            clocks.compute += us
            compute += us
    opt = _optimizer_us(cost_model, optimizer_param_bytes, optimizer_tensors)
    ratio, load = step_time_ratio(hw), getattr(hw, "contention", 1.0)
    why = ", ".join(w for w, f in (("measured correction", ratio), ("other work on the host", load)) if f != 1.0)
    timeline = scaled(_finish(lanes, clocks, opt, cost_model), ratio * load, why)
    return StepPrediction(timeline.step_us, compute, clocks.comm, clocks.exposed, opt, clocks.driving,
                          {k: dict(v) for k, v in per_kind.items()}, ratio, load, timeline)


def _finish(lanes: _Lanes, clocks: _Clocks, opt: float, cost_model: Any) -> StepTimeline:
    """The step's end: the last collective waited for, then the optimizer; the phases' spans."""
    lanes.flush()
    end = max(clocks.compute, max(clocks.link_free.values(), default=0.0))
    last = max(((t, clocks.what[n]) for n, t in clocks.done.items()), default=(0.0, ""))[1]
    lanes.add(COMPUTE_LANE, clocks.compute, end, f"waiting for {last} (the step's last collective)", clocks.phase)
    clocks.exposed += end - clocks.compute
    lanes.add(COMPUTE_LANE, end, end + opt, "optimizer: AdamW and gradient-norm clipping", "optimizer")
    step = end + opt
    compute_events = [e for e in lanes.events if e.lane == COMPUTE_LANE]
    phases = []
    for phase in ("forward", "backward"):
        spans = [(e.start_us, e.end_us) for e in compute_events if e.phase == phase]
        if spans:
            phases.append((phase, min(s for s, _ in spans), max(e for _, e in spans)))
    if opt > 0:
        phases.append(("optimizer", end, step))
    name = getattr(cost_model.hw, "name", "")
    return StepTimeline(step, lanes.lanes, lanes.events, phases, f"cost model ({name})" if name else "cost model")


def _optimizer_us(cost_model: Any, param_bytes: int, tensors: int) -> float:
    """AdamW (the job's implementation) and gradient-norm clipping: memory-bound over the local parameters
    (CostModel.optimizer_cost, what the planner charges), a cost per tensor (a calibrated
    profile's measured `optimizer.tensor_us`; else a floor per tensor group), and the norm's
    small all-reduce (latency)."""
    if not tensors:
        return 0.0
    hw = cost_model.hw
    rate = cost_model.optimizer_rate() if hasattr(cost_model, "optimizer_rate") else None
    per_tensor = (tensors * rate[1] if rate is not None
                  else hw.kernel_floor_us * (10 + math.ceil(tensors / 64)))
    return cost_model.optimizer_cost(param_bytes) + per_tensor + hw.intra_node.latency_us
