"""Pipeline stages the planner plans (parallel/auto/stages.py, plan/pipeline.py), fast: a
stage module traced as a stage has a hidden-state output and its input's gradient in the
joint graph, pinned batch-sharded; the cut by predicted unit times moves blocks away from a
heavy output head; the pipeline plan prices n microbatches of the slowest rank plus pp - 1
slots of the slowest stage, and survives its JSON. (The losses of planned stages under
torch's schedules: tests/trainer/test_auto_pipeline.py.)"""

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import fake_world
from parallel.auto.config import PlannerConfig
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.plan.pipeline import PipelinePlan, StagePlan
from parallel.auto.request import PlanRequest
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.stages import (
    StageShape,
    balanced_stages,
    pipeline_step_us,
    stage_planning,
    stage_submesh,
    stage_times_us,
    unit_times,
)
from parallel.recipes.pp import split_model

REQUEST = PlanRequest(local_batch_size=2, seq_len=32, planner=PlannerConfig(hardware="h100"),
                      runtime=RuntimeOptions(reshard_after_forward=True), mp_policy=None)


@functools.lru_cache(maxsize=None)
def _stage_plan(layers, first, last) -> Plan:
    """One stage of the 4-block debug LLaMA planned on the dp_shard axis of a (pp 2, dp_shard 2) fake mesh."""
    model = build_model("llama3", "debug", device="meta")
    part = split_model(model, layers, first, last)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        sub = stage_submesh(mesh)
        assert sub.mesh_dim_names == ("dp_shard",)
        shape = StageShape(first=first, rows=2, seq_len=32, dim=256, dtype=torch.float32)
        with stage_planning(part, sub, REQUEST, shape) as autop:
            g = autop.graph
            assert len(g.tangents) == 1 and tuple(g.tangents[0].meta["val"].shape) == (4, 32, 256)
            assert (g.input_grads[0] is None) == first  # a hidden-state input's gradient is in the graph
            return autop.optimize_placement(verbose=False)


def test_a_stage_hands_on_batch_sharded_values_and_returns_its_inputs_gradient():
    plan = _stage_plan((2, 3), first=False, last=True)
    by_label = {n.label: n for n in plan.nodes.values()}
    assert by_label["input 0"].output_placements[0] == "(S(0))"
    assert plan.node("output[0]").output_placements[0] == "(S(0))"  # the logits, each rank its rows
    assert by_label["grad of input 0"].output_placements[0] == "(S(0))"
    tangent = next(n for n in plan.nodes.values() if n.role is not None and n.role.kind == "tangent")
    assert tangent.output_placements[0] == "(S(0))"
    assert plan.input_shapes == [[[4, 32, 256], "torch.float32"]]
    times = unit_times(plan, (2, 3), False, True, 4)
    assert set(times) == {2, 3, 4} and sum(times.values()) == pytest.approx(plan.objective_us)
    assert times[4] > 0 and times[2] > 0


def test_the_cut_by_unit_times_moves_blocks_off_a_heavy_head():
    units = [0.1, 1.0, 1.0, 1.0, 1.0, 3.0]  # embedding, 4 blocks, a head as slow as 3 blocks
    assert balanced_stages(units, 2) == ((0, 1, 2), (3,))  # the recipe's equal units: (0, 1), (2, 3)
    assert stage_times_us(units, ((0, 1), (2, 3))) == pytest.approx([2.1, 5.0])
    assert stage_times_us(units, ((0, 1, 2), (3,))) == pytest.approx([3.1, 4.0])
    assert balanced_stages([1.0] * 6, 3) == ((0,), (1, 2), (3,))  # equal units: two each
    # the step: n x the slowest rank + the fill and drain (one stage per rank: the other stages' times)
    assert pipeline_step_us([2.0, 3.0], [0, 1], 2, 4) == pytest.approx(4 * 3.0 + 2.0)
    # two stages per rank (looped): the bubble is one slot of a stage, not of a rank
    assert pipeline_step_us([1.0, 1.0, 1.0, 1.0], [0, 1, 0, 1], 2, 4) == pytest.approx(4 * 2.0 + 1.0)


