"""tools/bench_planner.py's results: medians over runs, the JSON file of runs, and its tables."""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from tools.planner_jobs import STAGES


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def summarize(runs: list[dict]) -> dict:
    """Medians over a job's successful runs: wall, peak RSS, every stage."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": len(ok), "failed": len(runs) - len(ok)}
    if not ok:
        out["error"] = runs[-1].get("error") if runs else None
        return out
    out["wall_s"] = median([r["wall_s"] for r in ok])
    out["peak_rss_mib"] = median([r["peak_rss_mib"] for r in ok])
    out["stages"] = {s: median([r["stages"].get(s, 0.0) for r in ok]) for s in STAGES}
    out["walls"] = [round(r["wall_s"], 1) for r in ok]
    for key in ("objective_us", "status", "solver", "peak_gib", "redistribute_warnings", "meshes_total",
                "meshes_timed", "rows"):
        if key in ok[-1]:
            out[key] = ok[-1][key]
    return out


def _commit_of(code: str) -> str:
    try:
        rev = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", code, "status", "--porcelain", "--", "parallel", "models", "trainer"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return rev + ("+uncommitted" if dirty else "")


def load_results(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save_results(path: str, data: dict) -> None:
    """Write then rename: a run cut short leaves the previous file whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


_SHORT = {"candidates": "cands"}


