"""The Plan as data: one chosen strategy per node, the objective and its breakdown, and the
identity of what it was made for; saved as JSON, loaded and checked against a model/mesh.

A Plan is what the user inspects, saves and replays: chosen placements per node
(inputs -> outputs), the objective with its breakdown (compute; communication per
collective kind and mesh axis), solver and timings, plus the identity of what it was
made for (model fingerprint, input shapes, mesh, hardware, torch version) so that a
replay on a different model or mesh is refused with a clear message. Each node carries
its role (parameter FQN, gradient of a parameter, input index, ...) as data (trace.NodeRole).

Its reports (summary, breakdown, diff) are in report.py; what needs the solved problem
(explain, costs per candidate, the collectives one by one) in costs.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.auto.cost.memory import MemoryEstimate
from parallel.auto.cost.timeline import StepTimeline
from parallel.auto.plan import report
from parallel.auto.plan.costs import PlanCosts
from parallel.auto.trace.joint import BUFFER, GRAD_PARAM, INPUT, PARAM, NodeRole

FORMAT_VERSION = 1


def write_json(path: str, data: Any) -> None:
    """`data` as JSON to `path.tmp`, then renamed: a reader never sees a half-written file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


class PlanMismatchError(ValueError):
    """A saved plan was made for a different model, inputs or mesh."""


def _timeline(d: Any, source: str) -> StepTimeline | None:
    """A saved plan's simulated step (None: saved without one); damaged, it is the file's error."""
    if d is None:
        return None
    try:
        return StepTimeline.from_json(d, source="'timeline'")
    except ValueError as e:
        raise PlanMismatchError(f"{source}: the saved step simulation is damaged ({e}); re-plan, or delete "
                                "its 'timeline' key (the page then draws no timeline)") from None


