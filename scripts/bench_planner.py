"""Planner benchmark: LLaMA 3 8B (seq 8192, local batch 2) on fake meshes with the h100 profile.

    python scripts/bench_planner.py [--meshes 8,4x8] [--flavor 8B] [--seq-len 8192] [--local-batch-size 2]

Each mesh runs in its own process (so peak RSS is per mesh) and reports trace,
candidate, build and solve seconds, ILP variables, objective and peak RSS.
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

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from models import build_model
    from parallel.auto._torch import Replicate, Shard
    from parallel.auto.api import AutoParallel, fake_world, lm_loss

    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s", stream=sys.stderr)
    sizes = tuple(int(x) for x in args.one.split("x"))
    names = ("dp", "tp")[: len(sizes)] if len(sizes) > 1 else ("dp",)
    world = math.prod(sizes)
    global_bs = args.local_batch_size * sizes[0]  # batch over the dp axis
    model = build_model("llama3", args.flavor, device="meta")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    t0 = time.perf_counter()
    with fake_world(world):
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        inputs = lambda: (torch.zeros(global_bs, args.seq_len, dtype=torch.long),) * 2  # noqa: E731
        with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, mp_policy=mp, hardware=args.hardware,
                          solver=args.solver, time_limit=args.time_limit) as autop:
            p = tuple(Shard(0) if i == 0 else Replicate() for i in range(len(sizes)))
            autop.add_input_constraints([p, p])
            plan = autop.optimize_placement(verbose=True)
    total = time.perf_counter() - t0
    return {
        "mesh": args.one, "trace_s": plan.timings["trace"], "candidates_s": plan.timings["candidates"],
        "build_s": plan.timings["build"], "solve_s": plan.timings["solve"], "total_s": total,
        "ilp_vars": plan.num_vars, "objective_us": plan.objective_us, "status": plan.status, "solver": plan.solver,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "global_batch": global_bs,
    }


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
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
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
    hdr = f"{'mesh':>6} {'trace s':>8} {'cand s':>7} {'build s':>8} {'solve s':>8} {'total s':>8} {'ILP vars':>9} {'objective µs':>14} {'status':>9} {'RSS MiB':>8}"
    print(hdr)
    for r in rows:
        print(f"{r['mesh']:>6} {r['trace_s']:8.1f} {r['candidates_s']:7.1f} {r['build_s']:8.1f} {r['solve_s']:8.1f} "
              f"{r['total_s']:8.1f} {r['ilp_vars']:9d} {r['objective_us']:14,.0f} {r['status']:>9} {r['peak_rss_mib']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
