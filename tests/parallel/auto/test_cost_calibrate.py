"""Calibration for `hardware = "auto"`: 2 gloo ranks measure this machine and cache it."""
from __future__ import annotations

import dataclasses

import pytest

from parallel.auto.cost import CostModel, load_hardware
from parallel.auto.cost.calibrate import cache_path, calibrated_profile
from parallel.auto.cost.calibrate_ops import OP_CLASSES
from parallel.auto.cost.comm import collective_time


@pytest.mark.slow
def test_calibration_measures_caches_and_reuses(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("AUTOTITAN_CACHE", str(tmp_path / "cache"))
    from tools import calibrate as cal

    out = tmp_path / "measured.toml"
    assert cal.main(["--world-size", "2", "--recalibrate", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gloo latency" in printed and "comm overlap" in printed  # what it measured
    hw = load_hardware(str(out))
    assert hw.name == "auto" and hw.peak_tflops["fp32"] > 0 and hw.matmul_efficiency == 1.0
    assert all(v > 0 for v in hw.intra_node.bus_bandwidth_gbps.values()) and hw.intra_node.latency_us > 0
    assert 0.0 <= hw.comm_overlap <= 1.0
    assert set(hw.op_bandwidth_gbps) == set(OP_CLASSES) and all(v > 0 for v in hw.op_bandwidth_gbps.values())
    assert hw.optimizer["gbps"] > 0 and hw.optimizer["tensor_us"] >= 0  # a real AdamW step, measured
    cached = cache_path(2)
    assert cached.is_file() and cached.read_text() == out.read_text()
    mtime = cached.stat().st_mtime
    assert calibrated_profile(2) == load_hardware(cached)  # served from the cache: not measured again
    assert cached.stat().st_mtime == mtime
    CostModel(str(out), (2,))  # usable as a profile


def _timed_turn() -> list[tuple[float, float]]:
    """On every rank: one_rank_at_a_time over a 0.2 s call; every rank's (start, end)."""
    import time

    import torch.distributed as dist

    from parallel.auto.cost.calibrate import one_rank_at_a_time

    def call() -> dict[str, float]:
        start = time.time()
        time.sleep(0.2)
        return {"start": start, "end": time.time()}

    mine = one_rank_at_a_time(call)
    spans: list = [None] * dist.get_world_size()
    dist.all_gather_object(spans, (mine["start"], mine["end"]))
    return spans


@pytest.mark.slow
def test_the_optimizer_is_measured_one_rank_at_a_time():
    """Its calls are too long to find the cores free with every rank busy: the ranks take turns."""
    from tools.bench_common import run_on_ranks

    spans = sorted(run_on_ranks(_timed_turn, 2, timeout=120))
    assert len(spans) == 2 and all(end - start >= 0.2 for start, end in spans)
    assert spans[0][1] <= spans[1][0], spans  # never both at once


def test_latency_split_passes_through_the_pair_and_the_world():
    from parallel.auto.cost.calibrate import split_latency

    fixed, hop = split_latency(6000.0, 4, 2000.0)  # 4 ranks sync in 6 ms, a pair of them in 2 ms
    assert fixed + hop == pytest.approx(2000.0) and fixed + 3 * hop == pytest.approx(6000.0)
    link = CostModel("cpu", (2, 2)).links[0]
    link = dataclasses.replace(link, latency_us=fixed, hop_latency_us=hop)
    assert collective_time("all_gather", 1.0, link)[0] == pytest.approx(2000.0, rel=1e-3)  # a pair's gather
    # no pair measured (2 ranks), or a noisy pair slower than the world: half fixed, half per hop
    assert split_latency(6000.0, 2, None) == (3000.0, 3000.0)
    assert split_latency(6000.0, 4, 7000.0) == (3000.0, 1000.0)
    assert split_latency(6000.0, 4, 500.0) == (0.0, 2000.0)  # a pair too fast to be linear: no fixed part


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


@pytest.mark.slow
def test_a_port_taken_before_rank_0_listens_is_tried_again(monkeypatch):
    """`free_port` can hand out a port another process takes before the ranks start (two test
    workers launching at once): the launch is tried again on a new port."""
    import socket

    from tools import bench_common

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], bench_common.free_port()])
    monkeypatch.setattr(bench_common, "free_port", lambda: next(ports))
    try:
        assert bench_common.run_on_ranks(_world_size, 2, timeout=120) == 2
    finally:
        taken.close()
    with pytest.raises(StopIteration):
        next(ports)  # both ports were used: the first launch failed, the second ran
