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
Every number is predicted (nothing runs) unless --measure:

    python scripts/sweep.py SPEC --measure [--measure-steps 5]

then, after planning, every point this machine can run (planned for a cpu profile, on at most
8 gloo ranks, status ok) is run for real with its cached plan through the trainer, one set of
spawned ranks per world size, round-robin (tools/sweep_measure.py). The table and rows.csv gain
predicted ms (the step simulation, as scripts/fidelity.py plots), measured ms (the median timed
step), measured / predicted and why a point was not measured (planned for H100s, failed, or a
duplicate of another point's job and placements); DIR/scatter.svg draws one point per distinct
plan over y = x, and one line gives its path and Spearman's rho (3 or more plans). --measure on a
spec none of whose points can run here says why and exits 2, before planning.
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
from tools import rank_stats
from tools.sweep_measure import MAX_WORLD, measure_rows, runs_here, scatter_points
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
    ap.add_argument("--measure", action="store_true",
                    help=f"run the points this machine can run (cpu profile, <= {MAX_WORLD} ranks) and draw "
                         "predicted vs measured (scatter.svg)")
    ap.add_argument("--measure-steps", type=int, default=5, help="timed steps a point (--measure; default 5)")
    ap.add_argument("--measure-warmup", type=int, default=2, help="untimed steps first (--measure; default 2)")
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers {args.workers}: must be >= 1")
    if args.measure_steps < 1 or args.measure_warmup < 0:
        ap.error("--measure-steps must be >= 1 and --measure-warmup >= 0")
    try:
        spec = load_sweep(args.spec, load_base_job)
    except SweepSpecError as e:
        print(f"sweep spec error: {e}", file=sys.stderr)
        return 2
    points = spec.points[: args.limit] if args.limit else spec.points
    if args.measure and all(runs_here(p) for p in points):
        why = sorted({runs_here(p) for p in points})
        print(f"--measure: no point of {spec.source} can run on this machine ({'; '.join(why)}); it runs points "
              f"planned for a cpu hardware profile on at most {MAX_WORLD} gloo ranks", file=sys.stderr)
        return 2
    workers = args.workers or spec.workers
    out = args.out or os.path.join("outputs", "sweeps", spec.name)
    print(f"sweep {spec.name}: {len(points)} points ({spec.source}), {workers} workers; x axis {spec.x}", flush=True)
    t0 = time.perf_counter()
    cache = PlanCache(args.cache_dir)
    rows = run_points(points, workers=workers, cache=cache, progress=Progress(len(points)))
    wall = time.perf_counter() - t0
    if args.measure:
        measure_rows(spec.config, points, rows, cache, warmup=args.measure_warmup, steps=args.measure_steps)
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
    print(f"wrote {out}/rows.csv, {out}/table.md, {out}/sweep.svg\n{report.measured_note(rows)}")
    if args.measure:
        print(scatter_line(rows, out, spec.name))
    if not args.no_compare:
        print(best_vs_preset(points, rows, cache, out, workers=workers), flush=True)
    return 0


def scatter_line(rows: list[dict], out: str, name: str) -> str:
    """Draw DIR/scatter.svg (one point per distinct measured plan); the line saying where, how
    many, and Spearman's rho between predicted and measured (3 plans or more)."""
    points, dups = scatter_points(rows)
    if not points:
        return "scatter: none (no point was measured; the table's measurement column says why)"
    preds = sorted({r["predictor"] for r in rows if r.get("measured_ms") is not None})
    path = os.path.join(out, "scatter.svg")
    report.write_scatter(points, path, f"{name}: {' / '.join(preds)} vs measured ({len(points)} plans)")
    rho = (f"Spearman rho {rank_stats.spearman([p for _, p, _ in points], [m for _, _, m in points]):.3f}"
           if len(points) >= 3 else "no Spearman rho (fewer than 3 distinct plans)")
    same = "; duplicates: " + ", ".join(f"#{i} = #{j}" for i, j in dups.items()) if dups else ""
    return f"wrote {path} ({' / '.join(preds)} vs measured, {len(points)} distinct plans{same}); {rho}"


if __name__ == "__main__":
    raise SystemExit(main())
