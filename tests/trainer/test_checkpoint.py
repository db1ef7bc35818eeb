"""DCP checkpoints: resume equality, keep_latest_k, load_step, killed saves."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import FAST, read_losses

from trainer.checkpoint import complete_checkpoints
from trainer.errors import ConfigError
from trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
# a fixed schedule (decay_steps) so that a run split in two follows the same lr
SPLIT = ["--lr_scheduler.decay_steps", "6"]
# train.py with a SIGKILL injected right before the rename that makes step-N valid
# (after every file of step-N.tmp, .metadata included, is written)
KILLED_AT_RENAME = """
import os, sys
import train  # found through PYTHONPATH (the project root)
rename = os.replace
def replace(src, dst):
    if str(src).endswith("step-{step}.tmp"):
        os.kill(os.getpid(), 9)
    rename(src, dst)
os.replace = replace
sys.exit(train.main(sys.argv[1:]))
"""


def test_resume_gives_the_same_losses(cfg_factory, tmp_path):
    full = Trainer(cfg_factory(extra=["--training.steps", "8"] + SPLIT, job="full")).train()
    ck = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"] + SPLIT
    first = Trainer(cfg_factory(extra=["--training.steps", "4"] + ck, job="split")).train()
    assert sorted(complete_checkpoints(tmp_path / "split" / "checkpoints")) == [4]
    second = Trainer(cfg_factory(extra=["--training.steps", "8"] + ck, job="split")).train()
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    assert {**first, **second} == full  # bitwise equal in fp32
    assert read_losses(tmp_path, "split") == full


def test_keep_latest_k_and_load_step(cfg_factory, tmp_path):
    ck = ["--checkpoint.enable", "true", "--checkpoint.interval", "1",
          "--checkpoint.keep_latest_k", "2", "--training.steps", "4"]
    Trainer(cfg_factory(extra=ck, job="k")).train()
    folder = tmp_path / "k" / "checkpoints"
    assert sorted(complete_checkpoints(folder)) == [3, 4]
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-4"]
    t = Trainer(cfg_factory(extra=ck[:-1] + ["5", "--checkpoint.load_step", "3"], job="k"))
    assert sorted(t.train()) == [4, 5]
    with pytest.raises(ConfigError, match="'checkpoint.load_step' = 1: there is no complete checkpoint step-1"):
        Trainer(cfg_factory(extra=ck + ["--checkpoint.load_step", "1"], job="k")).train()


@pytest.mark.slow
def test_killed_save_is_not_used_on_restart(cfg_factory, tmp_path):
    """kill -9 between writing step-4's files and the rename: restart resumes from
    step 2, deletes the .tmp folder, and the losses equal an uninterrupted run."""
    args = FAST + SPLIT + ["--job.dump_folder", str(tmp_path), "--job.name", "killed",
                           "--training.steps", "6", "--checkpoint.enable", "true",
                           "--checkpoint.interval", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("WORLD_SIZE", None)
    driver = KILLED_AT_RENAME.format(step=4)
    r = subprocess.run([sys.executable, "-c", driver, "--config", "llama3_debug", *args],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == -9, r.stderr[-2000:]
    folder = tmp_path / "killed" / "checkpoints"
    assert (folder / "step-4.tmp" / ".metadata").is_file()  # all files, just not renamed
    assert sorted(complete_checkpoints(folder)) == [2]

    resumed = Trainer(cfg_factory(extra=["--training.steps", "6", "--checkpoint.enable",
                                         "true", "--checkpoint.interval", "2"] + SPLIT,
                                  job="killed")).train()
    assert sorted(resumed) == [3, 4, 5, 6]
    assert not (folder / "step-4.tmp").exists()
    assert sorted(complete_checkpoints(folder)) == [4, 6]  # keep_latest_k = 2
    full = Trainer(cfg_factory(extra=["--training.steps", "6"] + SPLIT, job="full")).train()
    assert {k: full[k] for k in resumed} == resumed
