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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def run_one(args: argparse.Namespace) -> dict:
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    from models import build_model
    from parallel.auto.api import fake_world
    from parallel.auto.config import PlannerConfig
    from parallel.auto.request import PlanRequest, planning
    from parallel.precision import mixed_precision_policy

    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s", stream=sys.stderr)
    sizes = tuple(int(x) for x in args.one.split("x"))
    names = ("dp", "tp")[: len(sizes)] if len(sizes) > 1 else ("dp",)
    world = math.prod(sizes)
    global_bs = args.local_batch_size * sizes[0]  # batch over the dp axis
    model = build_model("llama3", args.flavor, device="meta")
    mp = mixed_precision_policy("bfloat16", "float32")
    planner = PlannerConfig(hardware=args.hardware, solver=args.solver, time_limit=args.time_limit)
    request = PlanRequest(local_batch_size=args.local_batch_size, seq_len=args.seq_len, planner=planner, mp_policy=mp)
    t0 = time.perf_counter()
    with fake_world(world):
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        with planning(model, mesh, request) as autop:
            plan = autop.optimize_placement(verbose=True)
    total = time.perf_counter() - t0
    return {
        "mesh": args.one, "trace_s": plan.timings["trace"], "candidates_s": plan.timings["candidates"],
        "build_s": plan.timings["build"], "solve_s": plan.timings["solve"], "total_s": total,
        "memory_s": plan.timings.get("memory", 0.0),
        "ilp_vars": plan.num_vars, "objective_us": plan.objective_us, "status": plan.status, "solver": plan.solver,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "global_batch": global_bs,
    }


_TABLE3_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp"), 4: ("dp_replicate", "dp_shard", "cp", "tp")}


