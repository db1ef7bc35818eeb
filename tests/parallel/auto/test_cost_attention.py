"""The fused attention kernel's calibrated efficiency per direction, head dim and sequence length
(cost/calibrate_attention.py): measured, kept in the profile's [attention_efficiency] table,
used by the cost model at the nearest grid point; a profile without it prices as before."""
from __future__ import annotations

import pytest
import tomllib
import torch

from parallel import _torch as T
from parallel.auto.cost import CostModel, load_hardware
from parallel.auto.cost.calibrate_attention import attention_key, measure_attention_grid
from parallel.auto.cost.hardware import ProfileError, profile_from_dict, profile_to_toml

GRID = {"fwd_d32_s128": 0.2, "bwd_d32_s128": 0.1, "fwd_d64_s512": 0.5, "bwd_d64_s512": 0.4,
        "fwd_d128_s2048": 0.8, "bwd_d128_s2048": 0.7}


def _args(backward: bool, b: int, h: int, s: int, d: int) -> list:
    """The CPU flash op's arguments (tensor descriptions), causal, as the step graph holds them."""
    x = ((b, h, s, d), torch.float32)
    lse = ((b, h, s), torch.float32)
    return [x, x, x, x, x, lse, 0.0, True] if backward else [x, x, x, 0.0, True]


def _price_at(cm: CostModel, backward: bool, s: int, d: int, eff: float) -> float:
    """What the roofline gives the op at efficiency `eff` (its counted FLOPs, halved: causal)."""
    op = T.CPU_ATTENTION_BWD if backward else T.CPU_ATTENTION_FWD
    args = _args(backward, 2, 4, s, d)
    flops = cm.flop_cache.estimate(op, args).flops / 2
    return flops / (cm.hw.peak_flops(torch.float32) * eff) * 1e6 + cm.hw.kernel_floor_us


def test_the_calibration_gives_the_table():
    grid = measure_attention_grid(head_dims=(16, 32), seq_lens=(32, 64))
    keys = {attention_key(b, d, s) for b in (False, True) for d in (16, 32) for s in (32, 64)}
    assert set(grid) == keys | {"spread"} and all(grid[k] > 0 for k in keys)
    assert attention_key(True, 32, 128) == "bwd_d32_s128"


@pytest.mark.parametrize("backward", [False, True])
def test_an_op_is_priced_at_the_nearest_grid_point(backward):
    hw = load_hardware("cpu").replace(name="auto", attention_efficiency=0.9, attention_grid=GRID)
    cm, plain = CostModel(hw, (1,)), CostModel(load_hardware("cpu").replace(attention_efficiency=0.9), (1,))
    op = T.CPU_ATTENTION_BWD if backward else T.CPU_ATTENTION_FWD
    d = "bwd" if backward else "fwd"
    for s, hd, key in ((128, 32, "d32_s128"), (160, 32, "d32_s128"), (512, 64, "d64_s512"),
                       (4096, 128, "d128_s2048"), (512, 32, "d32_s128")):  # head dim decides first
        got = cm.compute_cost(op, _args(backward, 2, 4, s, hd))
        assert got == pytest.approx(_price_at(cm, backward, s, hd, GRID[f"{d}_{key}"]), rel=1e-6), (s, hd)
    # without the table: the single figure, as before
    assert plain.compute_cost(op, _args(backward, 2, 4, 128, 32)) == \
        pytest.approx(_price_at(plain, backward, 128, 32, 0.9), rel=1e-6)


def test_the_toml_round_trip_and_its_checks():
    hw = load_hardware("cpu").replace(name="auto", attention_grid=GRID)
    data = tomllib.loads(profile_to_toml(hw))
    assert dict(profile_from_dict(data).attention_grid) == GRID
    assert "attention_efficiency" not in tomllib.loads(profile_to_toml(load_hardware("h100")))
    assert load_hardware("h100").attention_eff_for(True, 32, 128) == load_hardware("h100").attention_eff
    for bad in ({"fwd_32_128": 0.5}, {"fwd_d32_s128": 0.0}, {"sideways_d32_s128": 0.5}):
        with pytest.raises(ProfileError, match="attention_efficiency"):
            profile_from_dict({**data, "attention_efficiency": bad})
