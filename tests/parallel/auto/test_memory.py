"""Peak memory per device of a plan (cost/memory.py, runtime/memory.py) and the memory
limit (api.AutoParallel(memory_limit_gib=...)), on fake worlds: the liveness walk on a small
graph, sane figures for LLaMA 3 8B shapes on 8 ranks (FSDP below DDP, AC below none), the
limit re-solving to a sharded plan or failing with a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.fx.experimental.proxy_tensor import make_fx

from models import build_model
from parallel.auto import selection
from parallel.auto.api import AutoParallel, MemoryLimitError, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.cost import ProfileError, load_hardware, profile_from_dict
from parallel.auto.cost.memory import GIB, MemoryEstimate, optimizer_temp_bytes, step_graph_memory
from parallel.auto.plan import Plan
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.search import presets

MB = 2**20


def test_liveness_walk_counts_what_is_alive_at_each_op():
    n = 256 * 1024  # 1 MiB of fp32

    def step(plocs, ilocs):
        (w,), (x,) = plocs, ilocs
        a = x * w  # 1 MiB, saved for the "backward"
        b = (a + 1).view(-1)  # 1 MiB (the view keeps its base alive; a + 1 is one storage)
        loss = b.sum()  # the forward ends here: a, b and the loss are alive
        c = a * 3  # 1 MiB, a backward temporary
        g = torch.addcmul(c, a, b)  # 1 MiB, the gradient: a, b, c and g alive
        return [loss, g]

    gm = make_fx(step, tracing_mode="fake")([torch.ones(n)], [torch.ones(n)])
    est = step_graph_memory(gm, n_inputs=1, n_outputs=1, state_bytes=4 * n, optimizer_bytes=8 * n,
                            optimizer_temp=optimizer_temp_bytes([4 * n]))
    assert est.peak_bytes == 4 * n + 8 * n + 4 * MB + 4  # at addcmul: a, b, c, g and the 4-byte loss
    assert (est.grads_bytes, est.phase, est.all_grads_bytes) == (MB, "backward", MB)
    assert est.activations_bytes == 2 * MB + 4 and est.saved_bytes == 2 * MB + 4  # a, b, the loss
    assert est.transient_bytes == MB  # c
    big = step_graph_memory(gm, n_inputs=1, n_outputs=1, state_bytes=0, optimizer_bytes=0, optimizer_temp=4 * MB)
    assert (big.phase, big.grads_bytes, big.transient_bytes, big.peak_bytes) == ("optimizer", MB, 4 * MB, 5 * MB)
    # gradient accumulation (the graph has no reductions): the earlier micro-batches' sum (as large as
    # this graph's gradients, 1 MiB) is alive through the whole graph, then reduced into 0.25 MiB
    acc = step_graph_memory(gm, n_inputs=1, n_outputs=1, state_bytes=4 * n, optimizer_bytes=8 * n,
                            optimizer_temp=optimizer_temp_bytes([n]), reduced_grad_bytes=n)
    assert acc.peak_bytes == est.peak_bytes + MB and (acc.grads_bytes, acc.phase) == (2 * MB, "backward")
    assert acc.all_grads_bytes == n  # what the optimizer step sees: the reduced gradients
    # a sum larger than the graph's own peak: the reduction (sum + reduced gradients) is the peak
    red = step_graph_memory(gm, n_inputs=1, n_outputs=1, state_bytes=0, optimizer_bytes=0, optimizer_temp=0,
                            reduced_grad_bytes=8 * MB)
    assert (red.phase, red.grads_bytes, red.peak_bytes) == ("gradient reduction", 9 * MB, 9 * MB)
    assert optimizer_temp_bytes([4, 8], "for-loop") == 20  # 8's two temporaries and 4's last one
    assert optimizer_temp_bytes([4, 8], "fused") == 0  # in place (the allocator's figures: test_memory_measured)
    with pytest.raises(ValueError, match="for-loop"):
        optimizer_temp_bytes([4], "sgd")


GLOBAL_B, SEQ = 16, 2048


def _plan_8b(kind: str, ac: str = "none") -> tuple[Plan, MemoryEstimate]:
    """LLaMA 3 8B's shapes (4 of its 32 layers, to stay fast) on 8 fake ranks, h100."""
    model = build_model("llama3", "8B", device="meta", n_layers=4)
    tok = torch.zeros(GLOBAL_B, SEQ, dtype=torch.long)
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss,
                          runtime=RuntimeOptions(ac_mode=ac), planner=PlannerConfig(hardware="h100")) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])
            getattr(presets, kind)(autop)
            plan = autop.optimize_placement(verbose=False)
    return plan, plan.memory


