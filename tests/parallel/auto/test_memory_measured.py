"""The predicted peak memory per device (plan.memory, cost/memory.py) against the live tensor
bytes measured on gloo ranks (trainer/dry_run.MemoryTracker over the second training step:
step graph, gradient clipping, foreach AdamW; plus the parameters, buffers and optimizer
states that exist between steps). DDP-, FSDP-, TP-like and free plans of the debug LLaMA,
with and without activation checkpointing, on 2 and 4 ranks: within 15 %. Run with -s for
the table."""

import pytest
from apply_workers import run_distributed
from memory_workers import plan_and_estimate, worker

JOBS = {2: [("ddp", ["none"]), ("fsdp", ["none", "full"]), ("tp", ["none"]), ("auto", ["selective"])],
        4: [("tp", ["full"]), ("auto", ["none"])]}
TOLERANCE = 0.15


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(JOBS))
def test_estimate_within_15_percent_of_measured_peak(world):
    jobs, rows = [], []
    for kind, ac_modes in JOBS[world]:
        plan, est = plan_and_estimate(world, kind, ac_modes)
        for ac in ac_modes:
            jobs.append((plan, ac))
            rows.append((kind, ac, est[ac]))
    outs = run_distributed(worker, world, jobs, timeout=400)
    print(f"\n{world} ranks: {'plan':<6}{'AC':<11}{'rank':>4}{'measured MiB':>14}{'estimated MiB':>15}{'error':>8}  "
          "estimate's peak")
    bad = []
    for i, (kind, ac, est) in enumerate(rows):
        for rank, out in enumerate(outs):
            meas = out[i]["peak"]
            err = est["peak_bytes"] / meas - 1
            print(f"{'':9}{kind:<6}{ac:<11}{rank:>4}{meas / 2**20:>14.2f}{est['peak_bytes'] / 2**20:>15.2f}"
                  f"{err:>+8.1%}  in the {est['phase']}")
            if abs(err) > TOLERANCE:
                bad.append((kind, ac, rank, err))
    assert not bad, bad
    by = {(k, ac): e["peak_bytes"] for k, ac, e in rows}
    if world == 2:  # activation checkpointing and sharding lower the peak, as measured
        assert by["fsdp", "full"] < by["fsdp", "none"] < by["ddp", "none"]
        assert outs[0][2]["peak"] < outs[0][1]["peak"] < outs[0][0]["peak"]
