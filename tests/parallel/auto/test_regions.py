"""local_map regions (parallel/auto/regions/): a region is one node whose strategies
are its declared options (plus replicated), runs its local function on shards eagerly and
compiled (= 1 rank), a local function that breaks its declared output placement is named,
and a plan made with a region the model no longer declares is refused by name."""

import pytest
import torch
from region_workers import B, D, S, autop_for, make_plan, reference, worker
from torch.distributed.tensor import Replicate, Shard

from parallel.auto import regions
from parallel.auto.plan import Plan, PlanMismatchError


def test_region_is_one_node_per_phase_with_declared_options():
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.api import fake_world

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with autop_for(mesh) as autop:
            g = autop.graph
            fwd = [n for n in g.gm.graph.nodes if n.target == regions.forward_op("toy_gate")]
            bwd = [n for n in g.gm.graph.nodes if n.target == regions.backward_op("toy_gate")]
            assert len(fwd) == 1 and len(bwd) == 1 and g.regions == ["toy_gate"]
            menu = {(str(s.output_specs.placements), str([i.placements for i in s.input_specs]))
                    for s in autop.candidates[fwd[0].name].specs}
    shard0, shard2, rep = (Shard(0),), (Shard(2),), (Replicate(),)
    assert menu == {(str(p), str([p])) for p in (rep, shard0, shard2)}, menu


def test_plan_picks_a_declared_option_and_prices_it():
    _, planned = make_plan()
    declared = {"(S(0))": "batch", "(S(2))": "features", "(R)": "replicated"}
    fwd = [v for k, v in planned.items() if "bwd" not in k]
    assert len(fwd) == 1
    outs, ins = fwd[0]
    assert outs[0] in declared and ins == outs, planned
    assert outs[0] == "(S(0))"  # the batch option: the data is batch-sharded, nothing to move


def test_plan_file_with_a_region_the_model_no_longer_declares_is_refused():
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.api import fake_world

    plan_json, _ = make_plan()
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with autop_for(mesh, regions=()) as autop:  # the gate traced as plain ops now
            with pytest.raises(PlanMismatchError, match="local_map region.*'toy_gate'.*no longer declares"):
                autop.apply_placement(Plan.from_json(plan_json))


def test_declaration_errors():
    with pytest.raises(regions.RegionError, match="option 'b' declares 2 inputs"):
        regions.Region("two", [regions.Option("a", (Shard(0),), (Shard(0),)),
                               regions.Option("b", (Shard(0), Shard(0)), (Shard(0),))])
    with pytest.raises(regions.RegionError, match="already declared with 1 inputs"):
        regions.declare(regions.Region("toy_gate", [regions.Option("a", (Shard(0),) * 2, (Shard(0),))],
                                       fn=torch.add))


def test_outside_the_planner_the_region_is_plain_code():
    from region_workers import Toy, data

    torch.manual_seed(0)
    m = Toy()
    x, y = data()
    w1, w2 = m.w1.weight, m.w2.weight
    h = x @ w1.T
    ref = (((h * torch.sigmoid(h)) @ w2.T - y) ** 2).mean()
    assert torch.equal(m(x, y), ref)


@pytest.mark.slow
def test_runs_on_two_ranks_eager_and_compiled_like_one_rank():
    from apply_workers import run_distributed

    plan_json, _ = make_plan()
    bad_json, bad_regions = make_plan(bad=True)
    assert [v[0][0] for k, v in bad_regions.items() if "bwd" not in k] == ["(S(0))"]
    outs = run_distributed(worker, 2, plan_json, bad_json, timeout=400)
    ref = reference()
    for rank, out in enumerate(outs):
        for mode in ("eager", "compiled"):
            got = out[mode]
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (rank, mode, got["loss"], ref["loss"])
            for n, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-6)
        err = out["bad_error"]
        assert err is not None and "toy_bad" in err and "mesh axis 0 ('dp'" in err, err
        assert "declared S(0)" in err and "returned a R shard" in err, err
    assert (B, S, D) == (4, 8, 8)