@pytest.fixture(scope="module")
def llama8b() -> dict:
    return {(k, ac): _plan_8b(k, ac)[1] for k, ac in (("ddp", "none"), ("fsdp", "none"), ("fsdp", "full"))}


@pytest.mark.slow  # plans LLaMA 3 8B on a fake world
def test_llama3_8b_shapes_on_8_ranks_sane_and_ordered(llama8b):
    model = build_model("llama3", "8B", device="meta", n_layers=4)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    ddp, fsdp, fsdp_ac = llama8b["ddp", "none"], llama8b["fsdp", "none"], llama8b["fsdp", "full"]
    for name, est in llama8b.items():
        print(name, est.summary())
    # model states exactly: fp32 parameters (whole or an eighth) and two AdamW states each
    assert ddp.params_bytes == param_bytes + buffers and ddp.optimizer_bytes == 2 * param_bytes
    assert fsdp.params_bytes == param_bytes // 8 + buffers and fsdp.optimizer_bytes == 2 * param_bytes // 8
    # activations of 2 x 2048 tokens per rank: the 128k-vocab logits alone are 2 GiB in fp32
    assert 2 * GIB < fsdp.saved_bytes < 40 * GIB
    assert fsdp.peak_bytes < ddp.peak_bytes and fsdp_ac.peak_bytes < fsdp.peak_bytes
    assert fsdp_ac.saved_bytes < fsdp.saved_bytes / 2
    assert ddp.peak_bytes > 4 * param_bytes  # parameters, gradients, two states: at least 16 B per parameter
    assert ddp.limit_bytes == load_hardware("h100").memory_limit and "h100.toml" in ddp.limit_source
    for est in llama8b.values():
        assert est.peak_bytes == (est.params_bytes + est.grads_bytes + est.optimizer_bytes + est.activations_bytes
                                  + est.transient_bytes)


def _debug_plan(*, memory_limit_gib: float | None, high: float | None = 1.0, kind: str = "",
                memory_estimate: bool = True) -> Plan:
    model = build_model("llama3", "debug", device="meta", n_layers=1)
    tok = torch.zeros(8, 16, dtype=torch.long)
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss,
                          planner=PlannerConfig(hardware="h100", memory_limit_gib=memory_limit_gib,
                                                memory_estimate=memory_estimate)) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])
            if kind:
                getattr(presets, kind)(autop)
            else:
                autop.add_parameter_memory_constraint(high=high)
            return autop.optimize_placement(verbose=False)


@pytest.fixture(scope="module")
def debug_plans() -> dict:
    return {"ddp": _debug_plan(memory_limit_gib=None, kind="ddp"),
            "fsdp": _debug_plan(memory_limit_gib=None, kind="fsdp")}


