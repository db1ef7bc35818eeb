"""Models nobody here wrote (`transformers` GPT-2 and T5, scaled down, gradients larger than
the activations: the gradient buffers weigh in the peak) planned through the API on a fake
world of 2, then trained on 2 gloo ranks: the estimate's peak per device (backward or
optimizer step) is within 10 % of what the CPU allocator reports (torch.profiler memory
events of the second step on top of the bytes alive before it; bench_foreign_memory.py)."""

import importlib.util
from pathlib import Path

import pytest
from apply_workers import run_distributed

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
MODELS = ("gpt2_small", "t5_small")
TOLERANCE = 0.10


def _bench():
    spec = importlib.util.spec_from_file_location("bench_foreign_memory", ROOT / "scripts" / "bench_foreign_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _worker(rank, world_size, jobs):
    from torch.distributed.device_mesh import init_device_mesh

    bench = _bench()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return [bench._measure(mesh, name, plan) for name, plan in jobs]


@pytest.mark.slow
@pytest.mark.xfail(reason="the goal is not met yet: on 2 gloo ranks the estimate is 6-16 % below the allocator's peak "
                          "for these models (scripts/bench_foreign_memory.py --table measured), and two runs of the "
                          "same plan differ by up to 12 %", strict=False)
def test_foreign_models_estimate_matches_the_allocator():
    bench = _bench()
    planned = {name: bench.plan_and_estimate(name, 2, bench.SMALL_BATCH, bench.SMALL_SEQ, "cpu", "fsdp")
               for name in MODELS}
    results = run_distributed(_worker, 2, [(n, planned[n]["plan"]) for n in MODELS], timeout=400)
    for name, meas in zip(MODELS, results[0]):
        est = planned[name]["estimate"]
        err = est["peak_bytes"] / meas["peak"] - 1
        print(f"{name}: estimate {est['peak_bytes'] / 2**20:.1f} MiB ({est['phase']}), allocator "
              f"{meas['peak'] / 2**20:.1f} MiB: {err:+.1%}")
        assert abs(err) <= TOLERANCE, (name, est, meas)
