"""Deletes confined and asked for: folders a config names stay inside the run folder, one job
at a time per run folder, only the trainer's own unfinished folders are cleaned, a rollback
moves newer checkpoints aside, a checkpoint that fails to load is renamed ``.corrupt``, and a
conversion does not replace an existing or overlapping destination without ``--overwrite``."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tools import convert_hf
from trainer.checkpoint import complete_checkpoints
from trainer.checkpoint_files import write_manifest
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.run_folder import LOCK, RunFolderLock
from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
CKPT = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "1"]


@pytest.mark.parametrize(("override", "key"), [
    (["--job.name", "../../../etc"], "'job.name' = '../../../etc'"),
    (["--job.name", "/etc"], "'job.name' = '/etc'"),
    (["--checkpoint.folder", "/tmp/elsewhere"], "'checkpoint.folder' = '/tmp/elsewhere'"),
    (["--checkpoint.folder", "../other_job"], "'checkpoint.folder' = '../other_job'"),
    (["--checkpoint.folder", "."], "'checkpoint.folder' = '.'"),
    (["--profiling.save_traces_folder", "../../t"], "'profiling.save_traces_folder' = '../../t'"),
])
def test_folders_that_leave_the_run_folder_are_refused(tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"{key}: .*(inside job.dump_folder|inside the run folder)"):
        load_config("llama3_debug", ["--job.dump_folder", str(tmp_path), *override], world_size=1)
    ok = load_config("llama3_debug", ["--job.dump_folder", str(tmp_path), "--job.name", "team/run1",
                                      "--checkpoint.folder", "ckpt/a"], world_size=1)
    assert ok.job.name == "team/run1"


@pytest.mark.slow
def test_print_config_exits_2_on_an_escaping_folder(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "llama3_debug", "--print-config",
                        "--job.dump_folder", str(tmp_path), "--job.name", "../../../etc"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "'job.name' = '../../../etc'" in r.stderr


HOLDER = """
import sys, time
from trainer.run_folder import RunFolderLock
RunFolderLock(sys.argv[1], 0).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_job_on_a_locked_run_folder_is_one_line_naming_the_holder(tmp_path):
    run = tmp_path / "job"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"^run folder {run} is in use by another job: pid {holder.pid} on "):
            RunFolderLock(run, 0).acquire(wait_s=0.5)
        # a holder that goes away while a restart waits: the restart gets the folder
        threading.Timer(1.0, holder.kill).start()
        lock = RunFolderLock(run, 0)
        lock.acquire(wait_s=30)
        lock.release()
    finally:
        holder.kill()
        holder.wait()
    lock = RunFolderLock(run, 0)  # a killed holder leaves no stale lock: the kernel dropped it
    lock.acquire()
    assert f"pid {os.getpid()} " in (run / LOCK).read_text()
    lock.release()


FORKS_AND_DIES = """
import os, sys, time
from trainer.run_folder import RunFolderLock
RunFolderLock(sys.argv[1], 0).acquire()
child = os.fork()
if child == 0:  # a worker forked by the job (a data loader's, a compiler's) outlives it
    null = os.open(os.devnull, os.O_WRONLY)  # off the job's output pipes: the test reads them to their end
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(30)
    os._exit(0)
print("forked", child, flush=True)
os._exit(0)  # the job dies (kill -9 alike: nothing released by hand)
"""


def test_a_forked_child_that_outlives_the_job_does_not_keep_the_lock(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", FORKS_AND_DIES, str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=60, check=False)
    said, child = r.stdout.split()
    assert said == "forked", r.stderr
    try:
        os.kill(int(child), 0)  # the orphaned child is still sleeping ...
        lock = RunFolderLock(tmp_path, 0)
        lock.acquire()  # ... and the folder is free
        lock.release()
    finally:
        os.kill(int(child), signal.SIGKILL)


def test_only_the_trainers_unfinished_folders_are_cleaned(cfg_factory, tmp_path):
    folder = tmp_path / "j" / "checkpoints"
    names = ["step-3.tmp", "step-4.deleting", "notes.tmp", "mine.deleting", "step-5", "step-6.abandoned"]
    for n in names:
        (folder / n).mkdir(parents=True)
        (folder / n / "file").write_text("keep")
    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "1"], job="j"))
    tr.train()
    left = sorted(p.name for p in folder.iterdir())
    assert left == ["mine.deleting", "notes.tmp", "step-1", "step-5", "step-6.abandoned"]
    assert all((folder / n / "file").read_text() == "keep" for n in left if n != "step-1")


