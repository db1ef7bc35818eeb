"""The step as a timeline: one lane for compute and one per mesh axis for its collectives.

Drawn from the `StepTimeline` of the simulation that gives the predicted step time
(cost/simulate.py), so the compute lane's events tile [0, step] and the picture adds up to
the number the page states. A collective is drawn on its axis's lane under the compute it
runs beside: where compute goes on above it, the collective is hidden; where the compute
lane says "waiting for", it is exposed. The forward, backward and optimizer phases are a
band above the lanes. Every rectangle has a hover title (what ran, bytes, µs) and `data-*`
attributes with its numbers (the browser test sums them); runs of events too short to see
(under two pixels) are one rectangle whose title lists the longest of them.

A `MeasuredStep` adds a "measured" lane set under the prediction on the same time axis: the
measured step as one bar, split into compute and communication where the run knew them, and
the predicted step's end as a dashed line through both, so the gap is visible.
"""

from __future__ import annotations

import math

from parallel.auto.cost.timeline import COMPUTE_LANE, MeasuredStep, StepTimeline, TimelineEvent

from .svg import esc, line, rect, svg, text

WIDTH, LEFT, RIGHT = 1000.0, 110.0, 20.0
LANE_H, GAP, BAND_H = 22.0, 6.0, 16.0
PHASE_FILL = {"forward": "#4c78a8", "backward": "#f58518", "optimizer": "#54a24b"}
WAIT_FILL, DRIVE_FILL = "#e45756", "#b279a2"
KIND_FILL = {"all_gather": "#72b7b2", "reduce_scatter": "#eeca3b", "all_reduce": "#ff9da6", "all_to_all": "#9d755d"}
MEASURED_FILL = {"step": "#888888", "compute": "#4c78a8", "comm": "#e45756", "other": "#bbbbbb"}
_STYLE = "<style>rect.event,rect.measured{stroke:#fff;stroke-width:.5}</style>"


def fmt_us(us: float) -> str:
    """µs below a millisecond, ms above (what a reader of a step compares)."""
    return f"{us:,.1f} µs" if abs(us) < 1000 else f"{us / 1e3:,.2f} ms"


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _ticks(t_max: float) -> list[float]:
    """About six round times (1, 2 or 5 x 10^k µs) from 0 to t_max."""
    if t_max <= 0:
        return [0.0]
    raw = t_max / 6
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [i * step for i in range(int(t_max / step) + 1)]


def _fill(e: TimelineEvent) -> str:
    if e.lane != COMPUTE_LANE:
        return KIND_FILL.get(e.label.split(" ")[0], "#999999")
    if e.label.startswith("waiting"):
        return WAIT_FILL
    if e.label.startswith("driving"):
        return DRIVE_FILL
    return PHASE_FILL.get(e.phase, "#999999")


def _title(e: TimelineEvent) -> str:
    size = f", {_size(e.nbytes)}" if e.nbytes else ""
    where = "compute" if e.lane == COMPUTE_LANE else f"mesh axis {e.lane}"
    return (f"{e.label} ({where}, {e.phase}{size}): {fmt_us(e.us)}, "
            f"{fmt_us(e.start_us)} → {fmt_us(e.end_us)}")


class _Axis:
    """Time (µs) to x (px) on the plot, shared by every lane and by the measured lane set."""

    def __init__(self, t_max: float, width: float = WIDTH):
        self.t_max, self.width = max(t_max, 1e-9), width
        self.scale = (width - LEFT - RIGHT) / self.t_max

    def x(self, us: float) -> float:
        return LEFT + us * self.scale

    def ticks(self, y_top: float, y_bottom: float) -> list[str]:
        out = []
        for t in _ticks(self.t_max):
            out.append(line(self.x(t), y_top, self.x(t), y_bottom, stroke="#ddd"))
            label = f"{t / 1e3:g} ms" if self.t_max >= 2000 else f"{t:g} µs"
            out.append(text(self.x(t), y_bottom + 12, label, anchor="middle", fill="#666", size=10))
        return out


