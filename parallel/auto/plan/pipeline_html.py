"""A pipeline's page (`pipeline_plan.html`): the schedule and the stages in a table (blocks,
pp rank, predicted time a microbatch, peak with the microbatches in flight against the
limit), a link to each stage's own plan page (`plan.stage<i>.html`: its placements, memory
and timeline, as any plan's), and the schedule simulated as a picture (one stage per rank).
"""

from __future__ import annotations

import html
import os

from parallel.auto.plan.html import _page, fmt_bytes, save_html, write_html
from parallel.auto.plan.pictures.pipeline import schedule_svg, simulate
from parallel.auto.plan.pipeline import PipelinePlan, StagePlan

__all__ = ["fwd_share", "pipeline_html", "save_pipeline_html", "simulated_step_us"]


def fwd_share(stage: StagePlan) -> float:
    """The forward's share of a stage's compute (its plan's nodes by phase)."""
    fwd = sum(n.compute_us for n in stage.plan.nodes.values() if n.phase == "fwd")
    total = sum(n.compute_us for n in stage.plan.nodes.values())
    return fwd / total if total > 0 else 1 / 3


def _simulated(plan: PipelinePlan) -> list | None:
    """The schedule's slots (None: several stages a rank, not drawn)."""
    if plan.stages_per_rank != 1 or plan.schedule not in ("GPipe", "1F1B"):
        return None
    slots = [plan.stage_slot_us(s) for s in plan.stages]
    fwd = [t * fwd_share(s) for t, s in zip(slots, plan.stages)]
    return simulate(plan.schedule, fwd, [t - f for t, f in zip(slots, fwd)], plan.n_microbatches, 0.0)


def simulated_step_us(plan: PipelinePlan) -> float | None:
    """The step a simulation of the schedule gives for the stages' times (None: not simulated)."""
    slots = _simulated(plan)
    return None if slots is None else max(s.end for s in slots)


def pipeline_html(plan: PipelinePlan) -> str:
    e = html.escape
    rows = []
    for s in plan.stages:
        k = plan.in_flight(s.index)
        peak = s.peak_bytes(k)
        limit = s.plan.memory.limit_bytes if s.plan.memory is not None else 0
        fits = "" if peak is None or not limit else (" (fits)" if peak <= limit else " (over the limit)")
        rows.append(f"<tr><td>{s.index}</td><td>{e(s.describe(len(plan.stages)))}</td><td>{s.rank}</td>"
                    f"<td>{s.step_us / 1e3:,.2f}</td><td>{'-' if peak is None else fmt_bytes(peak)} with {k} in "
                    f"flight{fits}</td><td><a href=\"plan.stage{s.index}.html\">plan.stage{s.index}.html</a></td></tr>")
    slots = _simulated(plan)
    picture = schedule_svg(slots, plan.pp, plan.step_us) if slots is not None else (
        f"<p>The schedule is drawn for one stage a rank (GPipe, 1F1B); {e(plan.schedule)} runs "
        f"{plan.stages_per_rank} a rank.</p>")
    body = (f"<p>{e(plan.schedule)}: {len(plan.stages)} stages on pp = {plan.pp}, {plan.n_microbatches} microbatches; "
            f"predicted step {plan.step_us / 1e3:,.2f} ms, of which bubble {plan.bubble_us / 1e3:,.2f} ms; "
            f"point-to-point send {plan.p2p_us:,.1f} µs a boundary.</p>\n"
            "<table><tr><th>stage</th><th>holds</th><th>pp rank</th><th>ms a microbatch</th>"
            "<th>peak a device</th><th>its plan</th></tr>\n" + "\n".join(rows) + "</table>\n"
            "<h2>The schedule, simulated</h2>\n" + picture
            + "".join(f"<p>note: {e(n)}</p>" for n in plan.notes))
    return _page(f"Pipeline plan: {plan.schedule}, pp {plan.pp}", body)


def save_pipeline_html(plan: PipelinePlan, folder: str | os.PathLike) -> None:
    """`pipeline_plan.html` and every stage's `plan.stage<i>.html` in `folder`."""
    for s in plan.stages:
        save_html(s.plan, os.path.join(folder, f"plan.stage{s.index}.html"))
    write_html(os.path.join(folder, "pipeline_plan.html"), pipeline_html(plan))
