"""What runs inside one process of tools/bench_planner.py: a mesh (--one), a Table 3 arm,
one of issue 25's jobs or a mesh search sample; each returns the figures its parent reads
(printed as a RESULT line). The planner comes from the tree the process was started on
(--code: tools/planner_runs.py puts it first on the path)."""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time


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
    names = _TABLE3_NAMES[len(sizes)]
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


LLAMA_3B = {"dim": 3072, "n_layers": 28, "n_heads": 24, "n_kv_heads": 8, "ffn_hidden_dim": 8192}
"""LLaMA 3 at Llama 3.2 3B's shape (3.2B parameters): the <= 7B model of the 1x8 / 2x4 jobs
(models/ has no flavor that small; TP 8 divides its 24 query and 8 key/value heads)."""


JOBS: dict[str, dict] = {
    "8b-4x8": dict(model="llama3", flavor="8B", mesh=(4, 8), names=("dp", "tp"), seq=8192, lbs=2),
    "3b-1x8": dict(model="llama3", flavor="8B", args=LLAMA_3B, mesh=(8,), names=("tp",), seq=8192, lbs=2),
    "3b-2x4": dict(model="llama3", flavor="8B", args=LLAMA_3B, mesh=(2, 4), names=("dp", "tp"), seq=8192, lbs=2),
    "dsv3-8x8": dict(model="deepseek_v3", flavor="16B", mesh=(8, 8), names=("dp", "tp"), seq=4096, lbs=1),
    "8b-4x2x4": dict(model="llama3", flavor="8B", mesh=(4, 2, 4), names=("dp", "cp", "tp"), seq=8192, lbs=2),
    "70b-8x4x2": dict(model="llama3", flavor="70B", mesh=(8, 4, 2), names=("dp", "cp", "tp"), seq=8192, lbs=1),
    "8b-2x2x2x4": dict(model="llama3", flavor="8B", mesh=(2, 2, 2, 4), names=("dp_replicate", "dp_shard", "cp", "tp"),
                       seq=8192, lbs=2),
    "debug-2x4": dict(model="llama3", flavor="debug", mesh=(2, 4), names=("dp", "tp"), seq=512, lbs=2),  # smoke run
}
"""Issue 25's jobs: model (family, flavor, argument overrides), mesh sizes and axis names,
sequence, local batch (global = local x the data axes' sizes, as the trainer feeds it)."""


STAGES = ("startup", "trace", "candidates", "seed", "build", "solve", "memory", "apply", "other", "exit")
"""A job's process, in order: python + imports + model build (startup), the planner's stages
(plan.timings: seeding includes its own problems and solves; build and solve sum every
problem, re-seeded and memory re-solved ones too), the memory estimate, apply-ready
(apply_placement on the fake world: the ParallelModule with DTensor parameters, ready for
its first step), the rest of planning (other), and exit (RESULT printed -> process reaped)."""


REDISTRIBUTE_WARNING = "sequential all_gather operations will be performed"
"""Part of torch's per-redistribution warning (issue 25: printed dozens of times)."""


def layer_job(n_layers: int, no_limit: bool = False) -> tuple[str, dict]:
    """The 8B-on-4x8 job with `n_layers` layers (the flavor's other dimensions kept);
    `no_limit`: no memory limit (the estimate still runs; a plan over 80 GiB is not re-solved)."""
    spec = dict(JOBS["8b-4x8"], args={"n_layers": n_layers})
    if no_limit:
        spec["memory_limit_gib"] = math.inf
    return f"8b-4x8-L{n_layers}" + ("-nolimit" if no_limit else ""), spec


def run_job(spec: dict) -> dict:
    """One job in this process: plan with the default planner settings (hardware h100, memory
    estimate on) exactly as the trainer asks (parallel/auto/request.py), then apply."""
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from models import build_model
    from parallel.auto.api import fake_world
    from parallel.auto.config import PlannerConfig
    from parallel.auto.request import PlanRequest, planning
    from parallel.precision import mixed_precision_policy

    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s", stream=sys.stderr)
    model = build_model(spec["model"], spec["flavor"], device="meta", **spec.get("args", {}))
    params = sum(p.numel() for p in model.parameters())
    mp = mixed_precision_policy("bfloat16", "float32")
    request = PlanRequest(local_batch_size=spec["lbs"], seq_len=spec["seq"],
                          planner=PlannerConfig(hardware=spec.get("hardware", "h100"),
                                                memory_limit_gib=spec.get("memory_limit_gib")), mp_policy=mp)
    sizes = tuple(spec["mesh"])
    t_plan0, t0 = time.time(), time.perf_counter()
    with fake_world(math.prod(sizes)):
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=tuple(spec["names"]))
        with planning(model, mesh, request) as autop:
            plan = autop.optimize_placement(verbose=True)
            t1 = time.perf_counter()
            autop.apply_placement(plan)  # apply-ready: what a rank does before its first step
            t2 = time.perf_counter()
    planning_s, t_end = t1 - t0, time.perf_counter()
    t = {k: float(v) for k, v in plan.timings.items()}
    stages = {"trace": t.get("trace", 0.0), "candidates": t.get("candidates", 0.0),
              "seed": t.get("seed", 0.0) + t.get("reseed", 0.0), "build": t.get("build", 0.0),
              "solve": t.get("solve", 0.0), "memory": t.get("memory", 0.0), "apply": t2 - t1}
    # re-seeding rounds (split_seeding_rounds > 1; off by default) fall in other: their time
    # holds their own build and solve, which are counted as build and solve
    stages["other"] = max(0.0, (t_end - t0) - sum(stages.values()))  # and leaving the fake world
    est = plan.memory
    return {"stages": stages, "planning_s": planning_s, "apply_s": t2 - t1, "t_plan0": t_plan0, "timings": t,
            "objective_us": plan.objective_us, "status": plan.status,
            "solver": plan.solver, "num_vars": plan.num_vars, "params": params,
            "peak_gib": est.peak_bytes / 2**30 if est is not None else None,
            "fits": est.fits if est is not None else None, "threads": torch.get_num_threads(),
            "rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_search_sample(spec: dict) -> dict:
    """Mesh search sample: `k` of the meshes `scripts/plan.py --mesh auto --world-size N`
    plans (evenly spaced in its order), planned in this process as its one-worker search
    plans them (fresh plan cache, joint graph reused between meshes of one trace key)."""
    import logging
    import tempfile

    from parallel.auto.search.mesh_search import search_points
    from parallel.auto.search.point import PlanCache
    from parallel.auto.search.run import run_points
    from trainer.auto_mode import load_base_job

    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s", stream=sys.stderr)
    points = search_points(load_base_job(spec["config"]), spec["world"], spec.get("hardware", "h100"))
    k = min(spec["k"], len(points))
    picked = [points[round(i * (len(points) - 1) / max(1, k - 1))] for i in range(k)]
    t_plan0, t0 = time.time(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_points(picked, workers=1, cache=PlanCache(tmp))
    planning_s = time.perf_counter() - t0
    return {"stages": {"other": planning_s}, "planning_s": planning_s, "t_plan0": t_plan0,
            "meshes_total": len(points), "meshes_timed": k,
            "rows": [{"mesh": r.get("mesh"), "status": r.get("status"), "plan_s": r.get("plan_s"),
                      "local_batch": r.get("local_batch"), "timings": r.get("timings")} for r in rows],
            "rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