def _groups(events: list[TimelineEvent], min_us: float) -> list[list[TimelineEvent]]:
    """Runs of events narrower than `min_us` (a couple of pixels) drawn as one rectangle each,
    until the run is that wide; a 32-layer step has thousands of short waits and collectives."""
    out: list[list[TimelineEvent]] = []
    for e in sorted(events, key=lambda e: e.start_us):
        last = out[-1] if out else None
        if (last is not None and e.us < min_us and last[-1].us < min_us and e.start_us - last[-1].end_us < min_us / 4
                and last[-1].end_us - last[0].start_us < min_us):
            last.append(e)
        else:
            out.append([e])
    return out


def _group_rect(axis: _Axis, y: float, group: list[TimelineEvent]) -> str:
    first, end = group[0], group[-1].end_us
    us, nbytes = sum(e.us for e in group), sum(e.nbytes for e in group)
    if len(group) == 1:
        title = _title(first)
    else:
        top = sorted(group, key=lambda e: -e.us)[:4]
        title = (f"{len(group)} events, {fmt_us(us)} busy, {fmt_us(first.start_us)} → {fmt_us(end)}"
                 + (f", {_size(nbytes)}" if nbytes else "") + ": "
                 + "; ".join(f"{e.label} {fmt_us(e.us)}" for e in top) + ("; …" if len(group) > 4 else ""))
    by_fill: dict[str, float] = {}
    for e in group:
        by_fill[_fill(e)] = by_fill.get(_fill(e), 0.0) + e.us
    data = {"lane": first.lane, "start-us": f"{first.start_us:.3f}", "us": f"{us:.3f}", "phase": first.phase}
    if first.lane != COMPUTE_LANE:
        data["bytes"] = nbytes
    if len(group) > 1:
        data["events"] = len(group)
    return rect(axis.x(first.start_us), y, (end - first.start_us) * axis.scale, LANE_H,
                max(by_fill, key=by_fill.__getitem__), cls="event", title=title, data=data)


def _lane(axis: _Axis, y: float, name: str, events: list[TimelineEvent]) -> list[str]:
    out = [rect(LEFT, y, axis.width - LEFT - RIGHT, LANE_H, "#f6f6f6", cls="lane", data={"lane": name}),
           text(LEFT - 6, y + LANE_H / 2 + 4, name if name == COMPUTE_LANE else f"{name} (comm)", anchor="end")]
    for group in _groups(events, 2.0 / axis.scale):
        out.append(_group_rect(axis, y, group))
        e, w = group[0], group[-1].end_us * axis.scale - group[0].start_us * axis.scale
        if len(group) == 1 and w > 80 and e.lane == COMPUTE_LANE and ":" in e.label:  # the layer, where it fits
            out.append(text(axis.x(e.start_us) + 3, y + LANE_H / 2 + 4, e.label.split(":")[0][: int(w / 6.5)],
                            fill="#fff", size=10))
    return out


def _phases(axis: _Axis, y: float, tl: StepTimeline) -> list[str]:
    out = [text(LEFT - 6, y + BAND_H - 4, "phase", anchor="end", fill="#666")]
    for phase, start, end in tl.phases:
        w = (end - start) * axis.scale
        out.append(rect(axis.x(start), y, w, BAND_H, PHASE_FILL.get(phase, "#999"), cls="phase",
                        title=f"{phase}: {fmt_us(end - start)}, {fmt_us(start)} → {fmt_us(end)}",
                        data={"phase": phase, "start-us": start, "us": end - start}))
        if w > 60:
            out.append(text(axis.x(start) + 3, y + BAND_H - 4, phase, fill="#fff", size=10))
    return out


