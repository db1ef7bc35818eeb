"""Async checkpoints (`[checkpoint] async_mode = "async"`): the next steps run while the save is
written, the saved tensors are those of the saved step (equal to a blocking save's), a resumed
run's losses equal the uninterrupted run's, and a kill -9 inside an async save leaves the
previous checkpoint the latest complete one."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from trainer_helpers import FAST, read_losses

from trainer.checkpoint import complete_checkpoints
from trainer.config import ConfigError
from trainer.errors import TrainingFault
from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--training.local_batch_size", "2",
        "--lr_scheduler.decay_steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
        "--checkpoint.keep_latest_k", "0"]
ASYNC = ["--checkpoint.async_mode", "async"]

# Run under torchrun: jobs `block` (blocking saves) and `async` in the same 2 ranks. The async
# job's write of step-2 is held (DCP's FileSystemWriter.write_data, in its background thread)
# until the main thread has finished step 3, whose optimizer step changed the weights: the
# saved tensors must still be step 2's. KILL: rank 1 is killed -9 inside the write of step-6.
DRIVER = """
import os, sys, time
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import train
from trainer.config import load_config
from trainer.trainer import Trainer

dump, jobs, kill = sys.argv[1], sys.argv[2].split(","), sys.argv[3] == "kill"
done = {{"step": 0}}
write = dcp.FileSystemWriter.write_data

def write_data(self, plan, planner):
    path = str(self.path)
    if "/async/" in path and path.endswith("step-2.tmp"):
        deadline = time.time() + 60
        while done["step"] < 3 and time.time() < deadline:
            time.sleep(0.005)
        print(f"rank {{dist.get_rank()}}: step-2 written after step {{done['step']}}", flush=True)
    if kill and "/async/" in path and path.endswith("step-6.tmp") and dist.get_rank() == 1:
        os.kill(os.getpid(), 9)
    return write(self, plan, planner)

dcp.FileSystemWriter.write_data = write_data
train.init_distributed()
for job in jobs:
    cfg = load_config("llama3_debug", [*{args!r}, *(["--checkpoint.async_mode", "async"] if job == "async" else []),
                                       "--job.dump_folder", dump, "--job.name", job])
    tr = Trainer(cfg)
    step = tr.next_step
    def next_step(step=step, tr=tr):
        out = step()
        done["step"] = tr.step
        return out
    tr.next_step = next_step
    tr.train()
dist.barrier()
dist.destroy_process_group()
"""


def _torchrun(tmp_path: Path, jobs: str, kill: bool) -> subprocess.CompletedProcess:
    args = [*FAST, *TINY, "--training.steps", "6"]
    driver = DRIVER.format(args=args)
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))  # the driver imports train.py from the root
    script = tmp_path / f"driver_{jobs.replace(',', '_')}.py"
    script.write_text(driver)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path), jobs, "kill" if kill else "-"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _tensors(path: Path, out: Path) -> dict:
    """A DCP checkpoint as one flat {key: value} (read in this single process)."""
    dcp_to_torch_save(str(path), str(out))
    flat = {}

    def walk(prefix: str, x) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = x

    walk("", torch.load(out, weights_only=False))
    return flat


def _assert_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    assert any(k.startswith("model.") for k in a) and any(k.startswith("optimizer.") for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.slow
def test_async_saves_equal_blocking_ones_and_a_kill_inside_one_resumes_bit_identically(tmp_path):
    # 2 gloo ranks (FSDP): blocking job, then the async job, killed -9 (rank 1) inside step-6's write
    r = _torchrun(tmp_path, "block,async", kill=True)
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "rank 0: step-2 written after step 3" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "rank 1: step-2 written after step 3" in r.stdout  # training went on while the save was written
    block, asyn = tmp_path / "block" / "checkpoints", tmp_path / "async" / "checkpoints"
    assert sorted(complete_checkpoints(block)) == [2, 4, 6]
    assert sorted(complete_checkpoints(asyn)) == [2, 4]  # step-6 was being written: not complete
    for step in (2, 4):  # the state of the saved step, not of a later one
        _assert_equal(_tensors(asyn / f"step-{step}", tmp_path / "a.pt"),
                      _tensors(block / f"step-{step}", tmp_path / "b.pt"))

    # the same job again: resumes from step 4 and ends as the uninterrupted one, bit for bit
    r = _torchrun(tmp_path, "async", kill=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"resumed from {asyn / 'step-4'} at step 4" in r.stdout + r.stderr
    assert read_losses(tmp_path, "async") == read_losses(tmp_path, "block")
    assert sorted(complete_checkpoints(asyn)) == [2, 4, 6] and not (asyn / "step-6.tmp").exists()
    _assert_equal(_tensors(asyn / "step-6", tmp_path / "a.pt"), _tensors(block / "step-6", tmp_path / "b.pt"))


def test_an_async_save_in_one_process_equals_a_blocking_one_and_training_goes_on(cfg_factory, tmp_path):
    ck = [*TINY, "--training.steps", "3"]
    asyn = Trainer(cfg_factory(extra=[*ck, *ASYNC], job="async"))
    pending_during = []
    step = asyn.next_step

    def next_step():
        out = step()
        pending_during.append(asyn.checkpointer._pending is not None)
        return out

    asyn.next_step = next_step
    losses = asyn.train()
    assert pending_during == [False, True, True]  # step 3 ran with step 2's save in flight
    assert losses == Trainer(cfg_factory(extra=ck, job="block")).train()
    folder = tmp_path / "async" / "checkpoints"
    assert sorted(complete_checkpoints(folder)) == [2, 3] and asyn.checkpointer._pending is None
    _assert_equal(_tensors(folder / "step-2", tmp_path / "a.pt"),
                  _tensors(tmp_path / "block" / "checkpoints" / "step-2", tmp_path / "b.pt"))


def test_a_fault_with_an_async_save_in_flight_completes_it_first(cfg_factory, tmp_path):
    """A non-finite step (every rank stops on it) while step 2's save is written: step-2 is still
    made complete, as a blocking save would have been."""
    tr = Trainer(cfg_factory(extra=[*TINY, *ASYNC, "--training.steps", "4"], job="fault"))
    calls = {"n": 0}

    def poison(module, args, out):
        calls["n"] += 1
        return out * float("inf") if calls["n"] == 3 else out

    tr.model.layers[0].attention.register_forward_hook(poison)
    with pytest.raises(TrainingFault, match=r"^step 3: non-finite"):
        tr.train()
    folder = tmp_path / "fault" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"] and tr.checkpointer._pending is None


def test_an_async_write_that_fails_stops_the_job_at_the_next_save_naming_its_step(cfg_factory, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if "step-4" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    tr = Trainer(cfg_factory(extra=[*TINY, *ASYNC, "--training.steps", "6"], job="full"))
    with pytest.raises(TrainingFault) as e:
        tr.train()
    folder = tmp_path / "full" / "checkpoints"
    assert str(e.value).startswith(f"step 4: the checkpoint could not be written to {folder} (no space left on device)")
    assert f"{folder / 'step-2'} stays the latest" in str(e.value)
    assert tr.step == 6 and sorted(p.name for p in folder.iterdir()) == ["step-2"]  # found at the step-6 save


def test_an_unknown_async_mode_is_a_config_error_naming_key_and_value(cfg_factory):
    with pytest.raises(ConfigError, match=r"'checkpoint.async_mode' = 'threads': must be one of 'disabled', 'async'"):
        cfg_factory(extra=["--checkpoint.async_mode", "threads"])
