"""A training step laid out in time, predicted or measured: what the plan page draws.

`StepTimeline` is what the step simulation (simulate.py) walked: one lane for compute and
one per mesh axis for its collectives, each busy interval an event, the forward, backward
and optimizer phases as spans. Its lanes end at the predicted step time, so the picture and
the number a user is told are the same figure.

`MeasuredStep` is what a run observed of the same step after its warm-up (the trainer's
timers, the allocator, and the profiler when the run profiles): the page draws it beside
the prediction so that a user sees where the model is wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field, fields
from typing import Any

COMPUTE_LANE = "compute"
PHASES = ("forward", "backward", "optimizer")


@dataclass
class TimelineEvent:
    """One busy interval on a lane (µs from the step's start)."""

    lane: str  # COMPUTE_LANE or a mesh axis name
    start_us: float
    end_us: float
    label: str  # what ran: ops of a layer, or a collective ("all_reduce 12.5 MiB")
    phase: str  # one of PHASES
    nbytes: int = 0  # a collective's bytes (0 for compute)

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class StepTimeline:
    """A step's lanes and phases, from the simulation that gives its predicted time."""

    step_us: float
    lanes: list[str]
    events: list[TimelineEvent] = field(default_factory=list)
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (phase, start_us, end_us)
    source: str = ""  # what drew it: "cost model (profile name)", "measured (timers)", ...

    def lane_end_us(self, lane: str) -> float:
        """When the lane's last event ends (the compute lane's end is the step time)."""
        return max((e.end_us for e in self.events if e.lane == lane), default=0.0)

    def to_json(self) -> dict:
        d = asdict(self)
        d["phases"] = [list(p) for p in self.phases]
        return d

    @classmethod
    def from_json(cls, d: Any, source: str = "the timeline") -> StepTimeline:
        """Read a saved timeline back; anything damaged is one ValueError naming `source` and
        what is wrong (a page never draws half a timeline)."""
        if not isinstance(d, dict) or not {"step_us", "lanes", "events"} <= set(d) or set(d) - _KEYS:
            raise ValueError(f"{source}: not a step timeline ({str(d)[:120]})")
        if not _number(d["step_us"]) or not isinstance(d["lanes"], list) or \
                not all(isinstance(lane, str) for lane in d["lanes"]):
            raise ValueError(f"{source}: 'step_us' must be a number and 'lanes' a list of names")
        if not isinstance(d["events"], list):
            raise ValueError(f"{source}: 'events' must be a list")
        events = [_event(e, i, d["lanes"], source) for i, e in enumerate(d["events"])]
        phases = d.get("phases", [])
        if not isinstance(phases, list) or not all(
                isinstance(p, list) and len(p) == 3 and p[0] in PHASES and _number(p[1]) and _number(p[2])
                for p in phases):
            raise ValueError(f"{source}: 'phases' must be [phase, start_us, end_us] entries ({str(phases)[:120]})")
        return cls(d["step_us"], list(d["lanes"]), events, [tuple(p) for p in phases],  # type: ignore[misc]
                   str(d.get("source", "")))


_KEYS = {f.name for f in fields(StepTimeline)}
_EVENT_KEYS = {f.name for f in fields(TimelineEvent)}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _event(e: Any, i: int, lanes: list[str], source: str) -> TimelineEvent:
    """One saved event, checked: its fields, numbers where times are, a lane the timeline has."""
    ok = (isinstance(e, dict) and {"lane", "start_us", "end_us", "label", "phase"} <= set(e) <= _EVENT_KEYS
          and e["lane"] in lanes and _number(e["start_us"]) and _number(e["end_us"])
          and isinstance(e["label"], str) and e["phase"] in PHASES and _number(e.get("nbytes", 0)))
    if not ok:
        raise ValueError(f"{source}: event {i} is not a timeline event ({str(e)[:120]})")
    return TimelineEvent(**e)


def scaled(timeline: StepTimeline, ratio: float, why: str = "measured correction") -> StepTimeline:
    """`timeline` with every time multiplied by `ratio` (a profile's measured correction of the
    whole step, the host's other work), so that its lanes still end at the prediction."""
    if ratio == 1.0:
        return timeline
    events = [dataclasses.replace(e, start_us=e.start_us * ratio, end_us=e.end_us * ratio) for e in timeline.events]
    phases = [(p, a * ratio, b * ratio) for p, a, b in timeline.phases]
    return dataclasses.replace(timeline, step_us=timeline.step_us * ratio, events=events, phases=phases,
                               source=f"{timeline.source}, x {ratio:.2f} {why}")


@dataclass
class MeasuredStep:
    """What a run measured of one step after its warm-up (rank-averaged medians)."""

    step_us: float
    steps: int  # how many steps the median is of
    peak_bytes: int | None = None  # the allocator's peak (None: no allocator statistics)
    compute_us: float | None = None  # where the profiler or timers split the step
    comm_us: float | None = None
    source: str = "timers"  # "timers", "profiler"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any, source: str = "the measured step") -> MeasuredStep:
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or "step_us" not in d or set(d) - names:
            raise ValueError(f"{source}: not a measured step ({str(d)[:120]})")
        return cls(**d)


__all__ = ["COMPUTE_LANE", "PHASES", "MeasuredStep", "StepTimeline", "TimelineEvent", "scaled"]
