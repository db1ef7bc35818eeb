"""Configuration errors on 2 gloo ranks end the run with one line from rank 0 naming the
key and the fix, exit code 2 on every rank, no traceback and no hang.

torchrun itself always exits 1 with its own ChildFailedError summary, and stops the other
ranks (SIGTERM) once one has exited; train.py lets rank 0, which reports, exit first. So
under torchrun rank 0's exit code (read from torchrun's summary) is 2 and the others' 2 or
SIGTERM; the ranks' output comes from torchrun's per-rank log files (``--log-dir
--redirects 3``). The planning failure, where rank 1 waits in the plan broadcast, is also
launched without torchrun, so that rank 1's own exit code (2) shows that it raised the
broadcast error instead of hanging.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--training.steps", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SIGTERM = -15


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(tmp_path: Path, args: list[str]) -> tuple[dict[int, int], dict[int, str]]:
    """train.py under torchrun on 2 ranks: ({rank: exit code}, {rank: stderr})."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--log-dir", str(logs), "--redirects", "3", str(ROOT / "train.py"), *SMALL,
           "--job.dump_folder", str(tmp_path), *args]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode != 0, r.stderr[-3000:]
    codes = {int(rank): int(code) for rank, code in re.findall(
        r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", r.stderr)}
    errs = {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stderr.log")}
    return codes, errs


def launch(tmp_path: Path, args: list[str]) -> tuple[dict[int, int], dict[int, str]]:
    """The 2 ranks started as torchrun starts them (its env variables), without torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**_env(), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        err = open(tmp_path / f"rank{rank}.err", "w")  # noqa: SIM115 - closed below
        out = open(tmp_path / f"rank{rank}.out", "w")  # noqa: SIM115
        cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, "--job.dump_folder", str(tmp_path), *args]
        procs.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=err), out, err))
    codes = {}
    for rank, (p, out, err) in enumerate(procs):
        codes[rank] = p.wait(timeout=300)
        out.close()
        err.close()
    return codes, {rank: (tmp_path / f"rank{rank}.err").read_text() for rank in range(2)}


def assert_one_line(codes: dict[int, int], errs: dict[int, str], *names: str, others: tuple = (2,)) -> None:
    assert codes.get(0) == 2, (codes, errs)
    assert codes.get(1, SIGTERM) in others, (codes, errs)
    lines = [line for line in errs[0].splitlines() if line.strip()]
    assert len(lines) == 1, errs[0]
    assert lines[0].startswith("config error: "), lines
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert "error" not in errs[1], errs[1]
    assert not any("Traceback" in e for e in errs.values()), errs


@pytest.mark.slow
def test_corrupt_plan_file(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text("this is not a plan {")
    codes, errs = torchrun(tmp_path, ["--config", "llama3_debug_auto", "--parallelism.plan_file", str(bad)])
    assert_one_line(codes, errs, "parallelism.plan_file", str(bad), "re-plan", others=(2, SIGTERM))


@pytest.mark.slow
def test_seq_len_beyond_the_flavor(tmp_path):
    codes, errs = torchrun(tmp_path, ["--config", "llama3_debug", "--training.seq_len", "4096"])
    assert_one_line(codes, errs, "llama3_debug.toml", "training.seq_len' = 4096", "max_seq_len = 2048",
                    "<= 2048", others=(2, SIGTERM))


@pytest.mark.slow
def test_infeasible_memory_budget(tmp_path):
    """Rank 0 finds no plan; rank 1, waiting for the plan, receives the error instead."""
    args = ["--config", "llama3_debug_auto", "--parallelism.memory_budget_high", "0.1", "--model.n_layers", "1"]
    names = ("llama3_debug_auto.toml", "parallelism.memory_budget_high' = 0.1", "unset it")
    codes, errs = torchrun(tmp_path / "torchrun", args)
    assert_one_line(codes, errs, *names, others=(2, SIGTERM))
    codes, errs = launch(tmp_path, args)
    assert_one_line(codes, errs, *names)
