"""One cache root for measured hardware profiles and planned points (parallel/cache_dir.py):
a test run (or CI job) that sets AUTOTITAN_CACHE neither reads nor writes the user's profile."""
from __future__ import annotations

from pathlib import Path

from parallel.auto.cost import load_hardware
from parallel.auto.cost.calibrate import cache_path, resolve_auto, save_profile
from parallel.cache_dir import cache_root


def test_the_cache_root_is_autotitan_cache_then_xdg_then_home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOTITAN_CACHE", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path(4).parent == tmp_path / "own" / "hardware"
    monkeypatch.delenv("AUTOTITAN_CACHE")
    assert cache_path(4).parent == tmp_path / "xdg" / "autotitan" / "hardware"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path(tmp_path / "home" / ".cache" / "autotitan")


def test_a_profile_in_the_users_cache_does_not_answer_a_run_with_its_own(tmp_path, monkeypatch) -> None:
    """The user's cached profile (under XDG_CACHE_HOME) is invisible once AUTOTITAN_CACHE is
    set, as the suite sets it; before, a profile the suite measured on a loaded machine
    was what every later job on this host planned with, and the suite read the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("AUTOTITAN_CACHE", raising=False)
    slow = load_hardware("cpu").replace(name="auto", peak_tflops={"fp32": 1e-6, "bf16": 1e-6})
    save_profile(slow, cache_path(4))
    assert resolve_auto(4).peak_tflops["fp32"] == 1e-6  # the user's own runs read it
    monkeypatch.setenv("AUTOTITAN_CACHE", str(tmp_path / "own"))
    assert resolve_auto(4).peak_tflops == load_hardware("cpu").peak_tflops  # nothing measured here yet


def test_a_busy_host_is_said_and_written_into_the_profile(tmp_path, monkeypatch, caplog) -> None:
    """Measuring while other work holds the cores is warned about (with the command that
    measures again), and the share is kept in the profile's description."""
    import torch.distributed as dist

    from parallel.auto.cost import calibrate

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for readings, warned in (([(0, 100), (60, 200)], True), ([(0, 100), (5, 200)], False)):
            caplog.clear()
            monkeypatch.setattr(calibrate, "_cpu_times", iter(readings).__next__)
            share = calibrate.busy_before_measuring(window_s=0.0)
            assert share == readings[1][0] / 100
            said = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
            assert bool(said) == warned
            if warned:
                assert "60 %" in said[0] and "--world-size 1 --recalibrate" in said[0]
        monkeypatch.setattr(calibrate, "_cpu_times", iter([(0, 100), (60, 200)]).__next__)
        monkeypatch.setattr(calibrate, "measure_compute",
                            lambda device=None: {"fp32": 1e-3, "bf16": 1e-3, "attention": 1e-3, "copy_gbps": 1.0,
                                                    "floor_us": 1.0, "spread": 0.1})
        hw = calibrate.measure_in_group("cpu")
        assert "60% of the host's cores busy" in hw.description
    finally:
        dist.destroy_process_group()
