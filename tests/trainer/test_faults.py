"""Faults a job meets while it runs: non-finite values stop it (or are skipped) before the
optimizer applies them, SIGTERM finishes the step, saves and exits 0, and the run resumes."""

import errno
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from trainer_helpers import read_losses

from trainer.checkpoint import complete_checkpoints
from trainer.errors import TrainingFault
from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--metrics.log_freq", "1"]


def _poison(trainer: Trainer, steps: set[int]) -> None:
    """Make the output of the first block's attention infinite at the given steps (a forward hook:
    the fault comes from outside the trainer, as a bad batch or an overflow would)."""
    calls = {"n": 0}

    def hook(module, args, out):
        calls["n"] += 1
        return out * float("inf") if calls["n"] in steps else out

    trainer.model.layers[0].attention.register_forward_hook(hook)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_a_nonfinite_step_stops_the_job_before_the_optimizer_and_names_step_and_parameter(cfg_factory, tmp_path):
    cfg = cfg_factory(extra=[*SMALL, "--training.steps", "5", "--checkpoint.enable", "--checkpoint.interval", "2"])
    tr = Trainer(cfg)
    _poison(tr, {3})
    with pytest.raises(TrainingFault) as e:
        tr.train()
    msg = str(e.value)
    assert msg.startswith("step 3: non-finite loss or gradient norm (first non-finite gradient: ")
    assert "skip_nonfinite_steps" in msg
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())  # the optimizer never stepped on it
    assert list(complete_checkpoints(tr.checkpointer.folder)) == [2]  # nothing written after the fault


def test_skipped_nonfinite_steps_leave_the_weights_and_training_goes_on(cfg_factory):
    cfg = cfg_factory(extra=[*SMALL, "--training.steps", "4", "--training.skip_nonfinite_steps", "1"])
    tr = Trainer(cfg)
    _poison(tr, {3})
    before = {}

    real_next = tr.next_step

    def next_step():
        if tr.step == 2:
            before.update(_weights(tr))
        out = real_next()
        if tr.step == 3:  # the skipped step changed nothing
            after = _weights(tr)
            assert all(torch.equal(before[n], after[n]) for n in before)
        return out

    tr.next_step = next_step
    logged = tr.train()
    assert sorted(logged) == [1, 2, 3, 4] and not math.isfinite(logged[3]) and math.isfinite(logged[4])
    (said,) = tr.guard.skipped  # the warning logged
    assert said.startswith("step 3: non-finite") and "step skipped (1 of training.skip_nonfinite_steps = 1)" in said
    # a second poisoned step is one too many
    tr2 = Trainer(cfg_factory(extra=[*SMALL, "--training.steps", "4", "--training.skip_nonfinite_steps", "1"],
                              job="twice"))
    _poison(tr2, {2, 3})
    with pytest.raises(TrainingFault, match=r"^step 3: .*all 1 allowed skips used"):
        tr2.train()