@pytest.mark.slow
def test_limit_that_ddp_exceeds_but_fsdp_fits_gives_a_sharded_plan(debug_plans, monkeypatch):
    monkeypatch.setattr(selection, "applies", lambda autop, plan: False)  # the ILP's own free plan, not DDP's
    ddp, fsdp = debug_plans["ddp"].memory, debug_plans["fsdp"].memory
    free = _debug_plan(memory_limit_gib=float("inf"))  # parameter budget free, no limit: partly replicated
    assert fsdp.peak_bytes < free.memory.peak_bytes < ddp.peak_bytes and free.memory.limit_bytes == 0
    limit = (fsdp.peak_bytes + free.memory.peak_bytes) / 2  # DDP and the free plan exceed it, FSDP fits
    plan = _debug_plan(memory_limit_gib=limit / GIB)
    print(f"limit {limit / 2**20:.2f} MiB: DDP {ddp.peak_bytes / 2**20:.2f}, free {free.memory.peak_bytes / 2**20:.2f} "
          f"(parameter share {free.memory_fraction:.3f}), FSDP {fsdp.peak_bytes / 2**20:.2f} MiB; planned: "
          f"{plan.memory.summary()}, parameter share {plan.memory_fraction:.3f}")
    assert plan.memory_fraction < free.memory_fraction and plan.memory.peak_bytes <= limit
    assert plan.memory.limit_bytes == int(limit) and plan.memory.fits
    assert plan.memory_budget[1] < 1.0  # re-solved with a tighter parameter budget


@pytest.mark.slow
def test_too_small_limit_is_a_clear_error(debug_plans):
    with pytest.raises(MemoryLimitError, match=r"predicted peak [\d.]+ MiB per device \(params .*activations .*\) "
                                               r"> 1\.02 MiB \(memory_limit_gib 0\.001\), even with the parameters as "
                                               r"sharded as they can be .*; use activation checkpointing"):
        _debug_plan(memory_limit_gib=0.001)
    with pytest.raises(MemoryLimitError, match="constraints allow no more sharding"):  # DDP forced: cannot shard
        _debug_plan(memory_limit_gib=debug_plans["fsdp"].memory.peak_bytes / GIB, kind="ddp")
    with pytest.raises(ValueError, match="memory_limit_gib = 0: must be > 0"):
        _debug_plan(memory_limit_gib=0)


def test_without_the_estimate_the_same_plan_has_no_peak(debug_plans):
    plan = _debug_plan(memory_limit_gib=None, kind="fsdp", memory_estimate=False)
    assert plan.memory is None and "memory" not in plan.timings
    assert plan.costs.labels == debug_plans["fsdp"].costs.labels  # the same solve, only the estimate left out
    with pytest.raises(ValueError, match=r"memory_estimate = False: the memory limit \(memory_limit_gib = 40\) is "
                                         r"checked against the estimate"):
        _debug_plan(memory_limit_gib=40, kind="fsdp", memory_estimate=False)  # a limit nothing would check


def test_plan_json_keeps_the_estimate_and_old_plans_load(debug_plans, tmp_path):
    plan = debug_plans["fsdp"]
    assert plan.memory.summary() in plan.summary()
    path = tmp_path / "plan.json"
    plan.save(str(path))
    again = Plan.load(str(path))
    assert again.memory == plan.memory
    d = json.loads(path.read_text())
    del d["memory"]  # a plan file written before the estimate existed
    assert Plan.from_json(d).memory is None
    d["memory"] = {"peak_bytes": 1}
    with pytest.raises(ValueError, match="'memory' is not a memory estimate"):
        Plan.from_json(d)


def test_profile_memory_limit_key():
    d = {k: v for k, v in _toml("h100").items() if k != "memory_limit_gib"}
    assert profile_from_dict(d).memory_limit == profile_from_dict(d).memory_bytes  # unset: all the memory
    assert profile_from_dict({**d, "memory_limit_gib": 40}).memory_limit == 40 * GIB
    with pytest.raises(ProfileError, match="memory_limit_gib = 100 exceeds memory_gib"):
        profile_from_dict({**d, "memory_limit_gib": 100})
    assert {n: load_hardware(n).memory_limit / GIB for n in ("h100", "h200", "a100")} == pytest.approx(
        {"h100": 79.6, "h200": 140.4, "a100": 80.0}, abs=1e-6)


def _toml(name: str) -> dict:
    import tomllib

    from parallel.auto.cost import hardware_dir

    with open(hardware_dir() / f"{name}.toml", "rb") as f:
        return tomllib.load(f)
