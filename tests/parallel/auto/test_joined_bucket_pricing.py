"""The planner prices the gradient reductions the runtime issues: the runtime joins the
blocks' gradient buckets up to `reduce_bucket_bytes` (DDP's 25 MiB rule), so a small model's
gradients are all-reduced in one collective, and the solver charges the collective's latency
once per joined bucket, not once per block. Checked against the step graph the runtime
builds (a fake world of 2): the difference in the ILP's all-reduce price between one bucket
per block and joined buckets is the latency of the collectives the runtime no longer issues."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from models import build_model
from parallel import _torch as T
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.candidates.placements import join_buckets, local_shape
from parallel.auto.config import PlannerConfig
from parallel.auto.cost.comm import collective_time
from parallel.auto.problem.formulation import joined_buckets
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.runtime.step_graph import StepGraph
from parallel.auto.search import presets

B, SEQ, CAP = 8, 64, 25 * 2**20


def _ddp_plan_and_reductions(cap: int, replay: object = None) -> tuple[object, int, object]:
    """The DDP preset planned (or `replay`'s placements priced) with `reduce_bucket_bytes` =
    cap, the number of gradient all-reduces in the step graph the runtime builds for it, and
    its cost model."""
    tok = torch.zeros(B, SEQ, dtype=torch.long)
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    options = RuntimeOptions(reduce_bucket_bytes=cap)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, runtime=options,
                          planner=PlannerConfig(hardware="h100")) as autop:
            if replay is None:
                autop.add_input_constraints([(Shard(0),), (Shard(0),)])
                presets.ddp(autop)
            plan = autop.optimize_placement(verbose=False) if replay is None else autop.replay_placement(replay)
            pm = autop.apply_placement(plan, options)
            cm = autop.cost_model()
        runner = pm.plan_runner
        with T.FakeTensorMode(allow_non_fake_inputs=True):
            params = [DTensor.from_local(torch.empty(p.to_local().shape), mesh, p.placements, run_check=False,
                                         shape=p.shape, stride=p.stride()) for p in pm.parameters()]
            buffers = [torch.empty(b.shape, dtype=b.dtype) for b in pm.buffers()]
            inputs = [DTensor.from_local(torch.zeros(local_shape((B, SEQ), pl, (2,)), dtype=torch.long), mesh, pl,
                                         run_check=False, shape=(B, SEQ), stride=(SEQ, 1))
                      for pl in (runner.input_placements(i) for i in range(2))]
            sg = StepGraph(runner, params, buffers, inputs, overlap=True, executable=False)
    n_params = sum(1 for _ in pm.parameters())
    big = [n for n in sg.gm.graph.nodes if "all_reduce" in str(n.target)
           and n.args[0].meta["val"].numel() > n_params]  # the gradient buckets, not the loss's scalars
    return plan, len(big), cm


def test_joined_buckets_group_consecutive_blocks_up_to_the_cap():
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    with fake_world(1):
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        tok = torch.zeros(2, 16, dtype=torch.long)
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="h100")) as autop:
            params = autop.graph.params
    per_block = joined_buckets(params, 0)
    assert per_block["layers.0.attention.wq.weight"] == 9 and per_block["output.weight"] == 1
    assert set(joined_buckets(params, CAP).values()) == {len(params)}  # this small model: one bucket
    layer_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("layers.1."))
    capped = joined_buckets(params, layer_bytes + 1)  # the last block joins the norm and head that follow it
    assert capped["layers.1.attention.wq.weight"] == capped["output.weight"] == 9 + 2


def test_join_buckets_keeps_each_group_apart_and_forward_order_inside():
    """DDP's rule as the runtime and the planner share it: blocks come last first; a bucket
    closes once it holds the cap; an all-reduce bucket never takes a reduce-scatter's block."""
    backward = [("ar", ["l3.a", "l3.b"], 6), ("rs", ["l2.a"], 4), ("ar", ["l2.b"], 3), ("ar", ["l1.a"], 5),
                ("rs", ["l0.a"], 1)]
    assert join_buckets(backward, 8) == [("ar", ["l2.b", "l3.a", "l3.b"]), ("ar", ["l1.a"]), ("rs", ["l0.a", "l2.a"])]
    assert join_buckets(backward, 0) == [(g, m) for g, m, _ in backward]  # cap 0: one bucket per block


@pytest.mark.slow
def test_the_all_reduce_price_drops_by_the_latency_of_the_collectives_the_runtime_joins():
    per_block, k_blocks, cm = _ddp_plan_and_reductions(0)
    joined, k_joined, _ = _ddp_plan_and_reductions(CAP, replay=per_block)
    assert per_block.placement_digest() == joined.placement_digest()  # the same DDP placements
    assert k_blocks >= 3 and k_joined == 1  # the layers, the norm, the embeddings or head; then one bucket
    latency = collective_time("all_reduce", 1, cm.links[0])[0] * cm.schedule.overlapped_share(cm.hw.comm_overlap)
    saved = per_block.comm_us["all_reduce@dp"] - joined.comm_us["all_reduce@dp"]
    # within a tenth of one collective's latency: a gradient the plan reduces another way (one
    # of the 256 x 256 embedding and head here) still counts in its joined bucket's size
    assert saved == pytest.approx((k_blocks - k_joined) * latency, abs=0.1 * latency)
    assert joined.objective_us < per_block.objective_us
