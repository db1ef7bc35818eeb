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
import math
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.environ.get("BENCH_PLANNER_CODE", ROOT))  # --code: the tree whose planner is timed


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


# ---------------------------------------------------------------------------
# --jobs: issue 25's planner jobs, whole process each, medians of --repeat runs
# ---------------------------------------------------------------------------

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


def launch(name: str, spec: dict, code: str, timeout: float, log_dir: str | None) -> dict:
    """Run one job in a fresh process on the code tree `code`; the parent measures its wall
    clock (launch -> reaped) and its peak RSS (wait4's, the child alone)."""
    import tempfile

    env = dict(os.environ, BENCH_PLANNER_CODE=code)
    cmd = [sys.executable, os.path.abspath(__file__), "--job-spec", json.dumps(spec)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t_launch = time.time()
        w0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=code, env=env, text=True)
        status, usage, timed_out = 0, None, False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - w0 > timeout:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.05)
        wall = time.perf_counter() - w0
        t_reaped = time.time()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"{name}.{int(t_launch)}.log"), "w") as f:
            f.write(stderr)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    r: dict = {"job": name, "spec": spec, "wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024 if usage else None,
               "redistribute_warnings": stderr.count(REDISTRIBUTE_WARNING), "returncode": proc.returncode}
    if line is None:
        r["error"] = "timed out" if timed_out else (stderr.strip().splitlines() or ["no output"])[-1][:500]
        r["stderr_tail"] = stderr[-3000:]
        return r
    res = json.loads(line[len("RESULT "):])
    st = dict(res.pop("stages"))
    st["startup"] = res.pop("t_plan0") - t_launch  # interpreter, imports, model build
    st["exit"] = t_reaped - res.pop("t_end")  # teardown after RESULT
    r.update(res, stages=st)
    return r


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


def jobs_main(args: argparse.Namespace) -> int:
    specs: dict[str, dict] = {}
    for name in [n for n in (args.jobs or "").split(",") if n]:
        if name not in JOBS:
            raise SystemExit(f"unknown job {name!r}; known: {', '.join(JOBS)}")
        specs[name] = JOBS[name]
    for n in [int(x) for x in (args.layers or "").split(",") if x]:
        name, spec = layer_job(n, args.no_memory_limit)
        specs[name] = spec
    if args.search:
        world, k = (int(x) for x in args.search.split(":"))
        specs[f"search{world}-k{k}"] = dict(search=True, config=args.search_config, world=world, k=k)
    code = os.path.abspath(args.code)
    data = load_results(args.json) if args.json and os.path.exists(args.json) else {"runs": {}}
    if specs and data.get("code_commit") not in (None, _commit_of(code)):
        print(f"note: {args.json} holds runs of code {data['code_commit']}; adding runs of {_commit_of(code)}")
    if specs:
        data["code"], data["code_commit"] = code, _commit_of(code)
    for rep in range(args.repeat):
        for name, spec in specs.items():
            print(f"== {name} (run {rep + 1}/{args.repeat}) on {data['code_commit']} ...", flush=True)
            r = launch(name, spec, code, args.timeout, args.log_dir)
            r["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            data["runs"].setdefault(name, []).append(r)
            if "error" in r:
                print(f"   failed: {r['error']}\n{r.get('stderr_tail', '')[-1500:]}", flush=True)
            else:
                print(f"   wall {r['wall_s']:.1f}s, " + ", ".join(f"{k} {v:.1f}" for k, v in r["stages"].items())
                      + f"; RSS {r['peak_rss_mib']:,.0f} MiB; {r['redistribute_warnings']} redistribute warnings",
                      flush=True)
            data["summary"] = {n: summarize(rs) for n, rs in data["runs"].items()}
            if args.json:
                save_results(args.json, data)
    data["summary"] = {n: summarize(rs) for n, rs in data["runs"].items()}
    if data["summary"]:
        print_table(data, "planner jobs")
        print_layers(data)
    if args.compare:
        print_compare(load_results(args.compare), data)
    return 0 if all("error" not in r for n in specs for r in data["runs"].get(n, [])) else 1


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
    args = ap.parse_args()
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
    try:  # the tree being timed (--code) decides how its job process exits
        from parallel.process_exit import exit_with
    except ImportError:  # an older tree: the plain exit
        sys.exit(main())
    exit_with(main)