def _fmt(x: float | None, spec: str = "{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def print_table(data: dict, title: str) -> None:
    """One row per job: process wall, the stage split, peak RSS (medians)."""
    print(f"\n{title} (code {data.get('code_commit', '?')}; medians of n runs; seconds; RSS: the job's process)")
    hdr = (f"{'job':>13} {'n':>2} {'wall':>7} " + " ".join(f"{_SHORT.get(s, s):>7}" for s in STAGES)
           + f" {'RSS MiB':>8} {'warn':>4}")
    print(hdr)
    print("-" * len(hdr))
    for name, s in data["summary"].items():
        if "stages" not in s:
            print(f"{name:>13} {s['runs']:>2} failed: {s.get('error')}")
            continue
        print(f"{name:>13} {s['runs']:>2} {s['wall_s']:7.1f} " + " ".join(f"{_fmt(s['stages'][k]):>7}" for k in STAGES)
              + f" {_fmt(s['peak_rss_mib'], '{:,.0f}'):>8} {s.get('redistribute_warnings', 0):>4}")
    for name, s in data["summary"].items():
        if "meshes_total" in s:  # a mesh search sample: its meshes (the last run's)
            print(f"{name}: {s['meshes_timed']} of the search's {s['meshes_total']} meshes planned in one process: "
                  + ", ".join(f"{r['mesh']} lb {r['local_batch']} {r['status']} {_fmt(r['plan_s'])}s"
                              for r in s.get("rows", [])))


def print_layers(data: dict) -> None:
    """Planning time against the layer count (8B dims on 4x8), per stage and per layer."""
    import re

    rows = []
    for name, s in data["summary"].items():
        m = re.fullmatch(r"8b-4x8-L(\d+)(-nolimit)?", name)
        if m and "stages" in s:
            rows.append((int(m.group(1)), "*" if m.group(2) else "", s))
    full = data["summary"].get("8b-4x8", {})
    if rows and "stages" in full and all(n != 32 or lab for n, lab, _ in rows):
        rows.append((32, "", full))  # the 8b-4x8 job is the 32-layer row
    rows.sort(key=lambda r: (r[0], r[1]))
    if not rows:
        return
    print("\nplanning time vs layers: LLaMA 3 8B dims on 4x8 (seq 8192, local batch 2); seconds, medians")
    hdr = (f"{'layers':>6} {'wall':>7} " + " ".join(f"{_SHORT.get(s, s):>7}" for s in STAGES)
           + f" {'s/layer':>8} {'RSS MiB':>8}")
    print(hdr)
    print("-" * len(hdr))
    for n, lab, s in rows:
        print(f"{str(n) + lab:>6} {s['wall_s']:7.1f} " + " ".join(f"{_fmt(s['stages'][k]):>7}" for k in STAGES)
              + f" {s['wall_s'] / n:8.2f} {_fmt(s['peak_rss_mib'], '{:,.0f}'):>8}")
    if any(lab for _, lab, _ in rows):
        print("  *: planned without the memory limit (--no-memory-limit; the estimate still runs)")


def print_compare(before: dict, after: dict) -> None:
    """Before and after in one table: per job and stage, before / after and before:after."""
    print(f"\nbefore: code {before.get('code_commit', '?')}, after: code {after.get('code_commit', '?')}; "
          f"medians, seconds; x = before / after (> 1: faster now)")
    hdr = f"{'job':>13} {'what':>10} {'before':>9} {'after':>9} {'x':>6}"
    print(hdr)
    print("-" * len(hdr))
    for name in [n for n in before["summary"] if n in after["summary"]]:
        b, a = before["summary"][name], after["summary"][name]
        if "stages" not in b or "stages" not in a:
            print(f"{name:>13} {'failed':>10} {b.get('error') or '':>9} {a.get('error') or '':>9}")
            continue
        rows = [("wall", b["wall_s"], a["wall_s"])] + [(k, b["stages"][k], a["stages"][k]) for k in STAGES]
        rows.append(("RSS MiB", b["peak_rss_mib"], a["peak_rss_mib"]))
        for i, (what, x, y) in enumerate(rows):
            ratio = f"{x / y:6.2f}" if x and y and x >= 0.05 and y >= 0.05 else "     -"
            print(f"{name if i == 0 else '':>13} {what:>10} {_fmt(x):>9} {_fmt(y):>9} {ratio}")
        print(f"{'':>13} {'runs':>10} {b['runs']:>9} {a['runs']:>9}")


def _to(x: float | None, fmt: str = "{:,.1f}") -> str:
    return "T/O" if x is None else fmt.format(x)


def print_table3(args: argparse.Namespace, meshes: str, results: dict[tuple[str, str], dict | None]) -> None:
    """Table 3: per mesh, the exact-ILP arm beside the seeded-MRF arm (T/O: killed)."""
    print(f"\nTable 3: solver scalability on LLaMA 3 {args.flavor} (seq {args.seq_len}, {args.hardware}); "
          f"ILP arm killed after {args.ilp_timeout:.0f}s; objectives in µs; total = planning wall s incl. tracing, "
          f"proc = the MRF arm's whole process (start-up and exit too)")
    hdr = (f"{'mesh':>9} {'ILP vars':>11} | {'build ILP':>9} {'build MRF':>9} | {'solve ILP':>9} {'solve MRF':>9} | "
           f"{'obj ILP':>11} {'obj MRF':>11} {'gap':>7} | "
           f"{'total ILP':>10} {'total MRF':>10} {'CPU MRF':>8} {'proc MRF':>8} | "
           f"{'RSS ILP':>8} {'RSS MRF':>8}")
    print(hdr)
    print("-" * len(hdr))
    for mesh in meshes.split(","):
        a, b = results.get((mesh, "ilp")), results.get((mesh, "approx"))
        if a is not None:
            nv = f"{a['vars']:,}"
        elif b is not None and b["vars_estimate"]:
            nv = f"~{b['vars_estimate']:,}"
        else:
            nv = "?"
        gap = f"{b['objective_us'] / a['objective_us'] - 1:+.3%}" if a and b else "-"
        print(f"{mesh:>9} {nv:>11} | {_to(a and a['build_s']):>9} {_to(b and b['build_s']):>9} | "
              f"{_to(a and a['solve_s']):>9} {_to(b and b['solve_s']):>9} | {_to(a and a['objective_us']):>11} "
              f"{_to(b and b['objective_us']):>11} {gap:>7} | {_to(a and a['total_s']):>10} "
              f"{_to(b and b['total_s']):>10} "
              f"{_to(b and b['cpu_s']):>8} {_to(b and b['wall_s']):>8} | "
              f"{_to(a and a['peak_rss_mib'], '{:,.0f}M'):>8} {_to(b and b['peak_rss_mib'], '{:,.0f}M'):>8}")

