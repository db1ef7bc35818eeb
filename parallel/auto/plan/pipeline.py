"""A pipeline's plan: the stages (their blocks, the pp rank that runs each, each stage's own
SPMD plan on the stage's submesh), the schedule, and the step the cost model predicts for them.

Pricing (one optimizer step of ``n`` microbatches; ``v`` stages per pp rank):

- a stage's time is its plan's ``objective_us``: one microbatch's forward and backward on
  the submesh with its collectives (the runtime reduces a stage's gradients at each
  microbatch's backward, as priced);
- a pp rank's time per microbatch is the sum over its stages, plus the point-to-point sends
  of its boundaries (a hidden state forward, its gradient backward: ``p2p_us`` each);
- the schedule runs the slowest rank ``n + (pp - 1) / v`` times: ``n`` microbatches and the
  fill-and-drain bubble of ``pp - 1`` stage slots, which ``v`` looped stages per rank shorten
  by ``v`` (Interleaved1F1B; the zero-bubble schedules are priced as their 1F1B counterparts,
  an upper bound).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .data import Plan

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
        held (None: not estimated): its plan's peak for one, plus the activations each further
        one keeps for its backward (``saved_bytes``)."""
        m = self.plan.memory
        return None if m is None else float(m.peak_bytes + (in_flight - 1) * m.saved_bytes)

    def describe(self, n_stages: int) -> str:
        parts = (["embedding"] if self.index == 0 else []) + (
            [f"layers.{self.layers[0]}-{self.layers[-1]}"] if self.layers else []) + (
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

    def rank_us(self, rank: int) -> float:
        """pp rank ``rank``'s time per microbatch: its stages, and the sends of their boundaries."""
        mine = [s for s in self.stages if s.rank == rank]
        sends = sum((s.index > 0) + (s.index < len(self.stages) - 1) for s in mine)
        return sum(s.step_us for s in mine) + sends * self.p2p_us

    @property
    def bubble_slots(self) -> float:
        """Microbatch slots the slowest rank waits in the fill and drain of the schedule."""
        return (self.pp - 1) / self.stages_per_rank

    @property
    def step_us(self) -> float:
        """The predicted optimizer step (forward and backward of every microbatch, bubble included)."""
        slowest = max(self.rank_us(r) for r in range(self.pp))
        return (self.n_microbatches + self.bubble_slots) * slowest

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations ``stage`` holds at once under the schedule."""
        if self.schedule in ("GPipe", "LoopedBFS"):
            return self.n_microbatches
        return min(self.n_microbatches, len(self.stages) - stage)

    def summary(self) -> str:
        """The schedule, then one line per stage: blocks, rank, predicted time and peak."""
        n = len(self.stages)
        lines = [f"pipeline: {self.schedule}, {n} stages on pp = {self.pp} ({self.stages_per_rank} per rank), "
                 f"{self.n_microbatches} microbatches; predicted step {self.step_us / 1e3:,.1f} ms "
                 f"(bubble {self.bubble_slots:.2f} of {self.n_microbatches + self.bubble_slots:.2f} microbatch "
                 f"slots; p2p {self.p2p_us:,.1f} µs a boundary)"]
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
            raise ValueError(f"{source} is not a pipeline plan of format {PIPELINE_FORMAT}")
        stages = [StagePlan(s["index"], tuple(s["layers"]), s["rank"], Plan.from_json(s["plan"], source))
                  for s in d["stages"]]
        return cls(d["schedule"], d["pp"], d["n_microbatches"], stages, d.get("p2p_us", 0.0), list(d.get("notes", [])))

    def save(self, path: str) -> None:
        """Write the pipeline plan as JSON (``path.tmp``, then renamed: never half-written)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> PipelinePlan:
        with open(path) as f:
            return cls.from_json(json.load(f), path)
