"""`[training] global_batch_size`: gradient accumulation over micro-batches.

On 2 gloo ranks, 2 micro-batches, fp32: manual FSDP, manual DDP and auto mode (an FSDP-shaped plan)
train with the losses, gradient norms and weights of one process stepping the same global
batch at once (rtol 1e-5), and both reduce their gradients once per step (the micro-batches
before the last run without gradient sync). The loader's micro-batches make up exactly the 1-rank global batch;
a global batch that is no whole number of micro-batches is one config error naming both
keys and the nearest valid values."""

from __future__ import annotations

import functools
import json
import math
import tempfile

import pytest
from dist_utils import run_distributed

from trainer.config import ConfigError, load_config  # noqa: E402
from trainer.data import DPBatchSampler  # noqa: E402

TINY = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.steps", "3",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.hardware", "h100",
        "--checkpoint.enable", "false", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "2e-3",
        "--training.global_batch_size", "8"]
# job -> (mode, local batch on 2 ranks): 8 = 2 ranks x 2 x 2 micro-batches, or 2 ranks x 4 x 1
JOBS = {"manual_micro2": ("manual", 2), "manual_micro1": ("manual", 4), "auto_micro2": ("auto", 2),
        "auto_micro1": ("auto", 4), "ddp_micro2": ("ddp", 2)}
DDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
RTOL = 1e-5


def _args(mode: str, local: int, tmp: str, job: str) -> list[str]:
    extra = {"auto": ["--parallelism.hardware", "cpu"], "ddp": DDP}.get(mode, [])
    mode = "manual" if mode == "ddp" else mode
    return [*TINY, "--parallelism.mode", mode, *extra, "--training.local_batch_size", str(local),
            "--job.dump_folder", tmp, "--job.name", job]


def _reduction_counter():
    """A dispatch mode that records every reducing functional collective the step dispatches
    (the auto runtime's step graph and DTensor's eager redistributions alike) as (op, numel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reductions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if getattr(func, "namespace", "") == "_c10d_functional" and ("reduce" in name):
                self.seen.append((name, args[0].numel() if hasattr(args[0], "numel") else sum(
                    t.numel() for t in args[0])))
            return func(*args, **(kwargs or {}))

    return Reductions()


def _run(args: list[str], world: int) -> dict:
    """Train; the logged losses and grad norms, the full weights, the reduce-scatters per step
    (torch.distributed's, manual mode) and the functional reductions (auto mode)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.trainer import Trainer

    calls = {"reduce_scatter": 0}
    saved = {n: getattr(dist, n) for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)}

    def counted(fn):
        def wrapper(*a, **k):
            calls["reduce_scatter"] += 1
            return fn(*a, **k)
        return wrapper

    for n, fn in saved.items():
        setattr(dist, n, counted(fn))
    from parallel.auto.search import presets

    constraints = presets.fsdp if "auto" in args else None  # both batch sizes plan one shape: Partial gradients
    try:
        tr = Trainer(load_config("llama3_debug", args, world_size=world), plan_constraints=constraints)
        with _reduction_counter() as reductions:
            losses = tr.train()
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
    if world > 1:
        dist.barrier()  # rank 0 writes losses.json when its run ends (metrics.py): read it after that
    logged = json.loads((tr.run_dir / "losses.json").read_text())
    norms = {int(k): v for k, v in logged["grad_norm"].items()}
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
               for n, p in tr.model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "micro": tr.micro_batches,
            "reduce_scatters": calls["reduce_scatter"], "steps": tr.step, "reductions": reductions.seen}


def _worker(rank: int, world: int, tmp: str) -> dict:
    out = {job: _run(_args(mode, local, tmp, job), world) for job, (mode, local) in JOBS.items()}
    return out if rank == 0 else {}


@functools.lru_cache(maxsize=None)
def runs() -> dict:
    tmp = tempfile.mkdtemp(prefix="autotitan-accum-")
    res = run_distributed(_worker, 2, tmp, timeout=300)[0]
    res["one_rank"] = _run(_args("manual", 8, tmp, "one_rank"), 1)  # the whole global batch at once
    return res


