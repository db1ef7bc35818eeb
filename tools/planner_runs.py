"""tools/bench_planner.py's parent process: every mesh, arm or job in a fresh child process
(`python -m tools.bench_planner` with a hidden flag), timed from here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.planner_jobs import JOBS, REDISTRIBUTE_WARNING, layer_job
from tools.planner_report import (
    _commit_of,
    load_results,
    print_compare,
    print_layers,
    print_table,
    print_table3,
    save_results,
    summarize,
)

ROOT = str(Path(__file__).resolve().parents[1])


def code_env(code: str) -> dict[str, str]:
    """The environment of a job process on the tree `code` (--code): that tree first on the path,
    then this one (for `tools` when `code` is an older tree without it)."""
    paths = [code, ROOT, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def table3(args: argparse.Namespace) -> int:
    meshes = args.meshes if args.meshes != "8,4x8" else "1x8,4x8,4x2x4,2x2x2x4"
    results: dict[tuple[str, str], dict | None] = {}
    for mesh in meshes.split(","):
        for arm in ("ilp", "approx"):
            cmd = [sys.executable, "-m", "tools.bench_planner", "--one", mesh, "--arm", arm, "--flavor", args.flavor,
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

    print_table3(args, meshes, results)
    return 0


def launch(name: str, spec: dict, code: str, timeout: float, log_dir: str | None) -> dict:
    """Run one job in a fresh process on the code tree `code`; the parent measures its wall
    clock (launch -> reaped) and its peak RSS (wait4's, the child alone)."""
    import tempfile

    cmd = [sys.executable, "-m", "tools.bench_planner", "--job-spec", json.dumps(spec)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t_launch = time.time()
        w0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=code, env=code_env(code), text=True)
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


def meshes_main(args: argparse.Namespace) -> int:
    """The default table: each of --meshes planned in its own process (--one)."""
    rows = []
    for mesh in args.meshes.split(","):
        cmd = [sys.executable, "-m", "tools.bench_planner", "--one", mesh, "--flavor", args.flavor,
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
