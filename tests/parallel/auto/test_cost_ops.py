"""The calibrated prices of memory-bound op classes and of the optimizer (cost/calibrate_ops.py):
measured, kept in the profile's TOML, used by the roofline and the optimizer estimate; a
named profile without them prices as before."""
from __future__ import annotations

import pytest
import tomllib
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from parallel.auto.cost import CostModel, load_hardware
from parallel.auto.cost.calibrate_ops import OP_CLASSES, measure_op_bandwidths, measure_optimizer
from parallel.auto.cost.compute import op_class
from parallel.auto.cost.hardware import ProfileError, profile_from_dict, profile_to_toml
from parallel.auto.cost.simulate import _optimizer_us

OPS = {"elementwise": 4.0, "transcendental": 2.0, "reduction": 8.0, "cat": 1.0}
OPT = {"gbps": 0.5, "tensor_us": 20.0, "fused_gbps": 2.0, "fused_tensor_us": 5.0}


def _calibrated(optimizer: str = "foreach") -> CostModel:
    hw = load_hardware("cpu").replace(name="auto", op_bandwidth_gbps=OPS, optimizer=OPT)
    return CostModel(hw, (1,), optimizer=optimizer)


def test_the_measurements_give_every_figure():
    torch.manual_seed(0)
    ops = measure_op_bandwidths(rows=64, cols=32, pool=4, live=4)
    assert set(ops) == {*OP_CLASSES, "spread"} and all(ops[k] > 0 for k in OP_CLASSES)
    for implementation in ("foreach", "fused"):
        opt = measure_optimizer(mib=0.25, tensors=4, implementation=implementation)
        assert opt["gbps"] > 0 and opt["tensor_us"] >= 0 and opt["spread"] >= 0


def test_op_classes():
    aten = torch.ops.aten
    assert op_class(aten.silu.default) == op_class(aten.silu_backward.default) == "transcendental"
    assert op_class(aten.sum.dim_IntList) == op_class(aten.mean.dim) == "reduction"
    assert op_class(aten.cat.default) == "cat"
    assert op_class(aten.mul.Tensor) == op_class(aten.clone.default) == "elementwise"


def test_each_class_is_priced_at_its_bandwidth_and_matmul_is_not():
    cm, plain = _calibrated(), CostModel("cpu", (1,))
    hw, x = cm.hw, ((1024, 256), torch.float32)
    mb = 1024 * 256 * 4
    aten = torch.ops.aten
    for op, args, nbytes, cls in ((aten.mul.Tensor, [x, x], 3 * mb, "elementwise"),
                                  (aten.silu.default, [x], 2 * mb, "transcendental"),
                                  (aten.cat.default, [[x, x], -1], 4 * mb, "cat")):
        want = nbytes / (OPS[cls] * 1e9) * 1e6 + hw.kernel_floor_us
        assert cm.compute_cost(op, args) == pytest.approx(want, rel=1e-6)
        # a profile without the figures (every named one): the memory roof, as before
        roof = nbytes / (plain.hw.memory_bandwidth * plain.hw.memory_efficiency) * 1e6 + plain.hw.kernel_floor_us
        assert plain.compute_cost(op, args) == pytest.approx(roof, rel=1e-6)
    w = ((256, 256), torch.float32)
    assert cm.compute_cost(aten.mm.default, [x, w]) == plain.compute_cost(aten.mm.default, [x, w])


def test_the_optimizer_estimate_uses_the_measured_rate():
    cm, h100 = _calibrated(), CostModel("h100", (1,))
    assert cm.optimizer_cost(1e6) == pytest.approx(1e6 / 0.5e9 * 1e6)
    latency = cm.hw.intra_node.latency_us
    assert _optimizer_us(cm, int(1e6), 10) == pytest.approx(2000.0 + 10 * 20.0 + latency)
    # the fused AdamW at its own figures; for-loop at foreach's; a profile without fused figures: foreach's
    fused = _calibrated("fused")
    assert fused.optimizer_cost(1e6) == pytest.approx(500.0)
    assert _optimizer_us(fused, int(1e6), 10) == pytest.approx(500.0 + 10 * 5.0 + latency)
    assert _calibrated("for-loop").optimizer_cost(1e6) == pytest.approx(2000.0)
    old = load_hardware("cpu").replace(name="auto", optimizer={"gbps": 0.5, "tensor_us": 20.0})
    assert CostModel(old, (1,), optimizer="fused").optimizer_cost(1e6) == pytest.approx(2000.0)
    assert fused.pricing_key() != cm.pricing_key()  # priced problems are not shared across implementations
    # a named profile: memory-bound passes (48 B a parameter) and a floor per tensor group, as before
    hw = h100.hw
    passes = 1e6 / 4 * 48 / (hw.memory_bandwidth * hw.memory_efficiency) * 1e6
    assert h100.optimizer_cost(1e6) == pytest.approx(passes)
    assert _optimizer_us(h100, int(1e6), 10) == pytest.approx(
        passes + hw.kernel_floor_us * 11 + hw.intra_node.latency_us)


def test_a_step_graph_is_priced_with_them():
    from parallel.auto.cost.simulate import simulate_step

    gm = make_fx(lambda x: torch.nn.functional.silu(x @ x) * x)(torch.randn(128, 128))
    cm = _calibrated()
    calibrated = simulate_step(gm, cm, {}, optimizer_param_bytes=4096, optimizer_tensors=2)
    plain = simulate_step(gm, CostModel("cpu", (1,)), {}, optimizer_param_bytes=4096, optimizer_tensors=2)
    assert calibrated.compute_us > plain.compute_us  # silu and mul below the cpu profile's memory roof
    assert calibrated.optimizer_us == pytest.approx(_optimizer_us(cm, 4096, 2))


def test_the_toml_round_trip_and_its_checks():
    hw = _calibrated().hw
    data = tomllib.loads(profile_to_toml(hw))
    back = profile_from_dict(data)
    assert dict(back.op_bandwidth_gbps) == OPS and dict(back.optimizer) == OPT
    named = tomllib.loads(profile_to_toml(load_hardware("h100")))
    assert "op_bandwidth_gbps" not in named and "optimizer" not in named
    for table, bad in (("optimizer", {"gbps": 1.0}), ("optimizer", {**OPT, "fused_gbps": 0.0}),
                       ("optimizer", {"gbps": 1.0, "tensor_us": 1.0, "fused_gbps": 1.0}),
                       ("op_bandwidth_gbps", {"matmul": 1.0}),
                       ("op_bandwidth_gbps", {"cat": 0.0})):
        with pytest.raises(ProfileError, match=table):
            profile_from_dict({**data, table: bad})
