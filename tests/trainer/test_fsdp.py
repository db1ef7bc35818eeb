"""2-rank FSDP2 on gloo (torchrun): losses equal a 1-rank run on the same global batch;
sharded checkpoints resume on 2 ranks and reshard onto 1 rank."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import FAST, read_grad_norms, read_losses

from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SPLIT = ["--lr_scheduler.decay_steps", "6"]
TOL = 1e-4


def torchrun(tmp_path, job, extra, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(ROOT / "train.py"), "--config", "llama3_debug",
           *FAST, "--training.local_batch_size", "2", *SPLIT,
           "--job.dump_folder", str(tmp_path), "--job.name", job, *extra]
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.mark.slow
def test_two_rank_fsdp_matches_one_rank_and_resumes(cfg_factory, tmp_path):
    # reference: 1 rank, local batch 4 = the 2-rank global batch (2 x 2)
    ref = Trainer(cfg_factory(extra=["--training.steps", "6"] + SPLIT, job="ref")).train()
    ref_gn = read_grad_norms(tmp_path, "ref")

    ck = ["--checkpoint.enable", "true", "--checkpoint.interval", "2",
          "--checkpoint.keep_latest_k", "0"]
    r = torchrun(tmp_path, "fsdp", ["--training.steps", "4", *ck])
    assert "mesh dp_shard=2" in r.stdout
    two = read_losses(tmp_path, "fsdp")
    assert sorted(two) == [1, 2, 3, 4]
    diff = max(abs(two[s] - ref[s]) for s in two)
    print(f"max |loss(2 ranks) - loss(1 rank)| = {diff:.2e}")
    assert diff < TOL, (two, ref)
    gn = read_grad_norms(tmp_path, "fsdp")
    assert max(abs(gn[s] - ref_gn[s]) for s in gn) < 1e-3 * max(ref_gn.values())

    # resume the 2-rank run from its sharded step-4 checkpoint on 2 ranks
    shutil.copytree(tmp_path / "fsdp", tmp_path / "fsdp_to_1")
    torchrun(tmp_path, "fsdp", ["--training.steps", "6", *ck])
    resumed = read_losses(tmp_path, "fsdp")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert max(abs(resumed[s] - ref[s]) for s in resumed) < TOL

    # load the 2-rank step-2 checkpoint into a single process (DCP resharding)
    one = Trainer(cfg_factory(extra=["--training.steps", "4", "--checkpoint.load_step", "2",
                                     *ck, *SPLIT], job="fsdp_to_1")).train()
    assert sorted(one) == [3, 4]
    assert max(abs(one[s] - ref[s]) for s in one) < TOL


def _norm_worker(rank, world, store_path, out_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from trainer.optim import clip_grad_norm_, total_grad_norm
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))  # experts: another mesh
        torch.manual_seed(0)
        full = [torch.randn(6, 4), torch.randn(5), torch.randn(3, 3), torch.randn(4, 2), torch.randn(3)]
        layout = [(mesh, Shard(0)), (mesh, Replicate()), (None, None), (ep_mesh, Shard(0)), (mesh, Partial())]
        params = []
        for t, (m, pl) in zip(full, layout):
            if m is None:
                p = torch.nn.Parameter(torch.zeros_like(t))
                p.grad = t.clone()
            else:
                p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(t), m, [Replicate()]))
                p.grad = (DTensor.from_local(t / world, m, [pl]) if isinstance(pl, Partial)
                          else distribute_tensor(t.clone(), m, [pl]))
            params.append(p)
        ref = torch.linalg.vector_norm(torch.cat([t.flatten() for t in full]))
        ref_inf = max(t.abs().max() for t in full)
        got = total_grad_norm(params)
        got_inf = total_grad_norm(params, float("inf"))
        clip_grad_norm_(params, 1.0)
        after = total_grad_norm(params)
        ok = (abs(got - ref) < 1e-5 and abs(got_inf - ref_inf) < 1e-6
              and abs(after - 1.0) < 1e-4)
        if rank == 0:
            Path(out_path).write_text(f"{bool(ok)} {got.item()} {ref.item()} {after.item()}")
        dist.barrier()  # no rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_grad_norm_of_sharded_replicated_partial_dtensors_on_two_meshes(tmp_path, monkeypatch):
    import torch.multiprocessing as mp
    out = tmp_path / "out.txt"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = mp.spawn(_norm_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=False)
    for _ in range(300):  # at most 5 minutes
        if ctx.join(timeout=1):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail("the grad-norm ranks did not finish within 5 minutes")
    assert out.read_text().startswith("True"), out.read_text()
