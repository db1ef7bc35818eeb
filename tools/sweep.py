"""Plan a sweep of configurations on fake worlds (no GPU): a table row per point.

    python scripts/sweep.py configs/sweeps/llama3_8b_ladder.toml [--workers 2] [--out DIR] [--cache-dir DIR]

A spec (configs/sweeps/*.toml) lists axes -- models, flavors or model dims, hardware,
world sizes and meshes ("auto": every mesh of a world size), local batch, sequence length,
AC mode, parameter budget -- whose product is planned, in --workers spawned processes.
Plans are cached by what decides them (default ~/.cache/autotitan/plans), so a re-run plans
only new points. Prints the table (mesh, predicted step time, tokens/s, MFU, memory per
device, OOM, the plan in one line, planning time) and writes DIR/rows.csv, DIR/table.md
and DIR/sweep.svg (tokens/s and memory against the swept axis; DIR defaults to
outputs/sweeps/<name>/). Then the best point (the highest predicted tokens/s per device that
fits) is planned again with the FSDP preset's constraints (cached too): DIR/best_vs_preset.html
draws both plans side by side (step timelines, memory, placements maps) and one line gives both
predicted step times and their ratio (--no-compare: not). A spec error stops before any
planning; a failing point is a row.
Every number is predicted (nothing runs): the predicted-vs-measured scatter is
scripts/fidelity.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from parallel.auto.cost import load_hardware
from parallel.auto.search import report
from parallel.auto.search.compare import best_vs_preset
from parallel.auto.search.point import PlanCache, memory_limit
from parallel.auto.search.run import Progress, run_points
from parallel.auto.search.spec import SweepSpecError, load_sweep
from parallel.process_exit import freezes_at_exit
from trainer.auto_mode import load_base_job


@freezes_at_exit  # the process ends after main: no collector walk over the planner's objects
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="sweep spec TOML (a path, or a name under configs/sweeps/)")
    ap.add_argument("--workers", type=int, default=None, help="planning processes (default: the spec's, else 2)")
    ap.add_argument("--out", default=None, help="output folder (default outputs/sweeps/<name>)")
    ap.add_argument("--cache-dir", default=None, help="plan cache folder (default ~/.cache/autotitan/plans)")
    ap.add_argument("--limit", type=int, default=None, help="plan only the first N points")
    ap.add_argument("--no-compare", action="store_true",
                    help="do not plan the best point with the FSDP preset (no best_vs_preset.html)")
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers {args.workers}: must be >= 1")
    try:
        spec = load_sweep(args.spec, load_base_job)
    except SweepSpecError as e:
        print(f"sweep spec error: {e}", file=sys.stderr)
        return 2
    points = spec.points[: args.limit] if args.limit else spec.points
    workers = args.workers or spec.workers
    out = args.out or os.path.join("outputs", "sweeps", spec.name)
    print(f"sweep {spec.name}: {len(points)} points ({spec.source}), {workers} workers; x axis {spec.x}", flush=True)
    t0 = time.perf_counter()
    cache = PlanCache(args.cache_dir)
    rows = run_points(points, workers=workers, cache=cache, progress=Progress(len(points)))
    wall = time.perf_counter() - t0
    print(report.markdown_table(rows))
    note = report.memory_note(rows)
    if note:
        print(note)
    planned = [r for r in rows if not r.get("cached")]
    cpu = sum(r.get("cpu_s") or 0.0 for r in planned)
    print(f"\n{len(rows)} points in {wall:.1f} s ({len(planned)} planned, {len(rows) - len(planned)} from the cache; "
          f"planning CPU {cpu:.0f} s, {cpu / max(1, len(planned)):.1f} s a point; "
          f"{sum(r.get('status') not in ('ok', 'OOM') for r in rows)} failed, "
          f"{sum(r.get('status') == 'OOM' for r in rows)} OOM)")
    limits = {memory_limit(load_hardware(p.hardware)) / 2**30 for p in points}
    report.write_csv(rows, os.path.join(out, "rows.csv"))
    report.write_markdown(rows, os.path.join(out, "table.md"), title=f"{spec.name}: {spec.description}".rstrip(": "))
    report.write_svg(rows, os.path.join(out, "sweep.svg"), spec.x, f"{spec.name} ({len(rows)} points)",
              memory_limit_gib=limits.pop() if len(limits) == 1 else None)
    print(f"wrote {out}/rows.csv, {out}/table.md, {out}/sweep.svg\n{report.PREDICTED_NOTE}")
    if not args.no_compare:
        print(best_vs_preset(points, rows, cache, out, workers=workers), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
