"""The predicted peak memory per device (plan.memory, cost/memory.py) against the allocator
(parallel.measure.AllocatorPeak: the CPU allocator's every allocation and free during the
second training step, from the profiler's memory events: step graph, clipping, foreach
AdamW), on top of the parameter shards, buffers and AdamW states alive before it; the
estimate made on the gloo ranks, as the trainer's (it counts gloo's all-gather staging).
FSDP-like plans with and without activation checkpointing and a DDP-like plan of a 2-layer
debug LLaMA at seq 256 (peak in the backward) on 2 gloo ranks, and the FSDP- and DDP-like
plans accumulating 2 micro-batches (the sum of unreduced gradients held between them):
within 10 %. The allocator
observer itself is checked on tensors of known sizes. Run with -s for the table;
scripts/bench_memory.py measures more plans on 2 and 4 ranks."""

import gc

import pytest
import torch
from apply_workers import run_distributed
from memory_workers import plan_and_estimate, worker

from parallel.measure import AllocatorPeak, phase

MIB = 2**20
JOBS = [("fsdp", ["none", "full"]), ("ddp", ["none"])]
MICRO = 2  # gradient accumulation: the FSDP and DDP plans again with 2 micro-batches a step
TOLERANCE = 0.10


def test_allocator_peak_counts_the_window_s_allocations_and_names_the_phase():
    gc.collect()  # an earlier test's garbage freed inside the window would lower the allocator's total
    gc.disable()
    try:
        _window_counts_its_own_allocations()
    finally:
        gc.enable()


def _window_counts_its_own_allocations() -> None:
    before = torch.empty(MIB, dtype=torch.uint8)  # allocated before the window: its free is not seen
    with AllocatorPeak() as mem:
        with phase("forward_backward"):
            a = torch.empty(3 * MIB, dtype=torch.uint8)
            b = torch.ones(MIB // 4)  # 1 MiB of float32
            del before
            c = torch.zeros(2 * MIB, dtype=torch.uint8)  # the peak: 3 + 1 + 2 MiB
            del a, c
        with phase("optimizer"):
            d = torch.empty(4 * MIB, dtype=torch.uint8)  # 5 MiB alive: below the peak
    r = mem.result
    assert (r.peak_bytes, r.end_bytes) == (6 * MIB, 5 * MIB)
    assert r.phase == "forward" and r.op in ("aten::zeros", "aten::empty")
    assert r.rss_start > 0 and r.events >= 5
    del b, d

    x = torch.randn(MIB // 4, requires_grad=True)
    with AllocatorPeak() as mem:
        with phase("forward_backward"):
            y = torch.log_softmax(x, 0)
            y.sum().backward()  # the backward's gradients on top of the forward's 1 MiB
            del y
        with phase("optimizer"):
            z = torch.empty(MIB // 2, dtype=torch.uint8)
    assert mem.result.phase == "backward" and mem.result.peak_bytes >= 2 * MIB
    del z


@pytest.mark.slow
def test_estimate_within_10_percent_of_the_allocator_s_peak():
    world = 2
    jobs, rows = [], []
    for kind, ac_modes in JOBS:
        plan, est = plan_and_estimate(world, kind, ac_modes)
        for ac in ac_modes:
            jobs.append((plan, ac))
            rows.append((kind, ac, est[ac]))
    for kind in ("fsdp", "ddp"):  # the sum of unreduced gradients held between micro-batches, estimated
        plan = next(p for p, (k, _, _) in zip(jobs, rows) if k == kind)[0]
        jobs.append((plan, "none", MICRO))
        rows.append((kind, f"none, {MICRO} micro-batches", None))
    outs = run_distributed(worker, world, jobs, timeout=400)
    print(f"\n{world} ranks: {'plan':<6}{'AC':<24}{'rank':>4}{'allocator MiB':>15}{'estimated MiB':>15}"
          f"{'error':>8}  peak measured / estimated")
    bad = []
    for i, (kind, ac, _) in enumerate(rows):
        for rank, out in enumerate(outs):
            meas, est = out[i]["peak"], out[i]["estimate"]  # the estimate made on the gloo ranks
            err = est["peak_bytes"] / meas - 1
            print(f"{'':9}{kind:<6}{ac:<24}{rank:>4}{meas / MIB:>15.2f}{est['peak_bytes'] / MIB:>15.2f}"
                  f"{err:>+8.1%}  {out[i]['phase']} ({out[i]['op']}) / {est['phase']}")
            if abs(err) > TOLERANCE:
                bad.append((kind, ac, rank, err))
    assert not bad, bad
    assert all(out[0]["phase"] == "backward" for out in outs), [out[0]["phase"] for out in outs]
    # activation checkpointing lowers the peak and FSDP shards the state DDP replicates, as measured
    # (at this size FSDP's gathered layers cost about what its sharded states save: no order of peaks)
    assert all(out[1]["peak"] < out[0]["peak"] and out[0]["base"] < out[2]["base"] for out in outs)
    # accumulating holds the unreduced sum through the second micro-batch: a higher peak, measured
    assert all(out[3]["peak"] > out[0]["peak"] and out[4]["peak"] > out[2]["peak"] for out in outs)
    # the fake world's estimates (NCCL: no staging)
    by = {(k, ac): e["peak_bytes"] for k, ac, e in rows if e is not None}
    assert by["fsdp", "full"] < by["fsdp", "none"]
