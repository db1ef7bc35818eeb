#!/usr/bin/env python
"""Measure this machine and write a hardware profile TOML for the cost model.

    python scripts/calibrate.py --out configs/hardware/cpu_measured.toml [--world-size 2] [--quick]

What it measures (per rank, with the cores split between the ranks as in a real run):
  * matmul throughput per dtype (fp32, bf16, fp16)  -> [peak_tflops], efficiency.matmul = 1
  * copy bandwidth (bytes read + written)           -> memory_bandwidth_gbps, efficiency.memory = 1
  * a tiny elementwise op                           -> kernel_floor_us
  * gloo all-gather / reduce-scatter / all-reduce / all-to-all at two sizes on
    ``--world-size`` ranks; fits t = latency + S·(n−1)/n / busBW (all-reduce: 2·S·(n−1)/n)
                                                     -> [intra_node]
Measured figures are what kernels reach, so the efficiencies are written as 1.0.
With 2 ranks a ring has one step, so the fitted latency is split evenly between the
fixed ``latency_us`` and the per-step ``hop_latency_us``.
Everything else (inter-node link, gpus_per_node) is copied from ``--base`` (default cpu).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.auto.cost.hardware import COLLECTIVE_KINDS, load_hardware, profile_to_toml  # noqa: E402


def _time(fn, reps: int, warmup: int = 1) -> float:
    """Median seconds of fn()."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def measure_compute(threads: int, quick: bool = False) -> dict[str, float]:
    """Matmul TFLOP/s per dtype, copy GB/s and a tiny-op floor (µs) on ``threads`` threads."""
    torch.set_num_threads(max(1, threads))
    n = 512 if quick else 1536
    reps = 3 if quick else 5
    out: dict[str, float] = {}
    for key, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        t = _time(lambda: a @ b, reps)
        out[f"peak_tflops.{key}"] = 2 * n**3 / t / 1e12
    m = (4 if quick else 64) * 1024 * 1024 // 4
    x = torch.randn(m)
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), reps)
    out["memory_bandwidth_gbps"] = 2 * m * 4 / t / 1e9
    s = torch.randn(16)
    t = _time(lambda: [s.add(s) for _ in range(100)], reps)
    out["kernel_floor_us"] = t / 100 * 1e6
    return out


# torch 2.13 renamed the tensor collectives (*_into_tensor / *_tensor are deprecated)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _coll_worker(rank: int, world: int, init_file: str, sizes: list[int], reps: int, q) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        res = {}
        x = torch.zeros(16)
        for _ in range(5):  # gloo warm-up (connection setup)
            dist.all_reduce(x)
        for kind in COLLECTIVE_KINDS:
            for size in sizes:  # S bytes (nccl-tests size), fp32
                numel = max(world, size // 4 // world * world)
                full = torch.randn(numel)
                shard = torch.randn(numel // world)
                if kind == "all_gather":
                    fn = lambda: _all_gather(full, shard)  # noqa: E731
                elif kind == "reduce_scatter":
                    fn = lambda: _reduce_scatter(shard, full)  # noqa: E731
                elif kind == "all_reduce":
                    fn = lambda: dist.all_reduce(full)  # noqa: E731
                else:
                    outb = torch.empty_like(full)
                    fn = lambda: dist.all_to_all_single(outb, full)  # noqa: E731
                dist.barrier()
                res[(kind, numel * 4)] = _time(fn, reps, warmup=2)
        if rank == 0:
            q.put(res)
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, quick: bool = False) -> dict[tuple[str, int], float]:
    """Median seconds per (kind, bytes) of gloo collectives on ``world`` local ranks."""
    sizes = [4096, 256 * 1024, (1 if quick else 8) * 1024 * 1024]
    reps = 5 if quick else 15
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_coll_worker, args=(r, world, init_file, sizes, reps, q)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            res = q.get(timeout=300)
        finally:
            for p in procs:
                p.join(timeout=60)
    return res


def fit_links(res: dict[tuple[str, int], float], world: int) -> tuple[dict[str, float], float]:
    """Per-kind bus bandwidth (GB/s) and one latency (µs): least-squares fit of
    t = latency + bus_bytes / busBW over the sizes of each kind (clamped: gloo on shared
    cores is noisy, a negative slope means "bandwidth not measurable" → 100 GB/s)."""
    bws, lats = {}, []
    frac = (world - 1) / world
    for kind in COLLECTIVE_KINDS:
        mult = 2 * frac if kind == "all_reduce" else frac
        pts = [(b * mult, t) for (k, b), t in res.items() if k == kind]
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        var = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / var if var > 0 else 0.0
        slope = max(slope, 1e-11)  # s per bus byte; ≤ 100 GB/s
        bws[kind] = 1 / slope / 1e9
        lats.append(max(my - slope * mx, 1e-6) * 1e6)
    return bws, sorted(lats)[len(lats) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="profile TOML to write")
    ap.add_argument("--name", default="cpu_measured")
    ap.add_argument("--base", default="cpu", help="profile to copy unmeasured fields from")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--no-collectives", action="store_true")
    args = ap.parse_args(argv)

    base = load_hardware(args.base)
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    comp = measure_compute(threads, args.quick)
    peaks = {k.split(".")[1]: v for k, v in comp.items() if k.startswith("peak_tflops.")}
    hw = base.replace(
        name=args.name,
        description=f"measured by scripts/calibrate.py ({threads} threads/rank, {args.world_size} ranks)",
        peak_tflops=peaks,
        memory_bandwidth_gbps=comp["memory_bandwidth_gbps"],
        kernel_floor_us=comp["kernel_floor_us"],
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
    )
    if not args.no_collectives:
        res = measure_collectives(args.world_size, args.quick)
        bws, lat = fit_links(res, args.world_size)
        steps = max(1, args.world_size - 1)
        intra = type(base.intra_node)(bus_bandwidth_gbps=bws, latency_us=lat / 2, hop_latency_us=lat / 2 / steps)
        hw = hw.replace(intra_node=intra)
        for (k, b), t in sorted(res.items()):
            print(f"  {k:15s} {b:>10d} B  {t * 1e6:10.1f} us")
    Path(args.out).write_text(profile_to_toml(hw))
    load_hardware(args.out)  # validate what we wrote
    print(hw.summary())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
