"""A region call in a rank's step graph is priced by the FLOPs its local function runs
(regions/pricing.py `step_region_us`), checked against torch's FLOP counter on the real
routed MoE dispatch with autograd: the op-by-op price saw only the call (on DeepSeek-V3
debug, 4 ms a step for expert matmuls that took about 45)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel import _torch as T
from parallel.auto import regions
from parallel.auto.cost import CostModel
from parallel.auto.cost.simulate import simulate_step
from parallel.auto.regions.tape import region_call, use_region_tape

FWD, BWD = regions.forward_op(regions.MOE_DISPATCH), regions.backward_op(regions.MOE_DISPATCH)


def _inputs(t: int = 512, d: int = 64, e: int = 4, k: int = 2, h: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, d, generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, 0] += 2.0  # routing far from balanced: expert 0 gets most tokens
    scores, selected = logits.softmax(-1).topk(k, dim=-1)
    ws = [torch.randn(e, h, d, generator=g) * 0.1, torch.randn(e, d, h, generator=g) * 0.1,
          torch.randn(e, h, d, generator=g) * 0.1]
    return [x, scores, selected, *ws]


def _step(x, scores, selected, w1, w2, w3, grad):
    y = FWD(x, scores, selected, w1, w2, w3)
    return (y, *BWD(grad, x, scores, selected, w1, w2, w3))


def _compute_bound() -> CostModel:
    """H100 figures with the memory roof and the launch floor out of the way: a price is its FLOPs."""
    return CostModel(CostModel("h100", (1,)).hw.replace(memory_bandwidth_gbps=1e9, kernel_floor_us=0.0), (1,))


def _roof_us(cm: CostModel, flops: float) -> float:
    return flops / (cm.hw.peak_flops(torch.float32) * cm.hw.matmul_efficiency) * 1e6


def test_a_taped_moe_region_is_priced_at_the_flops_its_routed_experts_run():
    xs = _inputs()
    grad = torch.randn_like(xs[0])
    gm = T.trace_fake(_step)(*xs, grad)
    assert use_region_tape(gm) is not None
    T.generate_code(gm)
    calls = [n for n in gm.graph.nodes if region_call(n) is not None]
    assert [region_call(n)[1] for n in calls] == [False, True]  # the tape's forward and backward

    with FlopCounterMode(display=False) as fc:  # the real routed loop, its backward through autograd
        gm(*xs, grad)
    measured = fc.get_total_flops()
    t, d, k, h = 512, 64, 2, 256
    assert measured == 3 * (3 * 2 * t * k * d * h)  # three expert matmuls, forward and two backward products

    cm = _compute_bound()
    priced = sum(regions.step_region_us(cm, n) for n in calls)
    assert priced == pytest.approx(_roof_us(cm, measured), rel=0.02)
    # the op-by-op price alone saw the call, not its matmuls
    assert sum(cm.compute_cost(n) for n in calls) < 0.2 * priced

    sim = simulate_step(gm, cm, {}, region_us=regions.step_region_us)
    plain = simulate_step(gm, cm, {})
    assert sim.compute_us - plain.compute_us > 0.8 * priced


def test_the_region_op_without_a_tape_pays_the_recomputed_forward():
    xs = _inputs()
    grad = torch.randn_like(xs[0])
    gm = T.trace_fake(_step)(*xs, grad)  # no tape: the backward op runs the forward again
    calls = [n for n in gm.graph.nodes if region_call(n) is not None]
    cm = _compute_bound()
    fwd, bwd = (regions.step_region_us(cm, n) for n in calls)
    assert bwd == pytest.approx(3 * fwd, rel=0.02)  # recompute + two backward products
