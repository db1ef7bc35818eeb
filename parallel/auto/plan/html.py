"""Stage 4's picture: a Plan as one self-contained HTML page (`plan.html`), and two plans side by side.

A plan is thousands of nodes; what a person checks is what each projection does on each
mesh axis in the forward and the backward, what the collectives cost, and how much
parameter memory a device holds. The page is standard-library HTML with inline CSS (no
scripts, fonts or URLs) so that it opens anywhere, offline, and can be attached to an
issue. It renders from the plan's JSON fields alone (a loaded plan: its saved step
simulation included, when it has one); the in-memory plan of `optimize_placement` adds
its collectives one by one.

This module reads `plan/`; `plan/` does not import it (no import circle), so callers
use `save_html(plan, path)` / `plan_diff_html(a, b)` from here.
"""

from __future__ import annotations

import html
import json
import os
from collections import defaultdict
from typing import Any

from parallel.auto.candidates.placements import placement_words
from parallel.auto.candidates.strategies import GETITEM, SLOT
from parallel.auto.cost.timeline import MeasuredStep, StepTimeline
from parallel.auto.plan import NodePlan, Plan, PlanDiff, collapse_layers, linear_roles, report
from parallel.auto.plan.pictures.memory import memory_pictures
from parallel.auto.plan.pictures.placements import map_note, placement_map
from parallel.auto.plan.pictures.timeline import cannot_draw_timeline, timeline_svg
from parallel.auto.trace.joint import layer_prefix

TOP = "(top level)"
MAX_CHANGED = 500  # changed nodes listed on a diff page (the count is always given)
# ops a gradient passes through unchanged between its producer and the plan's output slot
_PASS_THROUGH = {"aten.t.default", "aten.transpose.int", "aten.view.default", "aten._unsafe_view.default",
                 "aten.reshape.default", "aten._to_copy.default", "aten.detach.default", "aten.clone.default",
                 "aten.permute.default"}

