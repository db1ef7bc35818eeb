"""training.compile, tested for numerics and for checkpoints:

* auto mode: the step graph compiled with Inductor trains like the eager step graph (fp32,
  rtol 1e-4 over 10 AdamW steps) on a 2x2 mesh (data-parallel and tensor-parallel
  collectives both inside the compiled graph; a 1-D mesh is the same path with fewer
  collectives, and the suite's time budget pays for one), and a checkpoint written by
  one resumes in the other (the same DCP files: the ParallelModule's parameters do not
  change with compilation);
* manual mode (FSDP, per-block torch.compile): same losses as uncompiled, identical
  parameter names (no `_orig_mod.`), and an uncompiled checkpoint resumes compiled.

The model is the smallest debug LLaMA that still has two blocks, so Inductor's first
compile stays short; its time is printed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dist_utils import run_distributed

TINY = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--optimizer.lr", "2e-3",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "10",
        "--checkpoint.enable", "true", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
STEPS = 10
RTOL = 1e-4


def _trainer(tmp: str, job: str, extra: list[str], world: int):
    from trainer.config import load_config
    from trainer.trainer import Trainer

    flags = [*TINY, "--training.steps", str(STEPS), "--job.dump_folder", tmp, "--job.name", job, *extra]
    return Trainer(load_config("llama3_debug", flags, world_size=world))


def _copy_checkpoint(tmp: str, src: str, dst: str, step: int) -> None:
    """Rank 0 copies `src`'s step-N checkpoint into a fresh run folder `dst` (then all wait)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(Path(tmp) / src / "checkpoints" / f"step-{step}",
                        Path(tmp) / dst / "checkpoints" / f"step-{step}")
    dist.barrier()


def _first_calls(tr) -> list:
    return [g.first_call_seconds for g in getattr(tr.model, "step_graphs", {}).values()]


def _worker(rank: int, world: int, tmp: str, mode_flags: list[str]) -> dict:
    from torch._dynamo.utils import counters  # Inductor's FX-graph cache statistics

    eager, compiled = [*mode_flags, "--training.compile", "false"], [*mode_flags, "--training.compile", "true"]
    tr = _trainer(tmp, "eager", eager, world)
    out = {"eager": tr.train(), "eager_names": sorted(tr.model.state_dict())}
    if "auto" in mode_flags:  # plan once; the other runs replay the plan (same graphs, no solving)
        replay = ["--parallelism.plan_file", str(Path(tmp) / "eager" / "plan.json")]
        eager, compiled = eager + replay, compiled + replay
    tr = _trainer(tmp, "compiled", compiled, world)
    out["compiled"] = tr.train()
    out["first_call_s"] = _first_calls(tr)
    out["compiled_graphs"] = [g.compiled for g in getattr(tr.model, "step_graphs", {}).values()]
    out["names"] = sorted(tr.model.state_dict())
    _copy_checkpoint(tmp, "eager", "eager_then_compiled", 5)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    tr = _trainer(tmp, "eager_then_compiled", compiled, world)
    out["eager_then_compiled"] = tr.train()
    out["second_compile"] = (_first_calls(tr), counters["inductor"]["fxgraph_cache_hit"] - hits)
    _copy_checkpoint(tmp, "compiled", "compiled_then_eager", 5)
    out["compiled_then_eager"] = _trainer(tmp, "compiled_then_eager", eager, world).train()
    return out


def _close(a: dict, b: dict, steps) -> float:
    worst = 0.0
    for s in steps:
        assert abs(a[s] - b[s]) <= RTOL * abs(b[s]), (s, a[s], b[s])
        worst = max(worst, abs(a[s] - b[s]) / abs(b[s]))
    return worst


def _check(out: dict, what: str) -> None:
    e, c = out["eager"], out["compiled"]
    assert sorted(e) == sorted(c) == list(range(1, STEPS + 1))
    print(f"{what}: max rel |loss(compiled) - loss(eager)| over {STEPS} steps = {_close(c, e, e):.1e}; first "
          f"compiled step {out['first_call_s']} s, same shapes again {out['second_compile'][0]} s "
          f"({out['second_compile'][1]} Inductor cache hits)")
    assert sorted(out["eager_then_compiled"]) == sorted(out["compiled_then_eager"]) == list(range(6, STEPS + 1))
    _close(out["eager_then_compiled"], e, range(6, STEPS + 1))
    _close(out["compiled_then_eager"], c, range(6, STEPS + 1))
    assert out["names"] == out["eager_names"] and not any("_orig_mod" in n for n in out["names"])


@pytest.mark.slow
def test_auto_compiled_step_matches_eager_and_shares_checkpoints(tmp_path):
    world, flags = 4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    out = run_distributed(_worker, world, str(tmp_path), ["--parallelism.mode", "auto", *flags], timeout=900)[0]
    assert out["compiled_graphs"] == [True]  # ONE compiled graph per rank for the whole step
    assert out["second_compile"][1] >= 1  # a second run of the same shapes reuses Inductor's compiled graph
    _check(out, f"auto, {world} ranks")


@pytest.mark.slow
def test_manual_compile_matches_uncompiled_with_the_same_parameter_names(tmp_path):
    out = run_distributed(_worker, 2, str(tmp_path), ["--parallelism.mode", "manual"], timeout=900)[0]
    _check(out, "manual FSDP, 2 ranks")
