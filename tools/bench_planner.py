"""Planner benchmark: LLaMA 3 8B (seq 8192, local batch 2) on fake meshes with the h100 profile.

    python scripts/bench_planner.py [--meshes 8,4x8] [--flavor 8B] [--seq-len 8192] [--local-batch-size 2]

Each mesh runs in its own process (so peak RSS is per mesh) and reports trace,
candidate, build and solve seconds, ILP variables, objective and peak RSS.

    python scripts/bench_planner.py --table3 [--meshes 1x8,4x8,4x2x4,2x2x2x4] [--ilp-timeout 600]

grows the paper's Table 3 (solver scalability): per mesh, an exact-ILP arm (unseeded,
full enumeration) and an approximate arm (MRF; split-dimension seeding from 3-D), each
in its own process; the ILP arm is killed after --ilp-timeout seconds ("T/O"). Columns:
decision variables of the unseeded ILP (estimated from the 1-D menus, "~", where the
ILP arm did not get that far), build (candidates + seeding + problem) and solve seconds,
objectives, end-to-end wall and CPU seconds (tracing included) and peak RSS per arm.
Axis names: 1-D dp; 2-D dp, tp; 3-D dp, cp, tp; 4-D dp_replicate, dp_shard, cp, tp;
inputs batch-sharded over the dp* axes (global batch = local batch x their product).

    python scripts/bench_planner.py --jobs 8b-4x8,3b-1x8,3b-2x4 --repeat 3 --json after.json [--compare before.json]
    python scripts/bench_planner.py --layers 8,16,32,64,128 --json layers.json
    python scripts/bench_planner.py --search 32:3 --json search.json   # 3 of the 32-device mesh search's meshes
    python scripts/bench_planner.py --code /tmp/base --jobs 8b-4x8 --json before.json   # an older tree's planner

issue 25's jobs (JOBS: 8B 4x8, 3B-shaped LLaMA 3 on 1x8 and 2x4, DeepSeek-V3 16B 8x8, 8B
4x2x4 (the 3-D seeded build), 70B 8x4x2, 8B 2x2x2x4; the default planner settings on the h100
profile, memory estimate on),
each in a fresh process timed from the parent: the whole process's wall clock and peak RSS,
and its stages (STAGES: start-up, trace, candidates, seeding, build, solve, memory estimate,
apply-ready = apply_placement on the fake world, the rest, exit), the median of --repeat
runs. --json keeps every run (a job's runs add up over invocations); --compare BEFORE.json
prints BEFORE and these results side by side with ratios (no --jobs: the files only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tools.planner_jobs import JOBS, run_arm, run_job, run_one, run_search_sample
from tools.planner_runs import ROOT, jobs_main, meshes_main, table3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshes", default="8,4x8")
    ap.add_argument("--flavor", default="8B")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--local-batch-size", type=int, default=2)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--solver", default="auto")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--arm", default=None, choices=["ilp", "approx"], help=argparse.SUPPRESS)
    ap.add_argument("--table3", action="store_true", help="the paper's Table 3: exact ILP vs seeded MRF per mesh")
    ap.add_argument("--ilp-timeout", type=float, default=600.0, help="table3: kill the ILP arm after this many s")
    ap.add_argument("--seed-rounds", type=int, default=1, help="table3: seeding rounds of the MRF arm (3-D and up)")
    ap.add_argument("--approx-timeout", type=float, default=1800.0, help="table3: kill the MRF arm after this many s")
    ap.add_argument("--jobs", default=None,
                    help=f"issue 25's jobs, comma-separated, each in its own process: {', '.join(JOBS)}")
    ap.add_argument("--layers", default=None, help="8B dims on 4x8 at these layer counts, e.g. 8,16,32,64,128")
    ap.add_argument("--search", default=None, metavar="WORLD:K",
                    help="time K of the meshes the mesh search plans for WORLD devices (one process, one worker)")
    ap.add_argument("--search-config", default="llama3_8b",
                    help="--search: the job config (as `plan.py --config llama3_8b --mesh auto --hardware h100`)")
    ap.add_argument("--no-memory-limit", action="store_true",
                    help="--layers: plan without the memory limit (estimate on): a plan that does not fit is timed")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each job (medians reported)")
    ap.add_argument("--json", default=None, help="write the runs and medians here (runs of a job already there add up)")
    ap.add_argument("--compare", default=None, metavar="BEFORE.json",
                    help="print BEFORE and these results in one table")
    ap.add_argument("--code", default=ROOT, help="the source tree to time (e.g. a git worktree of an older commit)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="kill a job's process after this many seconds")
    ap.add_argument("--log-dir", default=None, help="keep each job process's log (stderr) here")
    ap.add_argument("--job-spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job_spec:
        spec = json.loads(args.job_spec)
        res = run_search_sample(spec) if spec.get("search") else run_job(spec)
        res["t_end"] = time.time()
        print("RESULT " + json.dumps(res), flush=True)
        return 0  # a normal exit: its teardown is the job's "exit" stage
    if args.jobs or args.layers or args.search or args.compare:
        return jobs_main(args)
    if args.one and args.arm:
        print("RESULT " + json.dumps(run_arm(args)), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip tearing down the planner's caches (seconds on 4-D); nothing is left to write
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    if args.table3:
        return table3(args)
    return meshes_main(args)


if __name__ == "__main__":  # a job's process (python -m tools.bench_planner --job-spec ...)
    try:  # the tree being timed (--code) decides how its job process exits
        from parallel.process_exit import exit_with
    except ImportError:  # an older tree: the plain exit
        raise SystemExit(main()) from None
    exit_with(main)
