"""A new user's first and second run: is the step time the main job predicts the one it measures?

    python scripts/bench_first_run.py                     # 3 pairs with a loaded core, 3 without
    python scripts/bench_first_run.py --pairs 5 --steps 20 --config llama3_debug_auto.toml

Each pair starts from an empty cache folder (`AUTOTITAN_CACHE`), as on a fresh machine:

1. the first run of README command 1 (`torchrun --nproc_per_node=2 train.py --config ...`),
   with `hardware = "auto"` calibrating this machine; under "loaded", a second process
   spins on one core for the whole run (a user's other work);
2. the second run of the same command, nothing else running: it plans with the cached
   profile and the correction the first run recorded (cost/correction.py) when its
   measured / predicted step was off by more than 25 %.

Each run's log line `measured / predicted = R` (after the warm-up) is read; the table gives
every pair and the medians per condition, pairs of the two conditions alternated so that
machine drift hits both. Goal (issue 52): the first run within 0.8-1.25, the second within
0.9-1.1, both as medians; exit 1 when not met. Every run is a fresh job folder.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RATIO = re.compile(r"step time: .*?measured / predicted = ([\d.]+)")
CORRECTION = re.compile(r"recorded step_time_ratio = ([\d.]+)")
FIRST, SECOND = (0.8, 1.25), (0.9, 1.1)


def _run(config: str, steps: int, cache: str, folder: str, load: bool) -> tuple[float | None, str, float]:
    """(measured / predicted, the correction recorded or "", seconds) of one run."""
    env = dict(os.environ, AUTOTITAN_CACHE=cache)
    cmd = ["torchrun", "--nproc_per_node=2", "train.py", "--config", config, "--training.steps", str(steps),
           "--job.dump_folder", folder, "--checkpoint.enable", "false"]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load else None
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    log = out.stdout + out.stderr
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "run.log").write_text(log)  # kept while the bench runs (--keep: after it)
    if out.returncode != 0:
        print(log[-3000:], file=sys.stderr)
        raise SystemExit(f"run failed (exit {out.returncode}): {' '.join(cmd)}")
    ratio, corr = RATIO.search(log), CORRECTION.search(log)
    return (float(ratio.group(1)) if ratio else None), (corr.group(1) if corr else ""), time.perf_counter() - t0


def _pair(args: argparse.Namespace, load: bool, k: int, root: Path) -> dict:
    cache = str(root / f"cache-{'loaded' if load else 'quiet'}-{k}")
    first = _run(args.config, args.steps, cache, str(root / f"run1-{load}-{k}"), load)
    second = _run(args.config, args.steps, cache, str(root / f"run2-{load}-{k}"), False)
    row = {"condition": "loaded" if load else "quiet", "pair": k, "first": first[0], "recorded": first[1],
           "second": second[0], "recorded_2": second[1], "seconds": first[2] + second[2]}
    print(f"  {row['condition']:6s} pair {k}: first {row['first']}, recorded {row['recorded'] or '-'}; second "
          f"{row['second']}{', recorded ' + row['recorded_2'] if row['recorded_2'] else ''} "
          f"({row['seconds']:.0f} s)", flush=True)
    return row


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.median(vals) if vals else None


def report(rows: list[dict]) -> int:
    """The table of medians per condition and the goal; 0 when met, 1 when not."""
    print("\n| condition | pairs | first run: measured / predicted | second run |")
    print("|---|---|---|---|")
    met = True
    for cond in ("loaded", "quiet"):
        mine = [r for r in rows if r["condition"] == cond]
        if not mine:
            continue
        a, b = _median(mine, "first"), _median(mine, "second")
        print(f"| {cond} | {len(mine)} | {a} ({', '.join(str(r['first']) for r in mine)}) | "
              f"{b} ({', '.join(str(r['second']) for r in mine)}) |")
        met &= a is not None and b is not None and FIRST[0] <= a <= FIRST[1] and SECOND[0] <= b <= SECOND[1]
    print(f"\ngoal (first run within {FIRST[0]}-{FIRST[1]}, second within {SECOND[0]}-{SECOND[1]}, medians): "
          f"{'met' if met else 'NOT met'}")
    return 0 if met else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3_debug_auto.toml")
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs per condition (default 3)")
    p.add_argument("--steps", type=int, default=20, help="steps per run (the prediction is checked at step 7)")
    p.add_argument("--conditions", default="loaded,quiet", help="loaded, quiet or both (default)")
    p.add_argument("--keep", default="", help="a folder to keep every run's folder and log in (default: none)")
    args = p.parse_args(argv)
    conds = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if not conds or set(conds) - {"loaded", "quiet"}:
        p.error(f"--conditions {args.conditions!r}: give loaded, quiet or loaded,quiet")
    rows = []
    with tempfile.TemporaryDirectory(prefix="first-run-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        for k in range(args.pairs):
            for cond in conds:
                rows.append(_pair(args, cond == "loaded", k, root))
    return report(rows)


__all__ = ["main", "report"]
