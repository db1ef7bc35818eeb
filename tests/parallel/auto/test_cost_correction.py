"""A calibrated profile corrected by a job's measured step (cost/correction.py): written into
the cached profile when off by more than 25 %, read back, applied by the step simulation,
dropped by a recalibration; a named profile is never changed."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from parallel.auto.cost import CostModel, load_hardware
from parallel.auto.cost.calibrate import cache_path, save_profile
from parallel.auto.cost.correction import correctable, record_correction, step_time_ratio
from parallel.auto.cost.hardware import profile_from_dict, profile_to_toml
from parallel.auto.cost.simulate import simulate_step

PROVENANCE = {"job": "llama3_debug_auto", "config": "configs/llama3_debug_auto.toml", "world_size": 2}


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A calibrated profile in this test's cache, as `hardware = "auto"` reads it."""
    monkeypatch.setenv("AUTOTITAN_CACHE", str(tmp_path / "cache"))
    path = cache_path(2)
    save_profile(load_hardware("cpu").replace(name="auto"), path)
    return load_hardware(path)


def test_off_by_more_than_a_quarter_is_recorded_and_read_back(cached):
    assert correctable(cached) is not None and step_time_ratio(cached) == 1.0
    line = record_correction(cached, measured_us=400e3, predicted_us=250e3, provenance=PROVENANCE)
    assert line is not None and "step_time_ratio = 1.60" in line
    again = load_hardware(cache_path(2))
    assert step_time_ratio(again) == pytest.approx(1.6)
    corr = again.correction
    assert corr["job"] == "llama3_debug_auto" and corr["world_size"] == 2 and corr["measured_ms"] == pytest.approx(400)
    assert corr["predicted_ms"] == pytest.approx(250) and corr["when"]
    assert again.replace(correction={}) == cached.replace(source=again.source)  # the measured figures untouched
    # a second correction is relative to the uncorrected prediction, not compounded
    record_correction(again, measured_us=200e3, predicted_us=250e3 * 1.6, provenance=PROVENANCE)
    assert step_time_ratio(load_hardware(cache_path(2))) == pytest.approx(0.8)


def test_within_a_quarter_nothing_is_written(cached):
    before = cache_path(2).read_text()
    for measured in (250e3 * 0.81, 250e3, 250e3 * 1.24):
        assert record_correction(cached, measured, 250e3, PROVENANCE) is None
    assert cache_path(2).read_text() == before


def test_a_recalibration_drops_the_correction(cached):
    record_correction(cached, 500e3, 250e3, PROVENANCE)
    assert step_time_ratio(load_hardware(cache_path(2))) == pytest.approx(2.0)
    save_profile(load_hardware("cpu").replace(name="auto"), cache_path(2))  # what measuring again writes
    assert step_time_ratio(load_hardware(cache_path(2))) == 1.0


def test_a_named_profile_is_never_modified(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTITAN_CACHE", str(tmp_path / "cache"))
    h100 = load_hardware("h100")
    text = open(h100.source).read()
    assert correctable(h100) is None
    assert record_correction(h100, 500e3, 100e3, PROVENANCE) is None
    assert open(h100.source).read() == text
    # nor an "auto" profile that is not this host's cached one (a copy elsewhere)
    elsewhere = tmp_path / "copy.toml"
    save_profile(load_hardware("cpu").replace(name="auto"), elsewhere)
    assert record_correction(load_hardware(elsewhere), 500e3, 100e3, PROVENANCE) is None


def test_the_simulation_multiplies_by_the_ratio():
    gm = make_fx(lambda x: (x @ x).relu())(torch.randn(256, 256))
    cm = CostModel("cpu", (1,))
    plain = simulate_step(gm, cm, {})
    cm.hw = cm.hw.replace(correction={"step_time_ratio": 1.5, "job": "j"})
    corrected = simulate_step(gm, cm, {})
    assert corrected.step_us == pytest.approx(1.5 * plain.step_us) and corrected.correction == 1.5
    assert corrected.compute_us == plain.compute_us and "x 1.50" in corrected.summary()


def test_the_toml_round_trip_and_its_checks():
    hw = load_hardware("cpu").replace(correction={"step_time_ratio": 1.25, "job": 'a "quoted" name', "world_size": 4})
    import tomllib

    back = profile_from_dict(tomllib.loads(profile_to_toml(hw)))
    assert back.correction == hw.correction
    data = tomllib.loads(profile_to_toml(hw))
    data["correction"] = {"job": "x"}
    with pytest.raises(ValueError, match="step_time_ratio"):
        profile_from_dict(data)
    data["correction"] = {"step_time_ratio": -1.0}
    with pytest.raises(ValueError, match="must be > 0"):
        profile_from_dict(data)