def _train_cmd(tmp_path: Path, steps: int) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--config", "llama3_debug", *SMALL, "--training.steps",
            str(steps), "--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--job.dump_folder",
            str(tmp_path), "--job.name", "preempted"]


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_0_and_the_same_command_resumes(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_train_cmd(tmp_path, 1000), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    lines = []
    deadline = time.time() + 120
    for line in proc.stdout:  # wait until it trains, then preempt it
        lines.append(line)
        if line.startswith("step 3 |") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 0, out[-2000:]
    stop = [ln for ln in out.splitlines() if "on SIGTERM" in ln]
    assert len(stop) == 1 and "run the same command to resume" in stop[0], out[-2000:]
    step = int(stop[0].split("stopped after step ")[1].split()[0])
    assert step >= 3 and list(complete_checkpoints(tmp_path / "preempted" / "checkpoints")) == [step]
    r = subprocess.run(_train_cmd(tmp_path, step + 2), capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"resumed from {tmp_path / 'preempted' / 'checkpoints' / f'step-{step}'} at step {step}" in r.stdout
    assert sorted(read_losses(tmp_path, "preempted"))[-1] == step + 2


# --------------------------------------------------------------------------- checkpoints

CKPT = [*SMALL, "--checkpoint.enable", "--checkpoint.interval", "2"]


def _run(cfg_factory, steps: int, job: str, extra=()) -> Trainer:
    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", str(steps), *extra], job=job))
    tr.train()
    return tr


def _shard(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]


@pytest.mark.parametrize("damage", ["truncated", "deleted", "flipped", "no manifest", "unloadable"])
def test_a_damaged_latest_checkpoint_is_skipped_for_the_previous_one_and_the_losses_are_identical(
        cfg_factory, tmp_path, damage, monkeypatch):
    from trainer.checkpoint_files import MANIFEST, write_manifest

    said: list[str] = []
    monkeypatch.setattr(logging.getLogger("autotitan"), "warning", lambda msg, *a, **k: said.append(msg))

    ref = _run(cfg_factory, 6, "ref")
    _run(cfg_factory, 4, "job")
    folder = tmp_path / "job" / "checkpoints"
    shard = _shard(folder / "step-4")
    data = shard.read_bytes()
    if damage in ("truncated", "unloadable"):
        shard.write_bytes(data[: len(data) // 2])
        if damage == "unloadable":  # a manifest that matches the bad file: only DCP's read finds it
            write_manifest(folder / "step-4", {})
    elif damage == "deleted":
        shard.unlink()
    elif damage == "flipped":  # the same size, one block changed: only the checksum finds it
        shard.write_bytes(data[:4096] + bytes(b ^ 0xFF for b in data[4096:8192]) + data[8192:])
    else:
        (folder / "step-4" / MANIFEST).unlink()
    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "6"], job="job"))
    if damage != "unloadable":
        assert tr.resume_step == 2  # the plan and sequence length are chosen for the step it will really load
        assert tr.checkpointer.find() == folder / "step-2"
    tr.train()
    reason = {"truncated": "bytes, not the", "deleted": "is missing", "flipped": "does not match its checksum",
              "no manifest": "has no manifest.json", "unloadable": "could not be loaded"}[damage]
    assert any(str(folder / "step-4") in m and reason in m for m in said), said
    losses, want = read_losses(tmp_path, "job"), read_losses(tmp_path, "ref")
    assert {s: losses[s] for s in (3, 4, 5, 6)} == {s: want[s] for s in (3, 4, 5, 6)}  # bit-identical
    assert ref.step == tr.step == 6


def test_the_damage_is_named(tmp_path):
    from trainer.checkpoint import damage, intact_checkpoints

    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / ".metadata").write_bytes(b"m")
    (tmp_path / "step-2" / "__0_0.distcp").write_bytes(b"abcd")
    (tmp_path / "step-2" / "manifest.json").write_text('{"files": {".metadata": 1, "__0_0.distcp": 8}}')
    assert damage(tmp_path / "step-2") == f"{tmp_path / 'step-2' / '__0_0.distcp'} is 4 bytes, not the 8 written"
    assert intact_checkpoints(tmp_path) == {}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_save_that_cannot_be_written_stops_the_job_and_keeps_the_previous_checkpoint(
        cfg_factory, tmp_path, monkeypatch, code):
    import torch.distributed.checkpoint as dcp

    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "4"], job="full"))
    real = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if "step-4" in str(self.path):
            raise OSError(code, os.strerror(code))
        return real(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    with pytest.raises(TrainingFault) as e:
        tr.train()
    folder = tmp_path / "full" / "checkpoints"
    msg = str(e.value)
    assert msg.startswith(f"step 4: the checkpoint could not be written to {folder} ({os.strerror(code).lower()})")
    assert "MiB" in msg and f"{folder / 'step-2'} stays the latest" in msg
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]  # nothing half-written left


def test_a_dump_folder_that_cannot_be_written_is_a_config_error_before_any_work(cfg_factory, tmp_path):
    from trainer.config import ConfigError

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"'job.dump_folder' = '.*a_file': cannot write"):
        Trainer(cfg_factory(extra=[*SMALL, "--job.dump_folder", str(blocker)]))


def test_a_kill_while_pruning_leaves_a_loadable_latest(cfg_factory, tmp_path, monkeypatch):
    import shutil

    real = shutil.rmtree

    def killed(path, *a, **k):  # the process dies after the first file of the old checkpoint went
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt

    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "4", "--checkpoint.keep_latest_k", "1"], job="prune"))
    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        tr.train()
    monkeypatch.setattr(shutil, "rmtree", real)
    folder = tmp_path / "prune" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2.deleting", "step-4"]
    again = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "5", "--checkpoint.keep_latest_k", "1"],
                                job="prune"))
    again.train()
    assert again.step == 5 and not (folder / "step-2.deleting").exists()


def test_a_checkpoint_of_another_model_is_one_error_naming_the_mismatch(cfg_factory, tmp_path):
    from trainer.config import ConfigError

    _run(cfg_factory, 2, "other")
    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "4", "--model.dim", "128", "--model.n_heads", "4"],
                             job="other"))
    with pytest.raises(ConfigError, match=r"checkpoint .*step-2 was written by another model: .*\(this model: "):
        tr.train()


# --------------------------------------------------------------------------- stalled ranks


def _workers(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (their RANK environment variable)."""
    kids = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    out = {}
    for k in kids:
        env = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
        out.update({int(e[5:]): int(k) for e in env if e.startswith(b"RANK=")})
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_named_and_leaves_no_process(tmp_path):
    cmd = ["torchrun", "--nproc_per_node", "2", str(ROOT / "train.py"), "--config", "llama3_debug", *SMALL,
           "--training.steps", "100000", "--comm.timeout_s", "3", "--job.dump_folder", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3 |"):
            break
    ranks = _workers(proc.pid)
    os.kill(ranks[1], signal.SIGSTOP)  # rank 1 hangs (a dead GPU, a stuck filesystem)
    stopped = time.time()
    fault = None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("training fault:"):
            fault, found = line, time.time() - stopped
            break
    proc.wait(timeout=120)
    out = "".join(lines)
    assert fault is not None, out[-3000:]
    assert found < 3 + 10  # the timeout, and the time to say so
    assert "a collective timed out after 3 s ([comm] timeout_s); stalled: rank 1 (silent for" in fault
    assert "rank 0 waited in" in fault and "restart it" in fault
    assert proc.returncode != 0 and not any(_alive(p) for p in ranks.values())  # no rank left behind