def _measured(axis: _Axis, y: float, m: MeasuredStep, predicted_us: float | None) -> list[str]:
    """The measured step as one bar, split into compute and communication where known."""
    parts: list[tuple[str, float, float]] = []
    if m.compute_us is not None and m.comm_us is not None:
        parts = [("compute", 0.0, m.compute_us), ("comm", m.compute_us, m.compute_us + m.comm_us)]
        if m.compute_us + m.comm_us < m.step_us:
            parts.append(("other", m.compute_us + m.comm_us, m.step_us))
    else:
        parts = [("step", 0.0, m.step_us)]
    label = f"measured: median of {m.steps} steps ({m.source})"
    out = [text(LEFT, y + 10, label, fill="#444"),
           rect(LEFT, y + 16, axis.width - LEFT - RIGHT, LANE_H, "#f6f6f6", cls="lane", data={"lane": "measured"}),
           text(LEFT - 6, y + 16 + LANE_H / 2 + 4, "measured", anchor="end")]
    for part, start, end in parts:
        title = f"measured {part}: {fmt_us(end - start)}" + (f" (step {fmt_us(m.step_us)})" if part != "step" else "")
        out.append(rect(axis.x(start), y + 16, (end - start) * axis.scale, LANE_H, MEASURED_FILL[part],
                        cls="measured", title=title, data={"part": part, "start-us": start, "us": end - start}))
    if predicted_us is not None and predicted_us > 0:
        ratio = m.step_us / predicted_us
        out.append(text(axis.x(min(m.step_us, axis.t_max)) + 4 if m.step_us < 0.85 * axis.t_max else LEFT + 4,
                        y + 16 + LANE_H + 12, f"measured / predicted = {ratio:.2f}", fill="#444", size=10))
    return out


def _legend(y: float, kinds: list[str]) -> list[str]:
    items = [(p, c) for p, c in PHASE_FILL.items()] + [("waiting (exposed comm)", WAIT_FILL),
                                                       ("driving a collective", DRIVE_FILL)]
    items += [(k.replace("_", "-"), KIND_FILL[k]) for k in kinds if k in KIND_FILL]
    out, x = [], LEFT
    for name, color in items:
        out.append(rect(x, y, 10, 10, color))
        out.append(text(x + 14, y + 9, name, size=10))
        x += 24 + 6.2 * len(name)
    return out


def timeline_svg(tl: StepTimeline | None, measured: MeasuredStep | None = None, *,
                 t_max: float | None = None, width: float = WIDTH) -> str:
    """The predicted step's lanes (and the measured one under them) as one inline SVG;
    `t_max`: the time axis's end, shared by two plans' pictures on a diff page."""
    ends = [x for x in (tl.step_us if tl else None, measured.step_us if measured else None) if x]
    axis = _Axis(max([t_max or 0.0, *ends]) or 1.0, width)
    body, y = [_STYLE], 4.0
    if tl is not None:
        body += _phases(axis, y, tl)
        y += BAND_H + GAP
        for name in tl.lanes:
            body += _lane(axis, y, name, [e for e in tl.events if e.lane == name])
            y += LANE_H + GAP
    lanes_bottom = y
    if measured is not None:
        body += _measured(axis, y + 6, measured, tl.step_us if tl else None)
        y += 6 + 16 + LANE_H + 18
    body += axis.ticks(4.0, y)
    y += 20
    if tl is not None:
        x = axis.x(tl.step_us)
        body.append(line(x, 2.0, x, max(lanes_bottom, y - 20), stroke="#222", dash="4 3"))
        body.append(text(min(x, width - RIGHT), y + 2, f"predicted step {fmt_us(tl.step_us)}", anchor="end", size=10))
        y += 10
    kinds = sorted({e.label.split(" ")[0] for e in (tl.events if tl else []) if e.lane != COMPUTE_LANE})
    body += _legend(y + 4, kinds)
    y += 20
    data = {"step-us": tl.step_us if tl else "", "source": tl.source if tl else "",
            "measured-us": measured.step_us if measured else "", "t-max-us": axis.t_max}
    what = f"predicted step {fmt_us(tl.step_us)}" if tl else "no prediction"
    return svg(width, y, body, cls="timeline", label=f"the step as a timeline: {what}", data=data)


def cannot_draw_timeline(why: str) -> str:
    """What a page without a simulation says instead of empty lanes."""
    return f'<p class="note cannot-draw" data-picture="timeline">The step as a timeline is not drawn: {esc(why)}</p>'


__all__ = ["cannot_draw_timeline", "fmt_us", "timeline_svg"]