@pytest.mark.slow
@pytest.mark.parametrize("job", ["manual_micro2", "auto_micro2", "ddp_micro2"])
def test_two_micro_batches_on_two_ranks_equal_one_rank(job):
    res = runs()
    got, ref = res[job], res["one_rank"]
    assert got["micro"] == 2 and ref["micro"] == 1
    print(f"{job}: losses {got['losses']} vs 1 rank {ref['losses']}; grad norms {got['norms']} vs {ref['norms']}")
    assert sorted(got["losses"]) == [1, 2, 3] and got["steps"] == 3  # the step counter counts optimizer steps
    for step, loss in ref["losses"].items():
        assert math.isclose(got["losses"][step], loss, rel_tol=RTOL), (step, got["losses"][step], loss)
        assert math.isclose(got["norms"][step], ref["norms"][step], rel_tol=RTOL), step
    for name, w in ref["weights"].items():
        assert (got["weights"][name] - w).abs().max().item() <= RTOL * max(1.0, w.abs().max().item()), name


@pytest.mark.slow
def test_fsdp_reduces_once_per_step():
    res = runs()
    once, twice = res["manual_micro1"]["reduce_scatters"], res["manual_micro2"]["reduce_scatters"]
    print(f"reduce-scatters over 3 steps: 1 micro-batch {once}, 2 micro-batches {twice}")
    assert once > 0 and twice == once  # the first micro-batch of each step ran without gradient sync


def test_loader_micro_batches_make_up_the_one_rank_global_batch():
    n, g = 40, 8  # 5 global batches of 8 samples
    ref = DPBatchSampler(n, g, seed=3)
    ranks = [DPBatchSampler(n, 2, r, 2, seed=3, micro_batches=2) for r in range(2)]
    for _ in range(7):  # past an epoch's end: the new epoch starts at a step's first micro-batch
        step = sorted(i for s in ranks for _ in range(2) for i in next(s))
        assert step == sorted(next(ref))
        assert all(s.micro == 0 for s in ranks)
    state = ranks[0].state_dict()
    next(ranks[0])
    assert ranks[0].state_dict()["micro"] == 1  # inside a step: the micro-batch is part of the position
    again = DPBatchSampler(n, 2, 0, 2, seed=3, micro_batches=2)
    again.load_state_dict(state)
    assert again.state_dict() == state


@pytest.mark.parametrize("local, glob, words", [
    (8, 12, "= 16: every step is a whole number of micro-batches; set training.global_batch_size to a multiple "
            "of it (16), or training.local_batch_size to a divisor of 6 (3 or 6)"),
    (4, 20, "= 8: every step is a whole number of micro-batches; set training.global_batch_size to a multiple "
            "of it (16 or 24), or training.local_batch_size to a divisor of 10 (2 or 5)"),
    (4, 7, "= 8: every step is a whole number of micro-batches; set training.global_batch_size to a multiple "
           "of it (8)"),
])
def test_global_batch_not_a_whole_number_of_micro_batches(tmp_path, local, glob, words):
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", ["--training.local_batch_size", str(local), "--training.global_batch_size",
                                     str(glob), "--job.dump_folder", str(tmp_path)], world_size=2)
    msg = str(e.value)
    assert f"'training.global_batch_size' = {glob}: is not a multiple of training.local_batch_size ({local})" in msg
    assert "data degree (dp_replicate x dp_shard = 2)" in msg and words in msg


def test_global_batch_sets_the_micro_batches(tmp_path):
    cfg = load_config("llama3_debug", ["--training.local_batch_size", "2", "--training.global_batch_size", "16",
                                       "--job.dump_folder", str(tmp_path)], world_size=2)
    assert cfg.training.micro_batches(2) == 4 and cfg.training.global_batch(2) == 16
    cfg = load_config("llama3_debug", ["--job.dump_folder", str(tmp_path)], world_size=2)
    assert cfg.training.micro_batches(2) == 1 and cfg.training.global_batch(2) == 2 * cfg.training.local_batch_size


@pytest.mark.slow
def test_auto_reduces_gradients_once_per_step():
    """The FSDP-shaped plan's gradient reductions (bucketed reduce-scatters, one per block)
    run once per optimizer step with 2 micro-batches, as with 1: the micro-batch before the
    last runs the step graph without them (its Partial gradients summed unreduced).
    Reductions of one element (the loss, the gradient norm, the step's finite check) are per
    micro-batch or per step either way and are left out."""
    res = runs()
    once = sorted(r for r in res["auto_micro1"]["reductions"] if r[1] > 1)
    twice = sorted(r for r in res["auto_micro2"]["reductions"] if r[1] > 1)
    print(f"gradient reductions over 3 steps: 1 micro-batch {once}, 2 micro-batches {twice}")
    assert any(name.startswith("reduce_scatter") for name, _ in once) and twice == once
