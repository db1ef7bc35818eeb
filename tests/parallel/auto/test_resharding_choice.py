"""[parallelism] reshard_after_forward = "auto": the planner prices gathering the parameters
again in the backward against keeping the forward's gathered copies (the ZeRO-2 shape:
gradients and optimizer states sharded, parameters whole for compute) and keeps the faster
plan that fits. On the 4-block debug LLaMA (a fake world of 4, FSDP-shaped placements): with
memory free it keeps them and its gathers cost less than the same placements resharded;
under a limit that the kept copies break but resharding fits, it reshards; the memory
estimate (the step graph torch's partitioner cuts) of the plan it returns fits; the choice
survives the plan's JSON and a replay, and the runtime runs it."""

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.plan import Plan
from parallel.auto.recompute_fit import plan_options
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.search import presets


def _plan(reshard, limit_gib=None, tmp_path=None, preset=True) -> Plan:
    tok = torch.zeros(8, 256, dtype=torch.long)
    # four blocks: with two, the backward's re-gathers (one block ahead) held as much as the
    # kept copies of every block, and the forward's peak decided
    model = build_model("llama3", "debug", device="meta", n_layers=4)
    runtime = RuntimeOptions(reshard_after_forward=reshard)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, runtime=runtime,
                          planner=PlannerConfig(hardware="cpu", memory_limit_gib=limit_gib)) as autop:
            if preset:
                presets.fsdp(autop)
            plan = autop.optimize_placement(verbose=False)
            assert autop.runtime == runtime  # the choice is the plan's, the planner's setting stays "auto"
            if tmp_path is not None:
                plan.save(str(tmp_path / "plan.json"))
                loaded = Plan.load(str(tmp_path / "plan.json"))
                assert loaded.reshard_after_forward is plan.reshard_after_forward
                replayed = autop.replay_placement(loaded)
                assert replayed.objective_us == pytest.approx(plan.objective_us, rel=1e-9)
        if tmp_path is not None:  # a new planner (the replan flow) prices the plan's own choice
            with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, runtime=runtime,
                              planner=PlannerConfig(hardware="cpu")) as fresh:
                replayed = fresh.replay_placement(Plan.load(str(tmp_path / "plan.json")))
            assert replayed.objective_us == pytest.approx(plan.objective_us, rel=1e-9)
    return plan


def _gather_us(plan: Plan) -> float:
    return sum(us for k, us in plan.comm_us.items() if k.startswith("all_gather"))


@pytest.mark.slow
def test_memory_free_keeps_the_gathered_parameters_and_prices_the_saved_gathers(tmp_path):
    kept = _plan("auto", tmp_path=tmp_path)
    resharded = _plan(True)
    assert kept.reshard_after_forward is False and resharded.reshard_after_forward is None
    assert kept.placement_digest() == resharded.placement_digest()  # the preset's placements
    # the backward's second gather is gone from the price, and from nothing else
    assert _gather_us(kept) < _gather_us(resharded)
    assert kept.step_time_us() < resharded.step_time_us()
    assert kept.memory.peak_bytes > resharded.memory.peak_bytes  # the kept copies live to the backward
    assert "kept for the backward (ZeRO-2's shape)" in kept.summary()
    ran = plan_options(RuntimeOptions(reshard_after_forward="auto"), kept)
    assert ran.reshard_after_forward is False


@pytest.mark.slow
def test_a_free_plan_of_sharded_parameters_kept_whole_for_compute():
    """No preset: the planner itself picks sharded parameter storage (so sharded gradients and
    optimizer states) with the forward's gathers kept, a shape no hand recipe here writes."""
    plan = _plan("auto", preset=False)
    assert plan.memory_fraction < 1.0 and plan.reshard_after_forward is False
    sharded = [fqn for fqn, placement in plan.param_placements().items() if "S(" in placement]
    assert sharded and any(k.startswith("reduce_scatter") for k in plan.comm_us)


@pytest.mark.slow
def test_a_limit_the_kept_copies_break_reshards_and_fits():
    kept, resharded = _plan(False), _plan(True)
    assert kept.memory.peak_bytes > resharded.memory.peak_bytes
    limit = (kept.memory.peak_bytes + resharded.memory.peak_bytes) / 2 / 2**30
    chosen = _plan("auto", limit_gib=limit)
    assert chosen.reshard_after_forward is True
    assert chosen.memory.fits and chosen.memory.peak_bytes <= limit * 2**30
    assert "gathers the parameters again" in chosen.summary()
    ran = plan_options(RuntimeOptions(reshard_after_forward="auto"), chosen)
    assert dataclasses.replace(ran, reshard_after_forward=True) == ran


def test_a_plan_runs_with_a_concrete_setting():
    with pytest.raises(ValueError, match="reshard_after_forward 'sometimes'"):
        RuntimeOptions(reshard_after_forward="sometimes")
