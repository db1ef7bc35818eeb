#!/usr/bin/env python
"""Measure this machine for the cost model (what `hardware = "auto"` uses) and print it.

    python scripts/calibrate.py --world-size 4                 # cached profile, measured if missing
    python scripts/calibrate.py --world-size 4 --recalibrate   # measure again
    python scripts/calibrate.py --world-size 2 --out configs/hardware/cpu_measured.toml

Spawns `--world-size` gloo ranks that measure together, as a job of that size runs: matmul
TFLOP/s per dtype, copy bandwidth, an op's dispatch floor, gloo collectives after a burst
of compute (latency, bus bandwidth per kind, small-group factor) and how much of a
collective compute hides (parallel/auto/cost/calibrate.py). The profile is cached under
~/.cache/autotitan/hardware/ keyed by host, world size and torch version; `--out` also
writes it where you say.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import time

from parallel.auto.cost.calibrate import cache_path, calibrated_profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--recalibrate", action="store_true", help="measure again instead of reading the cache")
    ap.add_argument("--out", default=None, help="also write the profile TOML here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    hw = calibrated_profile(args.world_size, recalibrate=args.recalibrate)
    link = hw.intra_node
    print(f"{hw.summary()}\n  {hw.description}\n  op floor {hw.kernel_floor_us:.1f} µs, gloo latency "
          f"{link.latency_us + link.hop_latency_us * (args.world_size - 1):.0f} µs, bus GB/s "
          f"{ {k: round(v, 2) for k, v in link.bus_bandwidth_gbps.items()} }, small groups x "
          f"{link.group_size_factor or '-'}, comm overlap {hw.comm_overlap:.2f}")
    print(f"profile {cache_path(args.world_size)} ({time.perf_counter() - t0:.1f}s)")
    if args.out:
        shutil.copyfile(cache_path(args.world_size), args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
