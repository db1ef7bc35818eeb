"""Measure this machine for the cost model: `hardware = "auto"`.

A named profile (h100, ...) holds published figures; a CPU job's figures are this machine's
and depend on how many ranks share its cores, so they are measured, once, and cached under
the user's cache folder keyed by host, world size and torch version:

    <cache root>/hardware/<host>-w<world>-torch<version>-m<method>.toml

(the cache root: parallel/cache_dir.py, ~/.cache/autotitan by default)

`measure_in_group()` runs on every rank of a process group (all ranks compute and
communicate at once, as in training) and returns the profile; `calibrated_profile()` reads
the cache or, when asked (`recalibrate`) or missing, spawns `world_size` gloo ranks to
measure. What is measured, per rank:

  * matmul TFLOP/s per dtype, copy GB/s and an op's dispatch floor (µs) -> the roofline;
  * gloo all-gather / reduce-scatter / all-reduce / all-to-all at three sizes (16 KiB-16 MiB,
    averaged over ranks) on the whole world and, with more than 2 ranks, on pairs, each right
    after a burst of compute as in training (with more ranks than cores, waiting for every
    rank to be scheduled is most of a small collective's time) -> latency, bus bandwidth per
    kind, the bandwidth factor of small groups;
  * a collective beside a matmul loop -> `comm_overlap`, the share of communication time
    that compute hides (gloo's copies run on the same cores).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from parallel import _torch as T
from parallel.cache_dir import cache_root

from .calibrate_attention import measure_attention_grid
from .calibrate_ops import measure_op_bandwidths, measure_optimizer
from .contention import contention_factor, host_cores
from .hardware import (
    COLLECTIVE_KINDS,
    HardwareProfile,
    IntraNodeLink,
    load_hardware,
    profile_from_dict,
    profile_to_toml,
)
from .timing import _best_time, _times

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as _toml  # type: ignore[no-redef]

log = logging.getLogger("parallel.auto.cost")

SIZES = (16 * 1024, 1024 * 1024, 16 * 1024 * 1024)  # bytes (nccl-tests size), fp32


def cache_path(world_size: int) -> Path:
    """Where the profile measured on this host for `world_size` ranks is kept."""
    root = cache_root() / "hardware"
    version = torch.__version__.split("+")[0]
    return root / f"{socket.gethostname()}-w{world_size}-torch{version}-m{METHOD_VERSION}.toml"


METHOD_VERSION = 8
"""Bumped when what is measured changes, so older cached profiles are measured again
(2: the latency of a 2-rank group fixes the per-hop latency; 3: latency from a stream of
asynchronous collectives, as the runtime issues them; 4: compute figures the best of short
repeated measurements, matmul in a linear layer's three layouts, collectives the lower
quartile: robust to other work on the host; 5: the bandwidth of each memory-bound op class
and a real optimizer step, cost/calibrate_ops.py; 6: the fused attention kernel's
efficiency per direction, head dim and sequence length, cost/calibrate_attention.py; 7: the
optimizer step measured on one rank at a time, the quiet machine's figure; 8: the fused AdamW
step measured beside the foreach one, `[optimizer] fused_gbps` and `fused_tensor_us`)."""


def _low_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """The lower quartile of `reps` timed calls: what the host's own speed gives once the
    calls that other work slowed down are left out. Why not the best, as for compute: on
    shared cores a collective's best is the rare call where every rank happened to be
    scheduled at once, which a training step does not get every time."""
    return sorted(_times(fn, reps, warmup))[reps // 4]


def _linear_time(n: int, dt: torch.dtype, device: torch.device | None) -> tuple[float, float]:
    """(best seconds, widest spread) of an n x n x n matmul as a linear layer runs it: its
    forward (x @ W.t()) and both backward products (g @ W, g.t() @ x), each the best of
    short calls (a call of well under a millisecond is rarely cut by the scheduler), averaged.

    Why the three layouts: one layout is not the others' speed (on a 2-core Xeon, 1 thread,
    768^3 fp32: 104 GFLOP/s as a @ b, 146 as a @ b.t())."""
    x, w, g = (torch.randn(n, n, dtype=dt, device=device) for _ in range(3))
    wt, gt = w.t(), g.t()
    best = [_best_time(fn) for fn in (lambda: x @ wt, lambda: g @ w, lambda: gt @ x)]
    return sum(t for t, _ in best) / 3, max(sp for _, sp in best)


def measure_attention(b: int = 2, h: int = 4, s: int = 512, d: int = 64,
                      device: torch.device | None = None) -> tuple[float, float]:
    """(TFLOP/s, spread) of the fused SDPA kernel this rank's device runs (the CPU flash kernel
    on a CPU), forward, fp32, not causal, counted as torch's FLOP counter does (4·b·h·s²·d);
    the best of short repeated calls, as the matmul."""
    q, k, v = (torch.randn(b, h, s, d, device=device) for _ in range(3))
    with torch.no_grad():
        t, spread = _best_time(lambda: F.scaled_dot_product_attention(q, k, v))
    return 4 * b * h * s * s * d / t / 1e12, spread


def measure_compute(n: int = 384, device: torch.device | None = None) -> dict[str, float]:
    """This rank's matmul TFLOP/s (fp32, bf16), copy GB/s, op floor (µs), the bandwidth of each
    memory-bound op class (`op_<class>`) and the optimizer's (`optimizer_gbps`,
    `optimizer_tensor_us` of the foreach AdamW, `optimizer_fused_*` of the fused one;
    cost/calibrate_ops.py), the attention kernel's (`attn_<key>`, TFLOP/s;
    cost/calibrate_attention.py), all ranks busy (the optimizer's one rank at a time), each the
    best of short repeated measurements; `spread`: the widest median / best - 1."""
    out: dict[str, float] = {}
    spreads = []
    for key, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t, spread = _linear_time(n, dt, device)
        out[key], spreads = 2 * n**3 / t / 1e12, spreads + [spread]
    out["attention"], spread = measure_attention(device=device)
    spreads.append(spread)
    x = torch.randn(2 * 1024 * 1024, device=device)  # 8 MiB: more than a core's L2, as activations are
    y = torch.empty_like(x)
    t, spread = _best_time(lambda: y.copy_(x))
    out["copy_gbps"], spreads = 2 * x.numel() * 4 / t / 1e9, spreads + [spread]
    s = torch.randn(16, device=device)
    t, spread = _best_time(lambda: [s.add(s) for _ in range(100)])
    out["floor_us"], spreads = t / 100 * 1e6, spreads + [spread]
    ops, opt = measure_op_bandwidths(device=device), one_rank_at_a_time(lambda: measure_optimizer(device=device))
    fused = one_rank_at_a_time(lambda: measure_optimizer(device=device, implementation="fused"))
    out.update({f"op_{k}": v for k, v in ops.items() if k != "spread"})
    out.update({f"optimizer_{k}": v for k, v in opt.items() if k != "spread"})
    out.update({f"optimizer_fused_{k}": v for k, v in fused.items() if k != "spread"})
    grid = measure_attention_grid(device=device)
    out.update({f"attn_{k}": v for k, v in grid.items() if k != "spread"})
    out["spread"] = max(spreads + [ops["spread"], opt["spread"], fused["spread"], grid["spread"]])
    return out


def one_rank_at_a_time(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    """`fn()` on each rank in turn while the others wait in a barrier (idle, not spinning).

    Why: the best of short calls is the quiet machine's speed only when a call fits between
    the scheduler's switches; an optimizer step over 16 MiB of parameters takes tens of
    milliseconds, so with every rank busy its best still runs at the ranks' share of the
    cores, and the step simulation then multiplies it by that share again (cost/contention.py):
    a plan that updates every parameter on every rank (DDP) was predicted about 7 % slow."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    out: dict[str, float] = {}
    for rank in range(dist.get_world_size()):
        dist.barrier()
        if rank == dist.get_rank():
            out = fn()
    dist.barrier()
    return out


def _measured_tables(comp: dict[str, float]) -> dict[str, dict[str, float]]:
    """The profile's [op_bandwidth_gbps], [optimizer] and [attention_efficiency] (of the fp32
    matmul roof) from `measure_compute`'s figures (none where they were not measured)."""
    ops = {k[3:]: v for k, v in comp.items() if k.startswith("op_")}
    opt = {k[10:]: v for k, v in comp.items() if k.startswith("optimizer_")}
    att = {k[5:]: min(4.0, v / comp["fp32"]) for k, v in comp.items() if k.startswith("attn_")}
    return {"op_bandwidth_gbps": ops, "optimizer": opt if "gbps" in opt else {}, "attention_grid": att}


def _collective_fn(kind: str, numel: int, group: dist.ProcessGroup | None,
                   device: torch.device | None) -> Callable[[], object]:
    n = dist.get_world_size(group)
    full, shard = torch.randn(numel, device=device), torch.randn(numel // n, device=device)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(full, shard, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, full, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if dist.get_backend(group) == "gloo":
        # DTensor's Shard(i) -> Shard(j) on a CPU group is an all-gather of every rank's buffer
        # and a local chunk ("does not support alltoall yet"): time what actually runs
        gathered = torch.empty(numel * n, device=device)
        return lambda: dist.all_gather_single(gathered, full, group=group)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full, group=group)


def measure_stream_latency(group: dist.ProcessGroup | None = None, k: int = 8, reps: int = 7,
                           device: torch.device | None = None) -> float:
    """Seconds one small collective adds to a stream of them issued asynchronously.

    Why this and not one collective's round trip: the runtime issues its collectives
    asynchronously and waits where a value is used, so a step's many small transfers queue
    behind each other; on shared cores a lone collective's time is mostly the wake-up of
    ranks that a stream pays once (measured on 2 cores: 4 ranks 3.5-4.1 ms alone, 2.7 ms
    in a stream; a pair of them 0.4-2.5 ms alone, 0.4-0.8 ms in a stream)."""
    n = dist.get_world_size(group)
    shard = torch.randn(4096, device=device)
    full = torch.empty(4096 * n, device=device)

    def stream() -> None:
        works = [dist.all_gather_single(full, shard, group=group, async_op=True) for _ in range(k)]
        for w in works:
            w.wait()

    dist.barrier(group=group)
    return _low_time(stream, reps) / k


def measure_collectives(group: dist.ProcessGroup | None = None, reps: int = 7,
                        device: torch.device | None = None) -> dict[tuple[str, int], float]:
    """Seconds (lower quartile) per (kind, bytes) on `group` (every member calls it), measured as in
    training: each collective follows a burst of compute, so ranks arrive when the OS has
    let them finish (with more ranks than cores that wait is most of a small collective's
    time), and the burst's own time is taken away."""
    n = dist.get_world_size(group)
    warm = torch.zeros(16, device=device)
    for _ in range(3):
        dist.all_reduce(warm, group=group)
    a = torch.randn(256, 256, device=device)

    def burst() -> None:
        for _ in range(6):
            a @ a

    dist.barrier(group=group)
    t_burst = _low_time(burst, reps)
    res = {}
    for kind in COLLECTIVE_KINDS:
        for size in SIZES:
            numel = max(n, size // 4 // n * n)
            fn = _collective_fn(kind, numel, group, device)
            dist.barrier(group=group)
            res[(kind, numel * 4)] = max(_low_time(lambda: (burst(), fn()), reps) - t_burst, 1e-6)
    return res


def fit_link(res: dict[tuple[str, int], float], n: int,
             max_gbps: float | None = None) -> tuple[dict[str, float], float]:
    """(bus GB/s per kind, latency µs) of t = latency + bus bytes / busBW.

    On shared cores the small sizes are mostly scheduling noise, so one latency is taken
    for the link (the median of every kind's smallest-size time) and each kind's bandwidth
    from its largest size, where bytes dominate; a bandwidth above `max_gbps` (this host's
    copy bandwidth: gloo moves bytes through memory) is noise and is capped there."""
    frac = (n - 1) / n
    smallest, largest = min(b for _, b in res), max(b for _, b in res)
    mult = {kind: 2 * frac if kind == "all_reduce" else frac for kind in COLLECTIVE_KINDS}
    bws = {kind: float("inf") for kind in COLLECTIVE_KINDS}
    for _ in range(3):  # the small size's bytes take a little of its time: refine both
        small = sorted(res[(k, smallest)] - smallest * mult[k] / bws[k] for k in COLLECTIVE_KINDS)
        lat = max(small[len(small) // 2], 0.0)
        for kind in COLLECTIVE_KINDS:
            bw = largest * mult[kind] / max(res[(kind, largest)] - lat, 1e-6)
            bws[kind] = min(bw, max_gbps * 1e9) if max_gbps else bw
    return {k: v / 1e9 for k, v in bws.items()}, lat * 1e6


def split_latency(world_latency_us: float, world: int, pair_latency_us: float | None) -> tuple[float, float]:
    """(fixed, per-hop) µs of the link model latency(n) = fixed + (n - 1) per hop.

    Through both measured points when a 2-rank group's latency is known and below the
    whole world's (a pair of ranks in a bigger job syncs faster than all of them: pricing
    its collectives at the world's latency over-prices TP on a 2 x 2 mesh ~1.5x); else
    half of the world's latency is fixed and half is spread over its hops. The world's point
    is always kept."""
    if pair_latency_us is not None and world > 2 and 0 < pair_latency_us < world_latency_us:
        hop = min((world_latency_us - pair_latency_us) / (world - 2), world_latency_us / (world - 1))
        return world_latency_us - (world - 1) * hop, hop  # a pair measured implausibly fast: no fixed part
    return world_latency_us / 2, world_latency_us / 2 / max(1, world - 1)


def measure_overlap(n: int = 512, size: int = 4 * 1024 * 1024, device: torch.device | None = None) -> float:
    """Share of an all-reduce's time hidden behind a matmul loop running beside it."""
    a = torch.randn(n, n, device=device)
    buf = torch.randn(size // 4, device=device)
    reps = 7

    def compute() -> None:
        for _ in range(8):
            a @ a

    def comm() -> None:
        dist.all_reduce(buf)

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    dist.barrier()
    t_c, t_m = _low_time(compute, reps), _low_time(comm, reps)
    dist.barrier()
    t_b = _low_time(both, reps)
    hidden = (t_c + t_m - t_b) / t_m if t_m > 0 else 1.0
    return min(1.0, max(0.0, hidden))


def _mean_over_ranks(values: dict[str, float], device: torch.device | None = None) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, (t / dist.get_world_size()).tolist()))


def _pair_group() -> tuple[dist.ProcessGroup | None, bool]:
    """A group of this rank and its neighbour (for the small-group bandwidth), if world > 2."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world <= 2:
        return None, False
    groups = [dist.new_group([i, i + 1]) for i in range(0, world - 1, 2)]
    return (groups[rank // 2] if rank // 2 < len(groups) else None), True


def host_memory_per_rank(world: int) -> int:
    """This host's RAM shared by the job's ranks on it (LOCAL_WORLD_SIZE under torchrun,
    else the whole world: a CPU job's ranks share one host)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks)


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all of this host's cores so far (Linux /proc/stat; else None)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


BUSY_SHARE = 0.25
"""Share of the host's cores that other work may take while it is measured before the
profile is called busy (the measuring ranks themselves wait in a barrier then)."""


def host_busy_share(window_s: float = 0.5) -> float:
    """The share of this host's cores busy over `window_s` (call on every rank: rank 0
    samples /proc/stat while the others wait in a broadcast; 0 where it cannot be read)."""
    share = 0.0
    if dist.get_rank() == 0:
        before = _cpu_times()
        time.sleep(window_s)
        after = _cpu_times()
        if before is not None and after is not None and after[1] > before[1]:
            share = (after[0] - before[0]) / (after[1] - before[1])
    shared = [share]
    dist.broadcast_object_list(shared, src=0)  # every rank decides alike
    return shared[0]


def busy_before_measuring(window_s: float = 0.5) -> float:
    """The share of this host's cores busy over `window_s` just before measuring, with a
    warning when other work holds more than `BUSY_SHARE` of them. The compute figures are
    the best of short runs and hold anyway; the collectives' lower quartile may not (a
    profile measured by medians while the test suite ran on 2 cores rated matmul at 23
    GFLOP/s a rank against 55-60 quiet, and was cached and planned with)."""
    share = host_busy_share(window_s)
    if share > BUSY_SHARE and dist.get_rank() == 0:
        log.warning("this machine is busy (%.0f %% of its cores taken by other work) while hardware = \"auto\" "
                    "measures it: compute is taken as the best of repeated runs, the collectives may be rated "
                    "slow; measure it again when it is quiet: python scripts/calibrate.py --world-size %d "
                    "--recalibrate", share * 100, dist.get_world_size())
    return share


def measure_in_group(base: str | HardwareProfile = "cpu", device: torch.device | None = None) -> HardwareProfile:
    """The profile of this host as a job of this process group sees it (call on every rank);
    `device`: where the job's tensors live (None: torch's default device)."""
    t0 = time.perf_counter()
    world = dist.get_world_size()
    busy = busy_before_measuring()
    comp = _mean_over_ranks(measure_compute(device=device), device)
    measured = load_hardware(base).replace(
        name="auto", description=f"measured on {socket.gethostname()}: {world} ranks, torch {torch.__version__}, "
                                 f"{busy:.0%} of the host's cores busy before measuring, "
                                 f"compute figures the best of repeated runs (median {comp['spread']:.0%} slower)",
        peak_tflops={"fp32": comp["fp32"], "bf16": comp["bf16"]}, memory_bandwidth_gbps=comp["copy_gbps"],
        kernel_floor_us=comp["floor_us"], matmul_efficiency=1.0, memory_efficiency=1.0,
        attention_efficiency=min(1.0, comp["attention"] / comp["fp32"]),  # of the fp32 matmul roof
        memory_bytes=host_memory_per_rank(world), memory_limit_bytes=0, **_measured_tables(comp))
    if world == 1:  # one rank never communicates: keep the base profile's link, measure compute only
        log.info("calibrated in %.1fs (1 rank, compute only): fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s, copy %.1f GB/s",
                 time.perf_counter() - t0, comp["fp32"] * 1e3, comp["bf16"] * 1e3, comp["copy_gbps"])
        return measured
    res = measure_collectives(device=device)
    mean = _mean_over_ranks({f"{k}:{b}": t for (k, b), t in res.items()}, device)
    res = {(key.split(":")[0], int(key.split(":")[1])): t for key, t in mean.items()}
    bws, _ = fit_link(res, world, max_gbps=comp["copy_gbps"])
    lat = _mean_over_ranks({"lat": measure_stream_latency(device=device)}, device)["lat"] * 1e6
    gsf: dict[int, float] = {}
    pair_lat = None
    pair, has_pairs = _pair_group()
    if has_pairs:
        pair_res = measure_collectives(pair, device=device) if pair is not None else {}
        dist.barrier()
        if pair_res:
            pair_bws, _ = fit_link(pair_res, 2, max_gbps=comp["copy_gbps"])
            pair_lat = measure_stream_latency(pair, device=device) * 1e6
            gsf[2] = max(0.1, sum(pair_bws.values()) / max(sum(bws.values()), 1e-9))
    base_lat, hop_lat = split_latency(lat, world, pair_lat)
    overlap = _mean_over_ranks({"overlap": measure_overlap(device=device)}, device)["overlap"]
    hw = measured.replace(
        comm_overlap=overlap,
        intra_node=IntraNodeLink(bus_bandwidth_gbps=bws, latency_us=base_lat, hop_latency_us=hop_lat,
                                 group_size_factor=gsf))
    log.info("calibrated in %.1fs: fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s, copy %.1f GB/s, op floor %.1f µs "
             "(best of repeated runs, their median %.0f %% slower); "
             "%s; gloo latency %.0f µs (fixed %.0f + %.0f per hop), bus GB/s %s, comm overlap %.2f",
             time.perf_counter() - t0, comp["fp32"] * 1e3, comp["bf16"] * 1e3, comp["copy_gbps"], comp["floor_us"],
             comp["spread"] * 100, _ops_words(hw), lat, base_lat, hop_lat,
             {k: round(v, 2) for k, v in bws.items()}, overlap)
    return hw


def _ops_words(hw: HardwareProfile) -> str:
    """The memory-bound op classes' and the optimizer's figures, for the log."""
    ops = ", ".join(f"{k} {v:.1f}" for k, v in hw.op_bandwidth_gbps.items())
    opt = hw.optimizer
    if not opt:
        return f"op GB/s {ops or 'not measured'}"
    fused = (f" (fused {opt['fused_gbps']:.2f} GB/s + {opt['fused_tensor_us']:.0f} µs)"
             if "fused_gbps" in opt else "")
    return (f"op GB/s {ops}; optimizer {opt['gbps']:.2f} GB/s of parameters + {opt['tensor_us']:.0f} µs a tensor"
            + fused)


def save_profile(hw: HardwareProfile, path: Path) -> None:
    """Write the profile TOML (write-then-rename: never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(profile_to_toml(hw))
    os.replace(tmp, path)


def _spawned_rank(rank: int, world: int, init_file: str, base: str, queue: object) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        hw = measure_in_group(base)
        if rank == 0:
            queue.put(profile_to_toml(hw))
    finally:
        dist.destroy_process_group()


def calibrated_profile(world_size: int, *, recalibrate: bool = False, base: str = "cpu") -> HardwareProfile:
    """This host's profile for `world_size` ranks: the cached one, or measured now by
    `world_size` spawned gloo ranks (and cached)."""
    path = cache_path(world_size)
    if path.is_file() and not recalibrate:
        return load_hardware(path)
    log.info("calibrating this machine for %d ranks (cached in %s)", world_size, path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_spawned_rank, args=(r, world_size, os.path.join(d, "init"), base, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            text = queue.get(timeout=600)
        finally:
            for p in procs:
                p.join(timeout=60)
    hw = profile_from_dict(_toml.loads(text), source=str(path))
    save_profile(hw, path)
    return load_hardware(path)


def profile_for_group(*, recalibrate: bool = False, base: str = "cpu",
                      device: torch.device | None = None) -> HardwareProfile:
    """This host's profile for the current process group's world size: every rank gets the
    same one (rank 0's cache, or measured now by all ranks together and cached by rank 0)."""
    world = dist.get_world_size()
    path = cache_path(world)
    flag = [path.is_file() and not recalibrate]
    dist.broadcast_object_list(flag, src=0)
    if flag[0]:
        text = [path.read_text() if dist.get_rank() == 0 else None]
    else:
        hw = measure_in_group(base, device)
        if dist.get_rank() == 0:
            save_profile(hw, path)
        text = [profile_to_toml(hw) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text, src=0)
    hw = profile_from_dict(_toml.loads(text[0]), source=str(path))
    return with_host_contention(hw, world)


def with_host_contention(hw: HardwareProfile, world: int) -> HardwareProfile:
    """`hw` with this job's `contention` (cost/contention.py): the host's other work measured
    now, while every rank waits here; one log line when it slows the step (call on every rank)."""
    share = host_busy_share()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    factor = contention_factor(share, ranks)
    if factor > 1.05 and dist.get_rank() == 0:
        log.warning("other work holds %.1f of this host's %d cores as the job starts: its %d ranks get a share "
                    "of them, and the step is predicted %.2fx the quiet machine's (the cached profile keeps the "
                    "quiet figures)", share * host_cores(), host_cores(), ranks, factor)
    return hw.replace(contention=factor)


def in_real_group() -> bool:
    """True inside a real process group (not a fake world of planning)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != T.FAKE_BACKEND


def resolve_auto(world_size: int, device: torch.device | None = None, *, recalibrate: bool = False
                 ) -> HardwareProfile:
    """This machine's profile for `hardware = "auto"` (parallel.auto.config.resolve_planner
    decides when): inside a real process group, this machine measured by its ranks (cached;
    `recalibrate`: measured again); on a fake world (planning for a cluster elsewhere), the
    cached measurement for that world size when there is one, else the shipped `cpu` profile
    (a named profile, e.g. "h100", is what planning for other hardware wants)."""
    if in_real_group():
        return profile_for_group(recalibrate=recalibrate, device=device)
    path = cache_path(world_size)
    if path.is_file():
        return load_hardware(path)
    log.info('hardware "auto" on a fake world of %d ranks with nothing measured for it: the cpu profile '
             "(name a profile, e.g. hardware=\"h100\", to plan for other hardware)", world_size)
    return load_hardware("cpu")
