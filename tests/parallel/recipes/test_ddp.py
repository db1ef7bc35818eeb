"""DDP recipe: ``data_parallel_replicate_degree`` alone is torch's DistributedDataParallel
(plain tensors, the reducer's gradient buckets), HSDP keeps the replicate axis sharded, the
dry run simulates DDP's reducer (DDP with TP is refused: test_dry_run.py). On 2 gloo ranks
the trainer's DDP job logs the losses of one process with the same global batch (fp32)."""

import pytest
import torch
from dist_utils import run_distributed
from torch.distributed.tensor import DTensor

from models import build_model
from parallel._torch import fake_world
from parallel.mesh import build_mesh
from parallel.recipes import apply_recipe, is_ddp_mesh
from parallel.recipes.ddp import ddp_reducer
from trainer.config import load_config
from trainer.trainer import Trainer

FAST = ["--training.seq_len", "32", "--training.steps", "3", "--metrics.log_freq", "1",
        "--lr_scheduler.decay_steps", "6", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
        "--optimizer.lr", "2e-3",
        "--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32"]


def _cfg(world, *extra):
    return load_config("llama3_debug", FAST + list(extra), world_size=world)


def test_replicate_alone_is_ddp_with_shard_is_hsdp():
    """The mesh decides: dp_replicate alone -> DDP; with dp_shard -> FSDP2's HSDP (DTensors)."""
    with fake_world(4):
        ddp_mesh = build_mesh(_cfg(4, "--parallelism.data_parallel_replicate_degree", "4").parallelism.degrees,
                              4, "cpu")
        hsdp_cfg = _cfg(4, "--parallelism.data_parallel_replicate_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "2")
        hsdp_mesh = build_mesh(hsdp_cfg.parallelism.degrees, 4, "cpu")
        assert is_ddp_mesh(ddp_mesh) and not is_ddp_mesh(hsdp_mesh)
        model = build_model("llama3", "debug", device="meta")
        apply_recipe(model, hsdp_mesh, hsdp_cfg)
        assert all(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in model.parameters())


MIXED = ["--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "bfloat16",
         "--activation_checkpoint.mode", "full"]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]


def _ddp_worker(rank, world, folder):
    torch.set_num_threads(1)
    flags = ["--job.dump_folder", folder, "--training.local_batch_size", "2",
             "--parallelism.data_parallel_replicate_degree", str(world)]
    # DCP checkpoint of the replicated model: 2 steps, saved, then resumed for the third
    first = Trainer(_cfg(world, *flags, *CKPT, "--job.name", "split", "--training.steps", "2")).train()
    second = Trainer(_cfg(world, *flags, *CKPT, "--job.name", "split")).train()
    mixed = Trainer(_cfg(world, *flags, *MIXED, "--job.name", "mixed")).train()  # autocast, bf16 all-reduce, AC
    t = Trainer(_cfg(world, *flags))
    losses = t.train()
    ddp = ddp_reducer(t.model)
    params = list(t.model.parameters())
    grads = torch.cat([p.grad.flatten() for p in params])  # the last step's all-reduced gradients
    gathered = [torch.empty_like(grads) for _ in range(world)]
    torch.distributed.all_gather(gathered, grads)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return {"losses": losses, "split": {**first, **second}, "mixed": mixed, "ddp": type(ddp).__name__,
            "reducer": isinstance(getattr(ddp, "reducer", None), torch.distributed.Reducer),
            "bucket_mb": getattr(ddp, "bucket_bytes_cap", 0) / 2**20,
            "dtensors": sum(isinstance(p, DTensor) for p in params),
            "same_grads": all(torch.equal(g, gathered[0]) for g in gathered),
            "keys": sorted(get_model_state_dict(t.model))}


@pytest.mark.slow
def test_ddp_matches_one_process_at_the_same_global_batch(tmp_path):
    ref = Trainer(_cfg(1, "--job.dump_folder", str(tmp_path / "ref"), "--training.local_batch_size", "4")).train()
    got = run_distributed(_ddp_worker, 2, str(tmp_path / "ddp"), timeout=300)
    for r in got:
        assert r["ddp"] == "DistributedDataParallel" and r["reducer"] and r["bucket_mb"] == 25, r  # torch's reducer
        assert r["dtensors"] == 0 and r["same_grads"], r  # plain replicas, gradients all-reduced
        assert r["keys"] == sorted(build_model("llama3", "debug", device="meta").state_dict()), r["keys"][:5]
    assert set(got[0]["losses"]) == set(ref) and got[0]["losses"] == got[1]["losses"]
    for s in ref:
        assert got[0]["losses"][s] == pytest.approx(ref[s], rel=1e-5), (got[0]["losses"], ref)
    assert got[0]["split"] == got[0]["losses"]  # resumed from the DCP checkpoint: bitwise the same (fp32)
    mixed_ref = Trainer(_cfg(1, "--job.dump_folder", str(tmp_path / "ref"), "--job.name", "mixed",
                             "--training.local_batch_size", "4", *MIXED)).train()
    for s in ref:  # bf16 compute and a bf16 all-reduce: close to one process's autocast run, not equal
        assert got[0]["mixed"][s] == pytest.approx(mixed_ref[s], rel=2e-2), (got[0]["mixed"], mixed_ref)


def test_dry_run_simulates_ddp_buckets_and_all_reduces():
    """The dry run's DDP: whole parameters, torch's bucket assignment, one all-reduce per
    bucket on dp_replicate whose bytes add up to every gradient once, the buckets in the peak."""
    from trainer.dry_run import dry_run

    cfg = _cfg(4, "--parallelism.data_parallel_replicate_degree", "4", "--training.local_batch_size", "2")
    r = dry_run(cfg, 4)
    full = 4 * build_model("llama3", "debug", device="meta").args.num_params()
    assert r.mesh == "dp_replicate=4" and r.param_bytes == full and r.grad_bytes == full
    count, nbytes = r.collectives[("all_reduce", "dp_replicate")]
    assert set(r.collectives) == {("all_reduce", "dp_replicate")} and nbytes == full and count >= 2, r.collectives
    assert r.buffer_bytes == full and r.total_peak_bytes == 3 * full + r.peak_fwd_bwd_bytes + full


def _compress_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.recipes.ddp import apply_ddp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    ref.load_state_dict(model.state_dict())
    apply_ddp(model, mesh, torch.bfloat16)
    x = torch.randn(8, 64)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    return model.weight.grad, ref.weight.grad, type(ddp_reducer(model)).__name__


@pytest.mark.slow
def test_a_16_bit_reduce_dtype_all_reduces_the_buckets_in_it():
    """mixed_precision_reduce = bfloat16 on fp32 parameters: the bucket goes over the wire in
    bf16 (on gloo too): the gradient is the fp32 one rounded to bf16, not the fp32 one."""
    grad, ref, kind = run_distributed(_compress_worker, 1, timeout=120)[0]
    assert kind == "DistributedDataParallel"
    assert not torch.equal(grad, ref) and torch.equal(grad, ref.to(torch.bfloat16).float())
