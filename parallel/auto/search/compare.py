"""The sweep's best point against the FSDP preset at the same point: is the planner's plan worth it?

After a sweep, its best row (the highest predicted tokens/s per device among the points that
fit) is planned again with the FSDP-shaped preset (`point.PRESETS["fsdp"]`: parameters fully
sharded and gathered for every matmul, activations batch-sharded on the data axes) through the
same point machinery and plan cache (the preset is part of the point's key). Both plans are
drawn side by side in `best_vs_preset.html` (their step timelines on one time axis, memory
bars, placements maps with the cells that differ outlined), and one line says both predicted
step times and their ratio.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from parallel.auto.plan.html import save_diff_html

from .point import PlanCache, point_key
from .run import Progress, run_points
from .spec import Point, more_micro_batches

PAGE = "best_vs_preset.html"
PRESET = "fsdp"
NAMES = ("FSDP preset", "best")


def best_row(rows: Sequence[dict]) -> int | None:
    """Position of the row with the highest predicted tokens/s per device that fits (status ok)."""
    fits = [(r["tokens_per_s"] / r["world"], i) for i, r in enumerate(rows)
            if r.get("status") == "ok" and r.get("tokens_per_s") and not r.get("preset")]
    return max(fits)[1] if fits else None


def row_point(point: Point, row: dict) -> Point | None:
    """The point `row` was planned at: `point`, or the retry with more micro-batches that fitted
    (run_points' OOM retries); None when none has the row's key."""
    p: Point | None = point
    while p is not None and p.micro_batches <= int(row.get("micro_batches") or 1):
        if point_key(p) == row.get("key"):
            return p
        p = more_micro_batches(p)
    return None


def _where(row: dict) -> str:
    m = row.get("micro_batches") or 1
    return (f"{row['model']} on {row['hardware']}, mesh {row['mesh']}, batch {row['global_batch']} x seq "
            f"{row['seq_len']} ({row['local_batch']} a rank x {m} micro-batch{'es' if m > 1 else ''})")


def _ms(x: float) -> str:
    """A step time in ms with enough digits to tell two small ones apart."""
    return f"{x:,.1f}" if x >= 100 else f"{x:.3g}" if x >= 1 else f"{x:.3f}"


def best_vs_preset(points: Sequence[Point], rows: Sequence[dict], cache: PlanCache, out_dir: str | os.PathLike, *,
                   workers: int = 1, progress: Progress | None = None) -> str:
    """Plan the best row's point with the FSDP preset, write `out_dir/best_vs_preset.html`, and
    return the line to print (why nothing was compared, when nothing could be)."""
    i = best_row(rows)
    if i is None:
        return "best vs FSDP preset: skipped (no point fits: nothing to compare)"
    best = rows[i]
    point = row_point(points[i], best)
    best_plan = cache.plan(best["key"]) if point is not None else None
    if best_plan is None:
        return f"best vs FSDP preset: skipped (the best plan is missing from the cache {cache.folder}; run again)"
    preset_point = dataclasses.replace(point, preset=PRESET)
    (preset,) = run_points([preset_point], workers=workers, cache=cache, progress=progress or Progress(1))
    preset_plan = cache.plan(preset["key"]) if preset.get("key") else None
    if preset_plan is None or preset.get("step_ms") is None:
        return f"best vs FSDP preset at {_where(best)}: skipped (the preset has no plan: {preset.get('status')})"
    path = os.path.join(os.fspath(out_dir), PAGE)
    save_diff_html(preset_plan, best_plan, path, names=NAMES,
                   title=f"Best sweep point vs the FSDP preset: {_where(best)}")
    ratio = preset["step_ms"] / best["step_ms"]
    same = preset_plan.placement_digest() == best_plan.placement_digest()
    verdict = ("the best plan IS the FSDP preset's (same placements)" if same
               else f"the preset's step is {ratio:.2f}x the best's")
    notes = "" if preset.get("status") == "ok" else f" (the preset does not fit: {preset.get('status')})"
    if preset.get("micro_batches") != best.get("micro_batches"):
        notes += f" (the preset at {preset.get('micro_batches')} micro-batches, to fit)"
    if best_plan.timeline is not None and preset_plan.timeline is not None:  # what the page draws
        notes += (f"; the page's simulated steps (one micro-batch each): best {_ms(best_plan.timeline.step_us / 1e3)} "
                  f"ms, FSDP preset {_ms(preset_plan.timeline.step_us / 1e3)} ms")
    return (f"best vs FSDP preset at {_where(best)}: best {_ms(best['step_ms'])} ms, FSDP preset "
            f"{_ms(preset['step_ms'])} ms per step predicted (the table's), {verdict}{notes}; wrote {path}")
