"""scripts/bench_memory.py measures distinct plans only: a requested plan that comes out as an
earlier one (same placements, mesh, activation checkpointing and compile setting) is named,
and the run exits 2 without a table; the same placements with activation checkpointing on
are another plan (issue 22: no statistics over duplicates)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SMALL = "--model.n_layers 1 --model.dim 64 --training.seq_len 32"


@pytest.mark.slow
def test_a_plan_requested_twice_is_named_and_the_run_exits_2():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_memory.py"), "--nproc", "2",
                        "--plans", "fsdp,fsdp_ac,fsdp", "--job", SMALL],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("bench_memory:"))
    assert "2 distinct plans of the 3 requested on 2 ranks" in line, line
    assert "fsdp is fsdp (placement digest" in line and "activation checkpointing auto" in line, line
    assert "fsdp_ac is" not in line  # the same placements with full AC: measured, not a duplicate
    assert "error = estimate / measured" not in r.stdout  # no table
