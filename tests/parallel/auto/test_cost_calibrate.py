"""scripts/calibrate.py: fit on synthetic timings, and a quick real run writing a profile."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from parallel.auto.cost import CostModel, load_hardware

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "calibrate.py"


@pytest.fixture
def cal(monkeypatch):
    # importable by name (spawned gloo ranks unpickle its worker function); sys.path is
    # restored after the test so scripts/ does not shadow anything else
    monkeypatch.syspath_prepend(str(_SCRIPT.parent))
    return importlib.import_module("calibrate")


def test_fit_links_recovers_synthetic_link(cal) -> None:
    lat, bw = 200e-6, 2e9  # 200 µs, 2 GB/s
    res = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        mult = 2 * 0.5 if kind == "all_reduce" else 0.5
        for size in (4096, 1 << 20, 8 << 20):
            res[(kind, size)] = lat + size * mult / bw
    bws, l_us = cal.fit_links(res, 2)
    assert l_us == pytest.approx(200, rel=1e-6)
    assert all(v == pytest.approx(2.0, rel=1e-6) for v in bws.values())


def test_calibrate_compute_only(cal, tmp_path) -> None:
    out = tmp_path / "mine.toml"
    assert cal.main(["--quick", "--no-collectives", "--out", str(out), "--name", "mine"]) == 0
    hw = load_hardware(str(out))
    assert hw.name == "mine" and hw.peak_tflops["fp32"] > 0 and hw.matmul_efficiency == 1.0
    CostModel(str(out), (2,))  # usable as a profile


@pytest.mark.slow
def test_calibrate_with_gloo_collectives(cal, tmp_path) -> None:
    out = tmp_path / "measured.toml"
    assert cal.main(["--quick", "--out", str(out)]) == 0
    hw = load_hardware(str(out))
    assert all(v > 0 for v in hw.intra_node.bus_bandwidth_gbps.values())
    assert hw.intra_node.latency_us > 0
