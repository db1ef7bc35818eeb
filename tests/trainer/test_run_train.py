"""run_train.sh launches as TorchTitan's does: NGPU ranks, CONFIG_FILE, the console showing
LOG_RANK's output, and every further argument passed on to train.py unchanged."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "run_train.sh"


def _env(**kw: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE", "LOG_RANK", "LOG_DIR", "DRY_RUN",
                                                             "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **kw)
    return env


def _command(*args: str, **env: str) -> list[str]:
    r = subprocess.run(["bash", str(SCRIPT), *args], env=_env(DRY_RUN="1", **env), capture_output=True, text=True,
                       timeout=30, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout)


def test_defaults_are_the_main_job_on_two_ranks_showing_rank_0():
    cmd = _command()
    assert cmd[0] == "torchrun" and "--nproc_per_node=2" in cmd
    assert cmd[cmd.index("--local-ranks-filter") + 1] == "0" and cmd[cmd.index("--tee") + 1] == "3"
    assert cmd[-3:] == [str(ROOT / "train.py"), "--config", "configs/llama3_debug_auto.toml"]


def test_environment_and_overrides_reach_torchrun_and_train_py():
    cmd = _command("--training.steps", "5", "--job.name", "two words", NGPU="8", LOG_RANK="0,1",
                   CONFIG_FILE="llama3_debug", LOG_DIR="/tmp/logs")
    assert "--nproc_per_node=8" in cmd and cmd[cmd.index("--local-ranks-filter") + 1] == "0,1"
    assert cmd[cmd.index("--log-dir") + 1] == "/tmp/logs"
    i = cmd.index(str(ROOT / "train.py"))
    assert cmd[i + 1:] == ["--config", "llama3_debug", "--training.steps", "5", "--job.name", "two words"]


@pytest.mark.slow
def test_launches_two_ranks_and_shows_only_log_rank(tmp_path):
    """A real launch (torchrun, 2 ranks, each printing its resolved config): the override
    reaches every rank, and the console shows rank 1's output alone."""
    r = subprocess.run(["bash", str(SCRIPT), "--print-config", "--training.steps", "7", "--job.name", "two words"],
                       env=_env(NGPU="2", LOG_RANK="1", CONFIG_FILE="llama3_debug", LOG_DIR=str(tmp_path)),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[rank1]:steps = 7" in r.stdout and '[rank1]:name = "two words"' in r.stdout, r.stdout[-2000:]
    assert "[rank0]:" not in r.stdout
    # --tee 3: both ranks' output is in torchrun's log folder too
    logs = "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert logs.count("steps = 7") == 2, sorted(str(p) for p in tmp_path.rglob("*"))
