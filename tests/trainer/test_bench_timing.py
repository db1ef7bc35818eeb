"""The benchmarks' round-robin timing (tools/bench_common.py) on 2 gloo ranks: the CPU time it
reports next to the wall time tells a step that computes from one that waits."""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import run_distributed

from tools.bench_common import time_round_robin


class _Stepper:
    """A stand-in trainer: each step either spins for `seconds` of this process's CPU time or
    sleeps for `seconds` of wall time."""

    dp_degree = 1

    def __init__(self, seconds: float, spin: bool):
        self.seconds, self.spin = seconds, spin
        self.dataloader = [(torch.zeros(1, 4), torch.zeros(1, 4))] * 8

    def train_step(self, inputs, labels):
        if self.spin:
            end = time.process_time() + self.seconds
            while time.process_time() < end:
                pass
        else:
            time.sleep(self.seconds)
        return torch.tensor(1.0), None

    def reduce_mean(self, x: float) -> float:
        return x


def _timed(rank: int, world: int) -> dict:
    return time_round_robin({"spins": _Stepper(0.1, True), "sleeps": _Stepper(0.1, False)}, warmup=1, steps=3)


@pytest.mark.slow
def test_cpu_seconds_count_the_work_of_every_rank_not_the_waiting():
    rows = run_distributed(_timed, 2)[0]
    for name in ("spins", "sleeps"):
        assert 0.09 < rows[name]["step_s"] < 2.0, rows
    # both ranks spun for 0.1 CPU seconds: 0.2 a step in all, however the cores were shared
    assert 0.19 < rows["spins"]["cpu_s"] < 0.3, rows
    assert rows["sleeps"]["cpu_s"] < 0.05, rows