@pytest.mark.slow
def test_pipeline_plan_prices_the_schedule_and_round_trips(tmp_path):
    first, last = _stage_plan((0, 1), True, False), _stage_plan((2, 3), False, True)
    plan = PipelinePlan("1F1B", 2, 4, [StagePlan(0, (0, 1), 0, first), StagePlan(1, (2, 3), 1, last)], p2p_us=10.0)
    slots = [first.objective_us + 10.0, last.objective_us + 10.0]
    assert plan.step_us == pytest.approx(4 * max(slots) + min(slots))
    assert plan.in_flight(0) == 2 and plan.in_flight(1) == 1  # 1F1B: stages to the last
    text = plan.summary()
    assert "stage 0 on pp rank 0: embedding, layers.0-1" in text and "stage 1 on pp rank 1: layers.2-3, norm, " \
        "output" in text and "2 in flight" in text
    plan.save(str(tmp_path / "pipeline_plan.json"))
    back = PipelinePlan.load(str(tmp_path / "pipeline_plan.json"))
    assert back.step_us == pytest.approx(plan.step_us) and [s.layers for s in back.stages] == [(0, 1), (2, 3)]
    assert back.stages[1].plan.placement_digest() == last.placement_digest()
    with pytest.raises(PlanMismatchError, match="pp 2, 4 microbatches.*this job runs Interleaved1F1B"):
        back.check_layout("Interleaved1F1B", 2, 4, 4, "pipeline_plan.json")
    with pytest.raises(PlanMismatchError, match="is a pipeline's plan"):  # given where one plan is expected
        Plan.load(str(tmp_path / "pipeline_plan.json"))


def test_the_simulated_schedule_is_the_priced_step_for_gpipe_and_below_it_for_1f1b():
    """The plan page's schedule picture: GPipe's simulated step is the priced one (n x the
    slowest stage + the others' fill and drain); 1F1B overlaps part of the drain."""
    from parallel.auto.plan.pictures.pipeline import schedule_svg, simulate
    from parallel.recipes.pp import fill_and_drain_us

    fwd = [3.0, 1.0, 2.0, 1.0]
    bwd = [2 * f for f in fwd]
    slots_us = [f + b for f, b in zip(fwd, bwd)]
    priced = 8 * max(slots_us) + fill_and_drain_us(slots_us, 4)
    gpipe, one_f_one_b = (simulate(s, fwd, bwd, 8, 0.0) for s in ("GPipe", "1F1B"))
    assert max(s.end for s in gpipe) == pytest.approx(priced)
    assert max(s.end for s in one_f_one_b) < priced
    assert len(one_f_one_b) == 2 * 4 * 8 and all(s.end > s.start for s in one_f_one_b)
    picture = schedule_svg(one_f_one_b, 4, priced)
    assert picture.count('class="slot-B"') == 32 and f'data-priced-us="{priced}"' in picture


def _relabel_on_one_rank(rank, world):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from parallel.auto.runtime.redistribute import redistribute

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    t = torch.arange(6.0).reshape(2, 3)
    x = DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
    out = {}
    for target in ((Partial("product"),), (Partial("min"),), (Partial("avg"),), (Shard(1),)):
        y = redistribute(x, mesh, target)
        out[str(target)] = (tuple(y.placements) == target, torch.equal(y.to_local(), t))
    return out


@pytest.mark.slow
def test_a_stage_on_one_rank_relabels_any_placement_without_communication():
    """PP2 on 2 ranks plans each stage on a 1-rank submesh, where every placement is free and
    the solve may pick any (P(min), P(product)): each is the same local values there, so the
    runtime relabels where DTensor would refuse (Replicate -> Partial(product))."""
    from dist_utils import run_distributed

    (got,) = run_distributed(_relabel_on_one_rank, 1, timeout=60)
    assert got and all(ok == (True, True) for ok in got.values()), got
