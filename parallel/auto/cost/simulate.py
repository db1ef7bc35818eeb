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
the rest also holds the compute clock. The optimizer step and the gradient-norm all-reduce
are added from the local parameter bytes; a calibrated profile's measured correction
(cost/correction.py) multiplies the whole. The ILP prices the same schedule with additive
per-edge costs (model.py); this simulation is the step time a plan is predicted to take.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from parallel import _torch as T

from .comm import AxisLink, collective_time
from .correction import step_time_ratio

_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


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

    def summary(self) -> str:
        corrected = (f" x {self.correction:.2f} (this machine's measured correction of "
                     f"{self.step_us / self.correction / 1e3:,.1f} ms)" if self.correction != 1.0 else "")
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


class _Clocks:
    def __init__(self, overlap: float):
        self.compute = 0.0
        self.link_free: dict[int, float] = defaultdict(float)  # per mesh axis
        self.done: dict[fx.Node, float] = {}
        self.overlap = overlap
        self.comm = self.exposed = self.driving = 0.0

    def issue(self, n: fx.Node, axis: int, us: float) -> None:
        start = max(self.compute, self.link_free[axis])
        self.link_free[axis] = self.done[n] = start + us
        self.comm += us
        self.compute += us * (1.0 - self.overlap)  # what the cores spend driving the collective
        self.driving += us * (1.0 - self.overlap)

    def wait(self, producer: fx.Node) -> None:
        end = self.done.get(producer, 0.0)
        if end > self.compute:
            self.exposed += end - self.compute
            self.compute = end


def simulate_step(gm: fx.GraphModule, cost_model: Any, links: Mapping[str, AxisLink], *,
                  optimizer_param_bytes: int = 0, optimizer_tensors: int = 0) -> StepPrediction:
    """Predicted time of one step of `gm` (a rank's step graph) on `cost_model`'s hardware.

    `links`: process-group name -> the link of its mesh axis (CostModel.links[axis]).
    `optimizer_param_bytes` / `optimizer_tensors`: this rank's local fp32 parameter bytes
    and parameter count, for the AdamW step and the gradient-norm clipping.
    """
    hw = cost_model.hw
    clocks = _Clocks(getattr(hw, "comm_overlap", 1.0))
    compute, per_kind = 0.0, defaultdict(lambda: {"count": 0, "bytes": 0, "us": 0.0})
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        coll = _collective(n, links)
        if coll is not None:
            kind, link, size = coll
            us = collective_time(kind, size, link)[0]
            clocks.issue(n, link.axis, us)
            row = per_kind[f"{kind}@{link.name}"]
            row["count"], row["bytes"], row["us"] = row["count"] + 1, row["bytes"] + size, row["us"] + us
        elif T.op_name(n.target) == "wait_tensor":
            clocks.wait(n.args[0])
        else:
            us = cost_model.compute_cost(n)
            clocks.compute += us
            compute += us
    opt = _optimizer_us(cost_model, optimizer_param_bytes, optimizer_tensors)
    ratio = step_time_ratio(hw)
    step = (max(clocks.compute, max(clocks.link_free.values(), default=0.0)) + opt) * ratio
    return StepPrediction(step, compute, clocks.comm, clocks.exposed, opt, clocks.driving,
                          {k: dict(v) for k, v in per_kind.items()}, ratio)


def _optimizer_us(cost_model: Any, param_bytes: int, tensors: int) -> float:
    """AdamW (foreach) and gradient-norm clipping: memory-bound over the local parameters
    (CostModel.optimizer_cost, what the planner charges), a cost per tensor (a calibrated
    profile's measured `optimizer.tensor_us`; else a floor per tensor group), and the norm's
    small all-reduce (latency)."""
    if not tensors:
        return 0.0
    hw = cost_model.hw
    per_tensor = (tensors * hw.optimizer["tensor_us"] if hw.optimizer
                  else hw.kernel_floor_us * (10 + math.ceil(tensors / 64)))
    return cost_model.optimizer_cost(param_bytes) + per_tensor + hw.intra_node.latency_us
