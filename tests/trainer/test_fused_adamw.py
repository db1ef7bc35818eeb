"""`[optimizer] implementation = "fused"`: torch's fused AdamW (one kernel per parameter group,
updated in place). On 2 gloo ranks, fp32: manual DDP (plain parameters) and auto mode (an
FSDP-shaped plan: DTensor parameters, sharded update) train with the losses and weights of one
process stepping the global batch with the fused kernel (1e-5 of each tensor's scale), and that process stays
within 1e-5 of the foreach AdamW."""

from __future__ import annotations

import functools
import tempfile

import pytest
from dist_utils import run_distributed

from trainer.config import load_config

TINY = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.steps", "3",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
        "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "2e-3", "--training.global_batch_size", "8"]
DDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
JOBS = {"ddp": ["--parallelism.mode", "manual", *DDP], "auto": ["--parallelism.mode", "auto",
                                                                 "--parallelism.hardware", "cpu"]}
RTOL = 1e-5


def _run(args: list[str], world: int, auto: bool = False) -> dict:
    from torch.distributed.tensor import DTensor

    from parallel.auto.search import presets
    from trainer.trainer import Trainer

    tr = Trainer(load_config("llama3_debug", args, world_size=world), plan_constraints=presets.fsdp if auto else None)
    losses = tr.train()
    fused = [g.get("fused") for g in tr.optimizer.param_groups]
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
               for n, p in tr.model.named_parameters()}
    return {"losses": losses, "weights": weights, "fused": fused}


def _worker(rank: int, world: int, tmp: str) -> dict:
    out = {job: _run([*TINY, *flags, "--optimizer.implementation", "fused", "--training.local_batch_size", "4",
                      "--job.dump_folder", tmp, "--job.name", job], world, auto=job == "auto")
           for job, flags in JOBS.items()}
    return out if rank == 0 else {}


@functools.lru_cache(maxsize=None)
def runs() -> dict:
    tmp = tempfile.mkdtemp(prefix="autotitan-fused-")
    res = run_distributed(_worker, 2, tmp, timeout=300)[0]
    for impl in ("fused", "foreach"):
        res[f"one_rank_{impl}"] = _run([*TINY, "--optimizer.implementation", impl, "--training.local_batch_size", "8",
                                        "--job.dump_folder", tmp, "--job.name", f"one_{impl}"], 1)
    return res


def _close(got: dict, ref: dict) -> None:
    for s in ref["losses"]:
        assert abs(got["losses"][s] - ref["losses"][s]) <= RTOL * abs(ref["losses"][s]), (got["losses"], ref["losses"])
    for n, w in ref["weights"].items():  # to the tensor's scale (an element near 0 moves by a whole lr step)
        assert (got["weights"][n] - w).abs().max().item() <= RTOL * max(1.0, w.abs().max().item()), n


@pytest.mark.slow
@pytest.mark.parametrize("job", list(JOBS))
def test_fused_adamw_on_two_ranks_equals_one_rank(job):
    res = runs()
    got, ref = res[job], res["one_rank_fused"]
    assert got["fused"] and all(got["fused"]) and all(ref["fused"])  # the fused kernel ran
    _close(got, ref)


@pytest.mark.slow
def test_fused_and_foreach_adamw_agree():
    res = runs()
    assert not any(res["one_rank_foreach"]["fused"])
    _close(res["one_rank_fused"], res["one_rank_foreach"])
