"""A pipeline's plan: the stages (their blocks, the pp rank that runs each, each stage's own
SPMD plan on the stage's submesh), the schedule, and the step the cost model predicts for them.

Pricing (one optimizer step of ``n`` microbatches; ``v`` stages per pp rank):

- a stage's time is its plan's ``objective_us``: one microbatch's forward and backward on
  the submesh with its collectives (the runtime reduces a stage's gradients at each
  microbatch's backward, as priced);
- a pp rank's time per microbatch is the sum over its stages, each with the point-to-point
  sends of its boundaries (a hidden state forward, its gradient backward: ``p2p_us`` each);
- the step is ``n`` times the slowest rank, plus the fill and drain: with one stage per rank
  the other stages' slots (the step of GPipe exactly, as the schedule simulated on the plan
  page shows; an upper bound for 1F1B, which overlaps some of them); with ``v`` looped stages
  per rank (Interleaved1F1B) ``pp - 1`` slots of the slowest stage, ``v``-fold less than one
  stage a rank. The zero-bubble schedules are priced as their 1F1B counterparts, an upper bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from parallel.recipes.pp import fill_and_drain_us, in_flight

from .data import Plan, PlanMismatchError, write_json

__all__ = ["PipelinePlan", "StagePlan"]

PIPELINE_FORMAT = 1


@dataclass
class StagePlan:
    """One stage: its index, its blocks, the pp rank that runs it, its plan."""

    index: int
    layers: tuple[int, ...]
    rank: int
    plan: Plan

    @property
    def step_us(self) -> float:
        """One microbatch's forward + backward on the stage's submesh (its plan's objective)."""
        return self.plan.objective_us

    def peak_bytes(self, in_flight: int) -> float | None:
        """The stage's predicted peak per device with ``in_flight`` microbatches' activations
        held (None: not estimated): its plan's peak (made for ``microbatches_held`` of them),
        plus or minus the activations each microbatch keeps for its backward (``saved_bytes``)."""
        m = self.plan.memory
        return None if m is None else float(m.peak_bytes + (in_flight - m.microbatches_held) * m.saved_bytes)

    def describe(self, n_stages: int) -> str:
        parts = (["embedding"] if self.index == 0 else []) + (
            [f"layers.{self.layers[0]}" + (f"-{self.layers[-1]}" if len(self.layers) > 1 else "")]
            if self.layers else []) + (
            ["norm", "output"] if self.index == n_stages - 1 else [])
        return ", ".join(parts)


@dataclass
class PipelinePlan:
    """The stages of a pipeline and the schedule that runs them (see the module doc)."""

    schedule: str
    pp: int
    n_microbatches: int
    stages: list[StagePlan]
    p2p_us: float = 0.0  # one boundary's send of a microbatch's hidden state (or its gradient)
    notes: list[str] = field(default_factory=list)

    @property
    def stages_per_rank(self) -> int:
        return max(1, len(self.stages) // self.pp)

    def stage_slot_us(self, stage: StagePlan) -> float:
        """One microbatch through ``stage``: its plan's time and its boundaries' sends."""
        return stage.step_us + ((stage.index > 0) + (stage.index < len(self.stages) - 1)) * self.p2p_us

    def rank_us(self, rank: int) -> float:
        """pp rank ``rank``'s time per microbatch: its stages' slots."""
        return sum(self.stage_slot_us(s) for s in self.stages if s.rank == rank)

    @property
    def bubble_us(self) -> float:
        """The schedule's fill and drain (stages.pipeline_step_us)."""
        return fill_and_drain_us([self.stage_slot_us(s) for s in self.stages], self.pp)

    @property
    def step_us(self) -> float:
        """The predicted optimizer step (forward and backward of every microbatch, bubble included)."""
        return self.n_microbatches * max(self.rank_us(r) for r in range(self.pp)) + self.bubble_us

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations ``stage`` holds at once under the schedule."""
        return in_flight(self.schedule, self.n_microbatches, len(self.stages), stage)

    def summary(self) -> str:
        """The schedule, then one line per stage: blocks, rank, predicted time and peak."""
        n = len(self.stages)
        lines = [f"pipeline: {self.schedule}, {n} stages on pp = {self.pp} ({self.stages_per_rank} per rank), "
                 f"{self.n_microbatches} microbatches; predicted step {self.step_us / 1e3:,.2f} ms "
                 f"(bubble {self.bubble_us / 1e3:,.2f} ms; p2p {self.p2p_us:,.1f} µs a boundary)"]
        for s in self.stages:
            k = self.in_flight(s.index)
            peak = "" if s.peak_bytes(k) is None else \
                f", peak {s.peak_bytes(k) / 2**30:,.3f} GiB a device with {k} in flight"
            lines.append(f"  stage {s.index} on pp rank {s.rank}: {s.describe(n)}; {s.step_us / 1e3:,.2f} ms a "
                         f"microbatch{peak}")
        lines += [f"  note: {x}" for x in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"pipeline_format": PIPELINE_FORMAT, "schedule": self.schedule, "pp": self.pp,
                "n_microbatches": self.n_microbatches, "p2p_us": self.p2p_us, "notes": list(self.notes),
                "predicted_step_us": self.step_us,
                "stages": [{"index": s.index, "layers": list(s.layers), "rank": s.rank, "step_us": s.step_us,
                            "plan": s.plan.to_json()} for s in self.stages]}

    @classmethod
    def from_json(cls, d: dict, source: str = "the pipeline plan") -> PipelinePlan:
        if not isinstance(d, dict) or d.get("pipeline_format") != PIPELINE_FORMAT:
            raise PlanMismatchError(f"{source} is not a pipeline's plan (pipeline_plan.json, format "
                                    f"{PIPELINE_FORMAT}); a pipeline job replays the pipeline_plan.json it wrote")
        try:
            stages = [StagePlan(s["index"], tuple(s["layers"]), s["rank"],
                                Plan.from_json(s["plan"], f"{source}, stage {s['index']}")) for s in d["stages"]]
            return cls(d["schedule"], d["pp"], d["n_microbatches"], stages, d.get("p2p_us", 0.0),
                       list(d.get("notes", [])))
        except (KeyError, TypeError) as e:
            raise PlanMismatchError(f"{source} is not a complete pipeline plan ({type(e).__name__}: {e}); "
                                    "re-plan") from None

    def check_layout(self, schedule: str, pp: int, n_microbatches: int, n_stages: int, source: str) -> None:
        """PlanMismatchError unless this plan was made for that schedule, degree, microbatch count
        and number of stages."""
        want = (schedule, pp, n_microbatches, n_stages)
        have = (self.schedule, self.pp, self.n_microbatches, len(self.stages))
        if want != have:
            raise PlanMismatchError(f"{source} was made for schedule {have[0]}, pp {have[1]}, {have[2]} microbatches, "
                                    f"{have[3]} stages; this job runs {want[0]}, pp {want[1]}, {want[2]} "
                                    f"microbatches, {want[3]} stages: re-plan (unset parallelism.plan_file)")

    def save(self, path: str) -> None:
        """Write the pipeline plan as JSON (never half-written: `write_json`)."""
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> PipelinePlan:
        """The pipeline plan in ``path``; PlanMismatchError when it is missing, not JSON or not one."""
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanMismatchError(f"cannot read {path} ({type(e).__name__}: {e})") from None
        return cls.from_json(d, path)
