"""A sweep's rows as a Markdown table, a CSV file and a picture (SVG, written by hand:
matplotlib is not a dependency). Files are written to a temporary name, then renamed.

A sweep plans; it runs nothing, so its numbers are predictions (PREDICTED_NOTE says so under
the table) -- unless `scripts/sweep.py --measure` ran the points this machine can run
(tools/sweep_measure.py): then the table gains the MEASURE_COLUMNS (MEASURED_NOTE says what they
are) and `write_scatter` draws predicted against measured, one point per distinct plan
(parallel/auto/plan/pictures/scatter.py, the picture scripts/fidelity.py draws)."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parallel.auto.plan.pictures.scatter import scatter_svg

COLUMNS = [  # (header, row key, format)
    ("rank", "rank", "{}"), ("#", "index", "{}"), ("model", "model", "{}"), ("hw", "hardware", "{}"),
    ("world", "world", "{}"), ("mesh", "mesh", "{}"), ("pipeline", "pipeline", "{}"), ("batch x seq", None, ""),
    ("local", "local_batch", "{}"),
    ("micro", "micro_batches", "{}"), ("AC", "ac_mode", "{}"),
    ("budget", "budget", "{:.4g}"),
    ("step ms", "step_ms", "{:,.1f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"), ("MFU", "mfu", "{:.1%}"),
    ("mem GiB", "mem_gib", "{:.2f}"), ("OOM", "oom", ""), ("plan s", "plan_s", "{:.1f}"), ("status", "status", "{}"),
    ("plan", "summary", "{}"),
]
MEASURE_COLUMNS = [  # shown when the sweep measured (a row with a "measure" key)
    ("predicted ms", "predicted_ms", "{:,.2f}"), ("measured ms", "measured_ms", "{:,.2f}"),
    ("measured / predicted", "measured_ratio", "{:.2f}"), ("measurement", "measure", "{}"),
]


def _cell(row: dict, key: str | None, fmt: str) -> str:
    if key is None:
        return f"{row['global_batch']} x {row['seq_len']}"
    v = row.get(key)
    if key == "oom":
        return "" if v is None else ("yes" if v else "no")
    if key == "plan_s" and row.get("cached"):
        return "cached"
    if key == "mem_gib" and v is not None and row.get("mem_kind") == "states":
        return f"{v:.2f} (states)"
    if v is None or v == "":
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """The rows as a Markdown table (``columns``: headers to keep, default all but rank)."""
    every = COLUMNS + (MEASURE_COLUMNS if any("measure" in r for r in rows) else [])
    cols = [c for c in every if (c[0] != "rank" if columns is None else c[0] in columns)]
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r, k, f).replace("|", "/") for _, k, f in cols) + " |")
    return "\n".join(lines)


def memory_note(rows: Sequence[dict]) -> str:
    """What the memory column counts (said under every table that has "(states)" cells)."""
    if any(r.get("mem_kind") == "states" for r in rows):
        return ("mem GiB (states): parameters + gradients + AdamW moments per device from the plan's parameter "
                "placements (no activations: the plan carries no peak estimate); OOM compares it with the "
                "profile's memory")
    return ""


PREDICTED_NOTE = ("step ms, tokens/s, MFU and memory are the cost model's predictions on each point's profile: "
                  "a sweep plans and runs nothing, so there are no measured step times and no predicted-vs-"
                  "measured scatter here; `scripts/sweep.py --measure` runs the points this machine can run "
                  "and draws one (scatter.svg), as scripts/fidelity.py does (fidelity_scatter.svg)")


def measured_note(rows: Sequence[dict]) -> str:
    """What the measured columns are (said under a table that has them), else PREDICTED_NOTE."""
    if not any("measure" in r for r in rows):
        return PREDICTED_NOTE
    preds = {r["predictor"] for r in rows if r.get("predictor")}
    what = {"step simulation": "the step simulation (Plan.timeline: what scripts/fidelity.py draws)",
            "ILP objective": "the ILP objective's step (step ms) where a plan has no simulation or the point "
                             "runs several micro-batches"}
    return ("step ms, tokens/s, MFU and memory are predicted. measured ms: the median timed step of the points "
            "this machine could run (--measure: their cached plans run by the trainer on gloo ranks after "
            "warm-up steps, round-robin per world size); predicted ms: "
            + ("; ".join(what.get(p, p) for p in sorted(preds, reverse=True)) or "-")
            + "; a point duplicating another's job and placements takes its measurement")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_csv(rows: Sequence[dict], path: str | os.PathLike) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and k != "traceback"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    _write(Path(path), buf.getvalue())


def write_markdown(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> None:
    """The table, what its memory column counts, and which of its numbers are predicted."""
    notes = "".join(f"\n{n}\n" for n in (memory_note(rows), measured_note(rows)) if n)
    _write(Path(path), (f"# {title}\n\n" if title else "") + markdown_table(rows) + "\n" + notes)


# ----------------------------------------------------------------------------- picture


def _xvalues(rows: Sequence[dict], x: str, xkey: Any) -> list:
    seen: list = []
    for r in rows:
        v = xkey(r)
        if v not in seen:
            seen.append(v)
    return sorted(seen, key=lambda v: (isinstance(v, str), v if not isinstance(v, str) else 0, str(v)))


def _panel(rows, xs, xkey, ykey, y0, title, unit, limit=None) -> list[str]:
    """One panel (plot area 80..620 x y0..y0+200): a dot per point, a line through the best per x."""
    pts = [(xs.index(xkey(r)), r[ykey]) for r in rows if r.get(ykey) is not None]
    top = max([v for _, v in pts] + ([limit] if limit else []) + [1e-12]) * 1.1

    def px(i: int) -> float:
        return 80 + (i + 0.5) * 540 / max(1, len(xs))

    def py(v: float) -> float:
        return y0 + 200 - v / top * 200

    out = [f'<text x="80" y="{y0 - 8}" font-size="13" font-weight="bold">{title}</text>',
           f'<line x1="80" y1="{y0 + 200}" x2="620" y2="{y0 + 200}" stroke="#000"/>',
           f'<line x1="80" y1="{y0}" x2="80" y2="{y0 + 200}" stroke="#000"/>']
    for k in range(5):
        v = top * k / 4
        out.append(f'<text x="74" y="{py(v) + 4:.1f}" font-size="10" text-anchor="end">{_si(v)}{unit}</text>')
        out.append(f'<line x1="80" y1="{py(v):.1f}" x2="620" y2="{py(v):.1f}" stroke="#ddd"/>')
    for i, v in pts:
        out.append(f'<circle cx="{px(i):.1f}" cy="{py(v):.1f}" r="3" fill="#4477aa" fill-opacity="0.6"/>')
    best = {}
    for i, v in pts:
        best[i] = max(best.get(i, v), v) if ykey == "tokens_per_s" else min(best.get(i, v), v)
    if len(best) > 1:
        path = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in sorted(best.items()))
        out.append(f'<polyline points="{path}" fill="none" stroke="#cc3311" stroke-width="2"/>')
    if limit:
        out.append(f'<line x1="80" y1="{py(limit):.1f}" x2="620" y2="{py(limit):.1f}" stroke="#cc3311" '
                   f'stroke-dasharray="6,4"/><text x="616" y="{py(limit) - 4:.1f}" font-size="10" '
                   f'text-anchor="end">device memory</text>')
    return out


def _si(v: float) -> str:
    for div, s in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{s}"
    return f"{v:.3g}"


def svg_picture(rows: Sequence[dict], x: str, title: str, memory_limit_gib: float | None = None) -> str:
    """Tokens/s (top) and peak memory per device (bottom) against the swept axis ``x``:
    a dot per point, a line through the best (most tokens/s, least memory) per x value."""
    xkey = (lambda r: r.get("world")) if x == "world_size" else (lambda r: r.get(_ROW_KEYS.get(x, x)))
    xs = _xvalues(rows, x, xkey)
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="660" height="600" font-family="sans-serif">',
             '<rect width="100%" height="100%" fill="#fff"/>',
             f'<text x="330" y="22" font-size="15" text-anchor="middle">{_esc(title)}</text>']
    parts += _panel(rows, xs, xkey, "tokens_per_s", 60, "tokens/s (predicted)", "")
    kind = "model states" if any(r.get("mem_kind") == "states" for r in rows) else "peak memory"
    parts += _panel(rows, xs, xkey, "mem_gib", 330, f"{kind} per device (GiB)", "", memory_limit_gib)
    step = max(1, len(xs) // 12)
    for i, v in enumerate(xs):
        if i % step == 0:
            cx = 80 + (i + 0.5) * 540 / max(1, len(xs))
            parts.append(f'<text x="{cx:.1f}" y="548" font-size="10" text-anchor="middle">{_esc(str(v))}</text>')
    parts.append(f'<text x="350" y="575" font-size="12" text-anchor="middle">{_esc(x)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


_ROW_KEYS = {"local_batch_size": "local_batch", "memory_budget_high": "budget", "flavor": "model"}


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_scatter(points: Sequence[tuple[str, float, float]], path: str | os.PathLike, title: str) -> None:
    """(name, predicted ms, measured ms) per distinct plan, over the y = x line."""
    _write(Path(path), scatter_svg(points, title=title))


def write_svg(rows: Sequence[dict], path: str | os.PathLike, x: str, title: str,
              memory_limit_gib: float | None = None) -> None:
    _write(Path(path), svg_picture(rows, x, title, memory_limit_gib))