def test_a_rollback_moves_newer_checkpoints_aside_and_a_plain_restart_follows_the_new_run(cfg_factory, tmp_path):
    ck = [*CKPT, "--checkpoint.keep_latest_k", "2"]
    Trainer(cfg_factory(extra=[*ck, "--training.steps", "4"], job="r")).train()
    folder = tmp_path / "r" / "checkpoints"
    assert sorted(complete_checkpoints(folder)) == [3, 4]
    rolled = Trainer(cfg_factory(extra=[*ck, "--training.steps", "5", "--checkpoint.load_step", "3",
                                        "--lr_scheduler.warmup_steps", "1"], job="r")).train()
    assert sorted(rolled) == [4, 5]
    # the abandoned run's step 4 is kept aside; pruning kept the new run's 4 and 5
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-4.abandoned", "step-5"]
    again = Trainer(cfg_factory(extra=[*ck, "--training.steps", "6"], job="r"))
    assert again.resume_step == 5
    with pytest.raises(ConfigError, match=r"^'checkpoint.load_step' = 1: there is no complete checkpoint step-1 "):
        Trainer(cfg_factory(extra=[*ck, "--training.steps", "6", "--checkpoint.load_step", "1"], job="r"))


def test_a_checkpoint_that_fails_to_load_is_renamed_corrupt_and_the_previous_one_used(cfg_factory, tmp_path):
    Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "2"], job="c")).train()
    folder = tmp_path / "c" / "checkpoints"
    bad = folder / "step-2"
    (bad / ".metadata").write_bytes(b"not a pickle at all")
    (bad / "manifest.json").unlink()
    write_manifest(bad, {})  # its checksums agree: only loading it can find the damage
    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "3"], job="c"))
    assert tr.resume_step == 2  # its checksums pass: only the load finds it broken
    assert sorted(tr.train()) == [2, 3]
    assert (folder / "step-2.corrupt" / ".metadata").read_bytes() == b"not a pickle at all"
    assert sorted(complete_checkpoints(folder)) == [2, 3]


def test_a_checkpoint_whose_items_fail_to_load_is_renamed_corrupt(cfg_factory, tmp_path):
    Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "2"], job="d")).train()
    folder = tmp_path / "d" / "checkpoints"
    shard = next((folder / "step-2").glob("*.distcp"))
    shard.write_bytes(b"\0" * 16)  # the items' bytes gone, the manifest rewritten to agree
    (folder / "step-2" / "manifest.json").unlink()
    write_manifest(folder / "step-2", {})
    tr = Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "3"], job="d"))
    assert sorted(tr.train()) == [2, 3]
    assert (folder / "step-2.corrupt").is_dir()
    t0 = time.time()
    assert Trainer(cfg_factory(extra=[*CKPT, "--training.steps", "3"], job="d")).resume_step == 3
    assert time.time() - t0 < 60


def test_a_conversion_keeps_an_existing_or_overlapping_destination_unless_overwrite(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "hf"
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(hf)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "precious.txt").write_text("mine")
    capsys.readouterr()  # transformers' progress bars
    assert convert_hf.main(["to-dcp", str(hf), str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{taken}: the destination exists and is not empty" in err and "--overwrite" in err
    assert (taken / "precious.txt").read_text() == "mine"
    assert convert_hf.main(["to-dcp", str(hf), str(tmp_path)]) == 2  # the parent: it holds the source
    assert "the destination holds the source" in capsys.readouterr().err and (hf / "config.json").is_file()
    assert convert_hf.main(["to-dcp", str(hf), str(tmp_path / "dcp")]) == 0
    assert convert_hf.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "dcp")]) == 2
    assert "the destination is the source" in capsys.readouterr().err
    assert convert_hf.main(["to-hf", str(tmp_path / "dcp"), str(taken), "--overwrite"]) == 0
    assert not (taken / "precious.txt").exists() and (taken / "config.json").is_file()