def run_arm(args: argparse.Namespace) -> dict:
    """One Table 3 arm ("ilp": unseeded exact ILP; "approx": MRF, seeded from 3-D) on one mesh."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    from models import build_model
    from parallel.auto.api import fake_world
    from parallel.auto.config import PlannerConfig
    from parallel.auto.request import PlanRequest, planning
    from parallel.precision import mixed_precision_policy

    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s", stream=sys.stderr)
    sizes = tuple(int(x) for x in args.one.split("x"))
    kept = tuple(s for s in sizes if s > 1) or (sizes[-1],)
    names = _TABLE3_NAMES[len(kept)]
    dp = [i for i, n in enumerate(names) if n.startswith("dp")]
    world = math.prod(kept)
    global_bs = args.local_batch_size * math.prod(kept[i] for i in dp)  # as the request builder splits it
    model = build_model("llama3", args.flavor, device="meta")
    mp = mixed_precision_policy("bfloat16", "float32")
    ilp = args.arm == "ilp"
    planner = PlannerConfig(hardware=args.hardware, solver="ilp" if ilp else "mrf", time_limit=args.time_limit,
                            split_seeding=False if ilp else None, split_seeding_rounds=args.seed_rounds)
    request = PlanRequest(local_batch_size=args.local_batch_size, seq_len=args.seq_len, planner=planner, mp_policy=mp)
    t0, c0 = time.perf_counter(), time.process_time()
    with fake_world(world):
        mesh = init_device_mesh("cpu", kept, mesh_dim_names=names)
        with planning(model, mesh, request) as autop:
            plan = autop.optimize_placement(verbose=True)
    prob = autop.problem
    t = plan.timings
    return {
        "mesh": args.one, "arm": args.arm, "trace_s": t.get("trace", 0.0),
        "build_s": t.get("candidates", 0.0) + t.get("seed", 0.0) + t.get("build", 0.0), "seed_s": t.get("seed", 0.0),
        "solve_s": t["solve"], "total_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
        "vars": (prob.num_node_vars() + prob.num_edge_vars()) if prob is not None else plan.num_vars,
        "seed_rounds": getattr(autop.seed_info, "rounds", 0) if autop.seed_info else 0,
        "reseed_s": t.get("reseed", 0.0),
        "vars_estimate": getattr(autop.seed_info, "unseeded_vars_estimate", 0) if autop.seed_info else 0,
        "decisions": prob.num_groups if prob is not None else 0,
        "nodes": sum(len(g) for g in prob.groups) if prob is not None else 0,
        "objective_us": plan.objective_us, "status": plan.status, "solver": plan.solver,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "global_batch": global_bs,
    }


def table3(args: argparse.Namespace) -> int:
    meshes = args.meshes if args.meshes != "8,4x8" else "1x8,4x8,4x2x4,2x2x2x4"
    results: dict[tuple[str, str], dict | None] = {}
    for mesh in meshes.split(","):
        for arm in ("ilp", "approx"):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", mesh, "--arm", arm, "--flavor", args.flavor,
                   "--seq-len", str(args.seq_len), "--local-batch-size", str(args.local_batch_size),
                   "--hardware", args.hardware, "--time-limit", str(args.time_limit),
                   "--seed-rounds", str(args.seed_rounds)]
            print(f"== llama3 {args.flavor} on mesh {mesh}: {arm} arm ...", flush=True)
            timeout = args.ilp_timeout if arm == "ilp" else args.approx_timeout
            w0 = time.perf_counter()
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"   {arm} arm: T/O after {timeout:.0f}s", flush=True)
                results[(mesh, arm)] = None
                continue
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(out.stdout[-2000:], out.stderr[-4000:])
                results[(mesh, arm)] = None
                continue
            r = json.loads(line[len("RESULT "):])
            r["wall_s"] = time.perf_counter() - w0  # the whole process: start-up, planning, exit
            results[(mesh, arm)] = r
            print(f"   {arm}: objective {r['objective_us']:,.1f} µs ({r['solver']}, {r['status']}), "
                  f"build {r['build_s']:.1f}s, "
                  f"solve {r['solve_s']:.1f}s, planning {r['total_s']:.1f}s wall / {r['cpu_s']:.1f}s CPU, "
                  f"process {r['wall_s']:.1f}s, "
                  f"{r['nodes']:,} nodes -> {r['decisions']:,} decisions, RSS {r['peak_rss_mib']:.0f} MiB", flush=True)

    def f(x: float | None, fmt: str = "{:,.1f}") -> str:
        return "T/O" if x is None else fmt.format(x)

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
        print(f"{mesh:>9} {nv:>11} | {f(a and a['build_s']):>9} {f(b and b['build_s']):>9} | "
              f"{f(a and a['solve_s']):>9} {f(b and b['solve_s']):>9} | {f(a and a['objective_us']):>11} "
              f"{f(b and b['objective_us']):>11} {gap:>7} | {f(a and a['total_s']):>10} {f(b and b['total_s']):>10} "
              f"{f(b and b['cpu_s']):>8} {f(b and b['wall_s']):>8} | "
              f"{f(a and a['peak_rss_mib'], '{:,.0f}M'):>8} {f(b and b['peak_rss_mib'], '{:,.0f}M'):>8}")
    return 0


def main() -> int:
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
    args = ap.parse_args()
    if args.one and args.arm:
        print("RESULT " + json.dumps(run_arm(args)), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip tearing down the planner's caches (seconds on 4-D); nothing is left to write
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    if args.table3:
        return table3(args)
    rows = []
    for mesh in args.meshes.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", mesh, "--flavor", args.flavor,
               "--seq-len", str(args.seq_len), "--local-batch-size", str(args.local_batch_size),
               "--hardware", args.hardware, "--solver", args.solver, "--time-limit", str(args.time_limit)]
        print(f"== llama3 {args.flavor} on mesh {mesh} ...", flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(out.stdout[-2000:], out.stderr[-4000:])
            return 1
        rows.append(json.loads(line[len("RESULT "):]))
    hdr = (f"{'mesh':>6} {'trace s':>8} {'cand s':>7} {'build s':>8} {'solve s':>8} {'total s':>8} "
           f"{'ILP vars':>9} {'objective µs':>14} {'status':>9} {'RSS MiB':>8}")
    print(hdr)
    for r in rows:
        print(f"{r['mesh']:>6} {r['trace_s']:8.1f} {r['candidates_s']:7.1f} {r['build_s']:8.1f} {r['solve_s']:8.1f} "
              f"{r['total_s']:8.1f} {r['ilp_vars']:9d} {r['objective_us']:14,.0f} "
              f"{r['status']:>9} {r['peak_rss_mib']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