@dataclass
class NodePlan:
    """Chosen strategy of one node, in words that survive JSON."""

    name: str
    kind: str  # placeholder | op | getitem | slot
    target: str  # op name, or the placeholder / output label
    label: str  # "param layers.0.attention.wq.weight", "grad of param ...", "" (for display)
    phase: str  # fwd | bwd
    module: str  # innermost module FQN ("" = top level)
    strategy: int  # index into the node's candidate list
    inputs: list[str]  # input node names, aligned with input_placements
    input_placements: list[str]
    output_placements: list[str]  # one entry per output (tuple outputs have several)
    compute_us: float = 0.0
    role: NodeRole | None = None  # what the node is (placeholders, constants, output slots); None: an op

    def to_json(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        d["role"] = self.role.to_json() if self.role is not None else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> NodePlan:
        d = dict(d)
        if "role" in d:
            role = NodeRole.from_json(d.pop("role"))
        else:  # plans saved before roles were recorded: the role the label was made from
            role = NodeRole.from_label(d.get("label", ""))
        return cls(**d, role=role)


@dataclass
class Plan:
    """A solved placement plan."""

    nodes: dict[str, NodePlan]
    objective_us: float
    compute_us: float
    comm_us: dict[str, float]  # "kind@axis_name" -> µs
    comm_bytes: dict[str, float]
    solver: str
    status: str
    timings: dict[str, float]  # trace / candidates / build / solve seconds
    num_vars: int
    fingerprint: str
    input_shapes: list
    mesh_shape: list[int]
    mesh_axis_names: list[str]
    hardware: str
    torch_version: str
    mp_param_dtype: str | None = None
    memory_fraction: float = 0.0  # parameter bytes per device / total parameter bytes
    total_param_bytes: float = 0.0  # all parameter bytes (0: not recorded, plans saved before)
    memory_budget: list = field(default_factory=list)  # [low, high]
    constraints: list[str] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)  # local_map regions of the traced graph (regions/)
    memory: MemoryEstimate | None = None  # peak bytes per device (cost/memory.py); None: not estimated
    # the part of comm_us that brings gradients to their parameters' placements (reductions):
    # paid once per optimizer step, however many micro-batches (0: not recorded, plans saved before)
    grad_reduction_us: float = 0.0
    # the recomputation the solve chose ([activation_checkpoint] mode = "auto"): "blocks" (one
    # setting per transformer block: none / op / full), "summary", "recompute_us",
    # "activation_bytes"; empty when the job fixed its AC setting (plans saved before: empty)
    recompute: dict = field(default_factory=dict)
    # the planner's resharding choice ([parallelism] reshard_after_forward = "auto"): True, the
    # backward gathers the parameters again; False, it keeps the forward's copies (resharding.py);
    # None: the job fixed the setting (plans saved before: None)
    reshard_after_forward: bool | None = None
    # the free plan checked against the DDP plan by the step simulation (parallel/auto/selection.py):
    # which was kept and the two simulated steps; "" when no check was made
    selection: str = ""
    # in-memory only (not saved): the solved problem, for explain / costs_for_node / collectives
    costs: PlanCosts | None = field(default=None, repr=False, compare=False)
    # the step simulated on the memory estimate's step graph (the plan page's lanes); saved with the plan
    # (plans saved before it have none: their page says why); not compared (it is derived from the rest)
    timeline: StepTimeline | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ lookup
    def _resolve(self, node: Any) -> str:
        if isinstance(node, torch.fx.Node):
            return node.name
        if node in self.nodes:
            return node
        for n in self.nodes.values():
            r = n.role
            if (r is not None and r.kind in (PARAM, BUFFER, INPUT) and str(r.of) == str(node)) or n.label == node:
                return n.name
        raise KeyError(f"no node or parameter named {node!r} in the plan")

    def node(self, node: Any) -> NodePlan:
        return self.nodes[self._resolve(node)]

    def placement(self, node: Any) -> str:
        """Output placement of a node or parameter (by FQN), e.g. '(S(0), S(1))'."""
        return self.node(node).output_placements[0]

    def params(self) -> dict[str, NodePlan]:
        """Parameter FQN -> its placeholder's NodePlan."""
        return {n.role.of: n for n in self.nodes.values() if n.role is not None and n.role.kind == PARAM}

    def grad_slots(self) -> dict[str, NodePlan]:
        """Parameter FQN -> the output slot of its gradient."""
        return {n.role.of: n for n in self.nodes.values() if n.role is not None and n.role.kind == GRAD_PARAM}

    def param_placements(self) -> dict[str, str]:
        return {fqn: n.output_placements[0] for fqn, n in self.params().items()}

    def placement_digest(self) -> str:
        """A short hash of every node's input and output placements alone: two plans with the
        same digest run alike, whatever objective, solver, constraints or profile made them
        (so a benchmark can tell a distinct plan from the same one solved twice)."""
        d = sorted((n.name, n.input_placements, n.output_placements) for n in self.nodes.values())
        return hashlib.sha256(json.dumps(d).encode()).hexdigest()[:16]

    def grad_placement(self, fqn: str) -> str:
        slot = self.grad_slots().get(fqn)
        if slot is None:
            raise KeyError(f"no gradient output for parameter {fqn!r}")
        return slot.output_placements[0]

    # ------------------------------------------------------------------ reports (report.py, costs.py)
    def step_time_us(self, micro_batches: int = 1) -> float:
        """Predicted optimizer step: the step graph once per micro-batch, the gradient
        reductions once (micro-batches before the last run without them)."""
        return self.objective_us * micro_batches - self.grad_reduction_us * (micro_batches - 1)

    def breakdown(self) -> str:
        return report.breakdown(self)

    def summary(self) -> str:
        """Per-layer table: what each projection does on each mesh axis, in words."""
        return report.summary(self)

    def diff(self, other: Plan) -> report.PlanDiff:
        return report.diff(self, other)

    def collectives(self) -> list[dict]:
        """Every redistribution the plan implies (needs the in-memory plan)."""
        return self._need_costs("collectives").collectives(self)

    def costs_for_node(self, node: Any) -> list[dict]:
        """Every candidate of a node: compute and redistribution µs given the neighbours' choices."""
        return self._need_costs("costs_for_node").costs_for_node(self, self._resolve(node))

    def explain(self, node: Any, top: int = 5) -> str:
        """Why this strategy: its cost vs the best alternatives, all else fixed."""
        return self._need_costs("explain").explain(self, self._resolve(node), top)

    def _need_costs(self, what: str) -> PlanCosts:
        if self.costs is None:
            raise RuntimeError(f"Plan.{what} needs the in-memory plan from optimize_placement "
                               "(a loaded plan has no costs)")
        return self.costs

    def __str__(self) -> str:
        return self.summary()

    # ------------------------------------------------------------------ save / load
    def to_json(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
             if f.name not in ("costs", "timeline", "nodes", "memory")}
        d["memory"] = self.memory.to_json() if self.memory is not None else None
        if self.timeline is not None:  # optional: a plan without a simulation has no key
            d["timeline"] = self.timeline.to_json()
        d["format_version"] = FORMAT_VERSION
        d["nodes"] = [n.to_json() for n in self.nodes.values()]
        return d

    def save(self, path: str) -> None:
        """Write the plan as JSON (never half-written: `write_json`)."""
        write_json(path, self.to_json())

    @classmethod
    def from_json(cls, d: dict, source: str = "the plan") -> Plan:
        if not isinstance(d, dict):
            raise PlanMismatchError(f"{source} is not a plan (a JSON object was expected); re-plan")
        d = dict(d)
        if "pipeline_format" in d:
            raise PlanMismatchError(f"{source} is a pipeline's plan (its stages' plans, pipeline_parallel_degree = "
                                    f"{d.get('pp')}): use it with that pipeline job, or one stage's plan file "
                                    "(plan.stage<i>.json)")
        if d.pop("format_version", None) != FORMAT_VERSION:
            raise PlanMismatchError(f"{source}: plan file format is not version {FORMAT_VERSION}; re-plan")
        timeline = _timeline(d.pop("timeline", None), source)
        try:
            nodes = {n["name"]: NodePlan.from_json(n) for n in d.pop("nodes")}
            memory = d.pop("memory", None)  # plans written before the estimate have none
            return cls(nodes=nodes, memory=MemoryEstimate.from_json(memory, source) if memory else None,
                       timeline=timeline, **d)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanMismatchError(f"{source} is not a complete plan ({type(e).__name__}: {e}); re-plan") from None

    @classmethod
    def load(cls, path: str, *, model: nn.Module | None = None, mesh: DeviceMesh | None = None,
             input_shapes: list | None = None) -> Plan:
        """Load a plan; refuse it (PlanMismatchError) if unreadable or made for another model, inputs or mesh."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise PlanMismatchError(f"cannot read the plan file {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanMismatchError(f"{path} is not a plan file (invalid JSON: {e}); "
                                    "point plan_file at a plan.json written by the planner, or re-plan") from None
        plan = cls.from_json(data, source=path)
        plan.check_compatible(model=model, mesh=mesh, input_shapes=input_shapes, source=path)
        return plan

    def check_compatible(self, *, model: nn.Module | None = None, mesh: DeviceMesh | None = None,
                         input_shapes: list | None = None, source: str = "plan") -> None:
        if model is not None:
            from parallel.auto.trace.joint import model_fingerprint

            fp = model_fingerprint(model)
            if fp != self.fingerprint:
                raise PlanMismatchError(
                    f"{source} was made for a different model (fingerprint {self.fingerprint}, this model "
                    f"{fp}: class or parameter names/shapes/dtypes differ); re-plan for this model"
                )
        if mesh is not None:
            shape = list(mesh.shape)
            names = list(mesh.mesh_dim_names or [])
            if shape != list(self.mesh_shape) or (names and names != list(self.mesh_axis_names)):
                raise PlanMismatchError(
                    f"{source} was made for mesh {tuple(self.mesh_shape)} {tuple(self.mesh_axis_names)}, "
                    f"not {tuple(shape)} {tuple(names)}; re-plan for this mesh"
                )
        if input_shapes is not None and [list(map(list, x)) if isinstance(x, tuple) else x for x in input_shapes] != [
            list(map(list, x)) if isinstance(x, tuple) else x for x in self.input_shapes
        ]:
            raise PlanMismatchError(f"{source} was made for inputs {self.input_shapes}, not {input_shapes}; re-plan "
                                    "for this shape (or price its placements here: AutoParallel.replay_placement)")