_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:18px}h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:4px 0}
th,td{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
th.group{background:#e8eef8}code{font-size:12px}
.fwd{color:#124}.bwd{color:#531}.tag{font-weight:600;font-size:11px;color:#777;margin-right:4px}
.changed{background:#fff2a8}.side{display:flex;gap:24px;align-items:flex-start}
.side>div{flex:1;min-width:0;overflow-x:auto}.note{color:#666;font-size:12px}
svg.timeline{max-width:100%;height:auto;display:block;margin:4px 0}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (what a reader compares)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"  # pragma: no cover


# ---------------------------------------------------------------------------
# What each parameter does on each mesh axis
# ---------------------------------------------------------------------------


def _grad_slots(plan: Plan) -> dict[str, NodePlan]:
    return {fqn: n for fqn, n in plan.grad_slots().items() if n.kind == SLOT}


def grad_reduction(plan: Plan, slot: NodePlan) -> list[str]:
    """Per mesh axis, how a parameter's gradient is reduced: partial sums somewhere between
    its producer and the output slot become shards (reduce-scatter) or replicas (all-reduce);
    'none' when every rank computes its own piece (TP, or a sharded embedding)."""
    seen = [placement_words(p) for p in slot.input_placements + slot.output_placements]
    cur = slot
    while cur.inputs and cur.inputs[0] in plan.nodes:
        prod = plan.nodes[cur.inputs[0]]
        seen += [placement_words(p) for p in prod.output_placements if p != "-"]
        if prod.kind != GETITEM and prod.target not in _PASS_THROUGH:
            break
        seen += [placement_words(p) for p in prod.input_placements[:1]]
        cur = prod
    final = placement_words(slot.output_placements[0])
    out = []
    for ax, fin in enumerate(final):
        if not any(ax < len(w) and w[ax].startswith(("P", "MP")) for w in seen):
            out.append("none")
        else:
            out.append("reduce-scatter" if fin.startswith("S(") else "all-reduce" if fin == "R" else "partial")
    return out


def param_cells(plan: Plan) -> dict[str, list[dict[str, str]]]:
    """Per parameter FQN, one cell per mesh axis: the forward use and storage, the gradient's
    placement and its reduction."""
    names = plan.mesh_axis_names
    grads = _grad_slots(plan)
    params = plan.params()
    out = {}
    for fqn, words in linear_roles(plan):
        per_axis = words.split("; ")
        stored = placement_words(params[fqn].output_placements[0])
        slot = grads.get(fqn)
        grad = placement_words(slot.output_placements[0]) if slot is not None else []
        red = grad_reduction(plan, slot) if slot is not None else []
        cells = []
        for ax, name in enumerate(names):
            fwd = per_axis[ax].removesuffix(f" on {name}") if ax < len(per_axis) else "?"
            cells.append({"fwd": fwd, "store": stored[ax] if ax < len(stored) else "?",
                          "grad": grad[ax] if ax < len(grad) else "-", "reduce": red[ax] if ax < len(red) else "-"})
        out[fqn] = cells
    return out


def param_rows(plan: Plan) -> list[tuple[str, list[tuple[str, str, list[dict[str, str]]]]]]:
    """Layer groups (repeated blocks collapsed, 'layers.0-3', as `Plan.summary`), each with its
    parameters: (short name, '(stored) -> grad (placement)', per-axis cells)."""
    cells = param_cells(plan)
    grads = _grad_slots(plan)
    by_layer: dict[str, list[str]] = defaultdict(list)
    for fqn, per_axis in cells.items():
        layer = layer_prefix(fqn.rpartition(".")[0], innermost=True) or ""
        short = fqn[len(layer) + 1:] if layer else fqn
        slot = grads.get(fqn)
        tuples = f"{plan.placement(fqn)} → {slot.output_placements[0] if slot is not None else '-'}"
        by_layer[layer].append(json.dumps([short, tuples, per_axis]))
    top = by_layer.pop("", None)
    groups = collapse_layers(by_layer) + ([("", top)] if top else [])
    return [(layer or TOP, [tuple(json.loads(it)) for it in items]) for layer, items in groups]


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def _cell_html(c: dict[str, str]) -> str:
    """One parameter on one mesh axis: forward use + storage, then the gradient and its reduction."""
    fwd = _e(c["fwd"])
    if not c["fwd"].startswith("stored"):  # linear_roles says 'stored X' itself when it found no forward use
        fwd += f", stored <code>{_e(c['store'])}</code>"
    bwd = f"grad <code>{_e(c['grad'])}</code>, {_e(c['reduce'])}"
    return (f'<div class="fwd"><span class="tag">fwd</span>{fwd}</div>'
            f'<div class="bwd"><span class="tag">bwd</span>{bwd}</div>')


def params_table(plan: Plan, other: Plan | None = None) -> str:
    """Rows: layer groups x parameters; columns: mesh axes. Cells that differ from `other`
    (the other side of a diff) are highlighted."""
    rows = param_rows(plan)
    theirs: dict[tuple[str, str], tuple] = {}
    if other is not None:
        theirs = {(g, r[0]): r for g, items in param_rows(other) for r in items}
    head = "".join(f'<th class="axis">{_e(n)}</th>' for n in plan.mesh_axis_names)
    out = ['<table class="params"><tr><th>layer group</th><th>parameter</th>'
           f'<th>placement → grad</th>{head}</tr>']
    for group, items in rows:
        for i, (short, tuples, cells) in enumerate(items):
            mine = theirs.get((group, short)) if other is not None else None
            tr = ['<tr>']
            if i == 0:
                tr.append(f'<th class="group" rowspan="{len(items)}">{_e(group)}</th>')
            diff_t = other is not None and (mine is None or mine[1] != tuples)
            tr.append(f'<td><code>{_e(short)}</code></td><td{_cls(diff_t)}><code>{_e(tuples)}</code></td>')
            for ax, c in enumerate(cells):
                diff_c = other is not None and (mine is None or ax >= len(mine[2]) or mine[2][ax] != c)
                tr.append(f"<td{_cls(diff_c)}>{_cell_html(c)}</td>")
            out.append("".join(tr) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _cls(changed: bool) -> str:
    return ' class="changed"' if changed else ""


def comm_table(plan: Plan) -> str:
    """The objective's communication, per collective kind and mesh axis (at the scheduled prices)."""
    total = sum(plan.comm_us.values()) or 1.0
    out = ['<table class="comm"><tr><th>collective</th><th>mesh axis</th><th>bytes</th><th>µs</th>'
           '<th>share of comm</th></tr>']
    for key in sorted(set(plan.comm_us) | set(plan.comm_bytes)):
        kind, _, axis = key.partition("@")
        us, nbytes = plan.comm_us.get(key, 0.0), plan.comm_bytes.get(key, 0.0)
        out.append(f'<tr><td>{_e(kind)}</td><td>{_e(axis)}</td><td class="num">{fmt_bytes(nbytes)}</td>'
                   f'<td class="num">{us:,.1f}</td><td class="num">{100 * us / total:.1f}%</td></tr>')
    if len(out) == 1:
        out.append('<tr><td colspan="5">no communication</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def collectives_table(plan: Plan) -> str:
    """Every redistribution of the in-memory plan, grouped by kind, axis and phase (each priced
    as if issued alone); a loaded plan has only the totals above."""
    if plan.costs is None:
        return '<p class="note">collectives one by one: only for the in-memory plan (this one was loaded)</p>'
    acc: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives():
        if c["kind"] == "local":
            continue
        a = acc[(c["kind"], c["axis"], c["phase"])]
        a[0] += 1
        a[1] += c["bytes"]
        a[2] += c["time_us"]
    out = ['<table class="collectives"><tr><th>collective</th><th>mesh axis</th><th>phase</th><th>count</th>'
           '<th>bytes</th><th>µs (issued alone)</th></tr>']
    for (kind, axis, phase), (n, nbytes, us) in sorted(acc.items()):
        out.append(f'<tr><td>{_e(kind)}</td><td>{_e(axis)}</td><td>{_e(phase)}</td><td class="num">{n:.0f}</td>'
                   f'<td class="num">{fmt_bytes(nbytes)}</td><td class="num">{us:,.1f}</td></tr>')
    if not acc:
        out.append('<tr><td colspan="6">no collectives</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def memory_line(plan: Plan, total_param_bytes: float | None = None) -> str:
    """Parameter memory per device: the plan's fraction, in bytes when the total is known."""
    if total_param_bytes is None:
        total_param_bytes = plan.total_param_bytes or None
    text = f"parameter memory per device: {plan.memory_fraction:.4f} of all parameter bytes"
    if total_param_bytes:
        text += f" = {fmt_bytes(plan.memory_fraction * total_param_bytes)} of {fmt_bytes(total_param_bytes)}"
    low, high = (list(plan.memory_budget) + [None, None])[:2]
    text += f"; budget low {'-' if low is None else f'{low:.4g}'}, high {'-' if high is None else f'{high:.4g}'}"
    return text


def overview(plan: Plan, total_param_bytes: float | None = None) -> str:
    """Objective, compute, memory, solver, timings, hardware and mesh: what the plan is for."""
    comm = sum(plan.comm_us.values())
    mesh = " × ".join(f"{n}={s}" for n, s in zip(plan.mesh_axis_names, plan.mesh_shape))
    rows = [
        ("objective", f"{plan.objective_us:,.1f} µs = compute {plan.compute_us:,.1f} µs + comm {comm:,.1f} µs"),
        ("memory", memory_line(plan, total_param_bytes)),
        ("peak memory", plan.memory.summary() if plan.memory is not None else "not estimated"),
        ("recomputation", report.recompute_line(plan) or "as the job set it ([activation_checkpoint] mode)"),
        ("resharding", report.resharding_line(plan) or "as the job set it ([parallelism] reshard_after_forward)"),
        ("mesh", f"{mesh} ({len(plan.mesh_shape)}-D)"),
        ("hardware", plan.hardware),
        ("solver", f"{plan.solver}, {plan.status}, {plan.num_vars:,} variables"),
        ("timings", ", ".join(f"{k} {v:.2f} s" for k, v in plan.timings.items())),
        ("mixed precision", plan.mp_param_dtype or "none"),
        ("inputs", json.dumps(plan.input_shapes)),
        ("model", f"fingerprint {plan.fingerprint}, torch {plan.torch_version}"),
    ]
    out = ['<table class="overview">']
    out += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows]
    cons = "".join(f"<li>{_e(c)}</li>" for c in plan.constraints)
    cons = f"<details><summary>{len(plan.constraints)}</summary><ul>{cons}</ul></details>" if cons else "none"
    out.append(f"<tr><th>constraints</th><td>{cons}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def plan_sections(plan: Plan, other: Plan | None = None, total_param_bytes: float | None = None) -> str:
    """One plan's body: the pictures (memory bars, placements map), then the tables (overview,
    parameters per layer group and mesh axis, collectives)."""
    return "\n".join([
        "<h2>Memory at the peak</h2>", memory_pictures(plan.memory),
        "<h2>Placements map</h2>", placement_map(plan, param_rows, other) + map_note(plan),
        "<h2>Overview</h2>", overview(plan, total_param_bytes),
        "<h2>Parameters: forward use and gradient, per mesh axis</h2>", params_table(plan, other),
        "<h2>Collectives (in the objective)</h2>", comm_table(plan),
        "<h2>Collectives by kind, mesh axis and phase</h2>", collectives_table(plan),
    ])


# ---------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{_CSS}</style></head>\n<body>\n<h1>{_e(title)}</h1>\n{body}\n</body></html>\n")


def _title(plan: Plan) -> str:
    mesh = "x".join(map(str, plan.mesh_shape))
    return f"Plan: mesh {mesh} ({', '.join(plan.mesh_axis_names)}) on {plan.hardware}"


def step_table(timeline: StepTimeline | None, measured: MeasuredStep | None,
               predicted_peak: float | None = None) -> str:
    """The step's predicted time (the simulation's) and peak (the memory estimate's) beside what
    the run measured after its warm-up."""
    def ms(us: float | None) -> str:
        return "-" if us is None else f"{us / 1e3:,.1f} ms"

    rows = []
    if timeline is not None:
        peak = fmt_bytes(predicted_peak) if predicted_peak is not None else "-"
        rows.append(("predicted", ms(timeline.step_us), timeline.source, peak))
    if measured is not None:
        peak = fmt_bytes(measured.peak_bytes) if measured.peak_bytes is not None else "-"
        rows.append(("measured", ms(measured.step_us), f"median of {measured.steps} steps ({measured.source})", peak))
    if not rows:
        return ""  # the Step section says why there is nothing to show
    out = ['<table class="step"><tr><th></th><th>step</th><th>from</th><th>peak memory</th></tr>']
    out += [f"<tr><th>{_e(a)}</th><td class=\"num\">{_e(b)}</td><td>{_e(c)}</td><td class=\"num\">{_e(d)}</td></tr>"
            for a, b, c, d in rows]
    if timeline is not None and measured is not None and timeline.step_us > 0:
        out.append(f'<tr><th>measured / predicted</th><td class="num">{measured.step_us / timeline.step_us:.2f}</td>'
                   '<td colspan="2"></td></tr>')
    return "\n".join(out + ["</table>"])


def _no_timeline(plan: Plan) -> str:
    """Why a plan has no step simulation to draw."""
    if plan.costs is None:
        return ("this plan was loaded from a JSON file without the step simulation (saved before plans kept it, "
                "or planned where the step could not be simulated): plan it again (tools/plan.py --html), or "
                "open the plan.html written when it was planned")
    return "the planner has no simulation of this plan's step (its step graph could not be traced or simulated: see "\
           "the planning log)"


def step_section(plan: Plan, timeline: StepTimeline | None = None, measured: MeasuredStep | None = None, *,
                 t_max: float | None = None) -> str:
    """The step as a timeline (the plan's own simulation unless `timeline` is given) with the
    measured step under it, then the step table; a plan without a simulation says why."""
    tl = timeline if timeline is not None else plan.timeline
    out = ["<h2>Step</h2>"]
    if tl is not None or measured is not None:
        out.append(timeline_svg(tl, measured, t_max=t_max))
    if tl is None:
        out.append(cannot_draw_timeline(_no_timeline(plan)))
    out.append(step_table(tl, measured, plan.memory.peak_bytes if plan.memory is not None else None))
    return "\n".join(out)


def plan_html(plan: Plan, *, title: str | None = None, total_param_bytes: float | None = None,
              timeline: StepTimeline | None = None, measured: MeasuredStep | None = None) -> str:
    """The plan as one self-contained HTML page; `timeline`: the simulated step (StepPrediction's;
    default the planner's, `plan.timeline`), `measured`: what the run measured of it after its warm-up."""
    body = "\n".join([step_section(plan, timeline, measured), plan_sections(plan, None, total_param_bytes)])
    return _page(title or _title(plan), body)


def changed_table(diff: PlanDiff, limit: int = MAX_CHANGED) -> str:
    """The nodes whose placements differ (`Plan.diff`), each as inputs -> outputs on both sides."""
    out = [f"<p>{len(diff.changed)} nodes changed; objective {diff.objective_a:,.1f} → {diff.objective_b:,.1f} µs "
           f"({diff.objective_delta:+,.1f}); only in A: {len(diff.only_in_a)}, only in B: {len(diff.only_in_b)}</p>",
           '<table class="changed-nodes"><tr><th>node</th><th>what</th><th>phase</th><th>A: inputs → outputs</th>'
           '<th>B: inputs → outputs</th></tr>']
    for name, a, b in diff.changed[:limit]:
        out.append(f"<tr><td><code>{_e(name)}</code></td><td>{_e(a.label or a.target)}</td><td>{_e(a.phase)}</td>"
                   f"<td><code>{_e(_io(a))}</code></td><td class=\"changed\"><code>{_e(_io(b))}</code></td></tr>")
    out.append("</table>")
    if len(diff.changed) > limit:
        out.append(f'<p class="note">... {len(diff.changed) - limit} more</p>')
    return "\n".join(out)


def _io(n: NodePlan) -> str:
    return f"{', '.join(n.input_placements) or '-'} → {', '.join(n.output_placements)}"


def plan_diff_html(a: Plan, b: Plan, *, names: tuple[str, str] = ("A", "B"), title: str | None = None) -> str:
    """Two plans side by side, the cells that differ highlighted, then the changed nodes."""
    diff = a.diff(b)
    t_max = max((p.timeline.step_us for p in (a, b) if p.timeline is not None), default=None)  # one time axis
    cols = "".join(f"<div><h2>{_e(label)}: {_e(_title(p))}</h2>\n{step_section(p, t_max=t_max)}\n"
                   f"{plan_sections(p, q)}</div>" for label, p, q in ((names[0], a, b), (names[1], b, a)))
    body = (f'<div class="side">{cols}</div>\n<h2>Changed nodes ({_e(names[0])} → {_e(names[1])})</h2>\n'
            f"{changed_table(diff)}")
    return _page(title or f"Plan diff: {names[0]} vs {names[1]}", body)


def write_html(path: str | os.PathLike, text: str) -> None:
    """Write to `path.tmp`, then rename: a reader never sees a half-written page."""
    tmp = f"{os.fspath(path)}.tmp"
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def save_html(plan: Plan, path: str | os.PathLike, **kw: Any) -> None:
    """`plan_html(plan)` written to `path` (plan.html next to plan.json)."""
    write_html(path, plan_html(plan, **kw))


def save_diff_html(a: Plan, b: Plan, path: str | os.PathLike, **kw: Any) -> None:
    """`plan_diff_html(a, b)` written to `path`."""
    write_html(path, plan_diff_html(a, b, **kw))
