"""One step-graph trace per plan: the memory estimate's runner and step graph are handed to
the ParallelModule of that plan (api.AutoParallel.apply_placement), whose first
forward_backward runs that very graph when the input layout matches (runtime/module.py).

Fast: on a fake world, fake tensors (as the dry run): exactly one StepGraph from
optimize_placement to the end of the first step, the same graph code and bytes as a fresh
trace, compile wraps the same graph, other options or layouts trace their own. Slow: on 2
gloo ranks, loss and gradients of the reused graph equal a freshly traced one's (fp32)."""

from __future__ import annotations

import logging

import pytest
import torch
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.fx.experimental.proxy_tensor import make_fx

from models import build_model
from parallel import _torch as T
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.cost.memory import step_graph_memory
from parallel.auto.plan import Plan
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.runtime.step_graph import StepGraph, fake_constants
from parallel.auto.search import presets

GLOBAL_B, SEQ, WORLD = 4, 16, 2


@pytest.fixture
def traces(monkeypatch) -> list[StepGraph]:
    """Every StepGraph traced while the test runs."""
    made: list[StepGraph] = []
    init = StepGraph.__init__

    def counting(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(StepGraph, "__init__", counting)
    return made


def _model() -> torch.nn.Module:
    return build_model("llama3", "debug", device="meta", n_layers=2)


def _autop(mesh, model, runtime: RuntimeOptions | None = None) -> AutoParallel:
    tok = torch.zeros(GLOBAL_B, SEQ, dtype=torch.long, device="meta")
    return AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, runtime=runtime,
                        planner=PlannerConfig(hardware="h100", time_limit=30))


def _fake_step(pm) -> StepGraph:
    """The first training step on fake tensors (the dry run's way): the step graph it ran."""
    fake_mode = T.FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        pm.to_empty(device="cpu")
        local = torch.zeros(GLOBAL_B // WORLD, SEQ, dtype=torch.long)
        with torch.no_grad():
            pm.forward_backward(local, local)
    (sg,) = pm.step_graphs.values()
    return sg


@pytest.mark.slow
def test_one_trace_from_plan_to_the_first_step(traces, caplog):
    with fake_world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        model = _model()
        with _autop(mesh, model) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])
            plan = autop.optimize_placement(verbose=False)
            assert len(traces) == 1 and plan.memory is not None  # the estimate's trace
            estimated = traces[0]
            assert not estimated.executable  # analysis-only until handed over
            runner = autop.traced_step.runner
            # the trainer applies the plan rank 0 broadcast as JSON: the same placements
            with caplog.at_level(logging.INFO, logger="parallel.auto.runtime"):
                pm = autop.apply_placement(Plan.from_json(plan.to_json()))
            assert autop.traced_step is None  # handed over, not kept twice
            assert pm.plan_runner is runner and pm.plan is not plan  # the estimate's runner, running this plan
            with caplog.at_level(logging.INFO, logger="parallel.auto.runtime"):
                sg = _fake_step(pm)
        assert sg is estimated and sg.executable and not sg.compiled
        assert len(traces) == 1, f"{len(traces)} step-graph traces from plan to the first step"
        assert "step graph of the memory estimate reused" in caplog.text
        assert pm.pending_step_graph is None

        # a second module of the same plan has nothing handed over: it traces its own, the same graph
        with _autop(mesh, model) as autop2:
            autop2.add_input_constraints([(Shard(0),), (Shard(0),)])
            pm2 = autop2.apply_placement(plan)
            fresh = _fake_step(pm2)
        assert len(traces) == 2 and fresh is not sg
        assert fresh.gm.code == sg.gm.code  # no_grad in both traces: the same nodes, the same order
        n_out = len(fresh.out_specs)
        walk = dict(n_inputs=2, n_outputs=n_out, state_bytes=0, optimizer_bytes=0, optimizer_temp=0)
        assert step_graph_memory(fresh.gm, **walk) == step_graph_memory(sg.gm, **walk)


def test_compile_wraps_the_estimates_graph_and_other_options_trace_again(traces):
    with fake_world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        with _autop(mesh, _model()) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])
            plan = autop.optimize_placement(verbose=False)
            estimated = traces[-1]
            pm = autop.apply_placement(plan, RuntimeOptions(compile=True))  # compilation aside: same graph
            assert pm.pending_step_graph is estimated
            with T.FakeTensorMode(allow_non_fake_inputs=True):
                pm.to_empty(device="cpu")
                local = torch.zeros(GLOBAL_B // WORLD, SEQ, dtype=torch.long)
                with torch.no_grad():
                    sg = pm._step_graph(*pm.planned_arguments(local, local))  # built, not run (no kernels)
            assert sg is estimated and sg.compiled and sg.fn._orig_mod is sg.gm
            assert len(traces) == 1

            autop.estimate_memory(plan)
            assert autop.traced_step is not None and autop.traced_step.step_graph is traces[-1]
            runner = autop.traced_step.runner
            pm_ac = autop.apply_placement(plan, RuntimeOptions(ac_mode="full"))  # another graph: not handed over
            assert pm_ac.pending_step_graph is None and autop.traced_step is None
            assert pm_ac.plan_runner is not runner and pm_ac.plan_runner.options.ac_mode == "full"


def test_a_call_of_another_layout_traces_its_own(traces, caplog):
    with fake_world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        with _autop(mesh, _model()) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])
            pm = autop.apply_placement(autop.optimize_placement(verbose=False))
        pending = pm.pending_step_graph
        other = list(pending.key)
        other[-1] = (other[-1][0], (1, SEQ), (SEQ, 1), torch.long, "cpu")  # a layout it was not traced for
        with caplog.at_level(logging.INFO, logger="parallel.auto.runtime"):
            assert pm._planned_step_graph(tuple(other), True, False, "default") is None
        assert "traced for another input layout" in caplog.text
        assert pm.pending_step_graph is None and not pending.executable  # released, never run
        assert pm._planned_step_graph(pending.key, True, False, "default") is None  # one chance only


def test_fake_constants_are_found():
    gm = make_fx(lambda x: x + torch.tensor([1.0, 2.0]))(torch.ones(2))
    assert [n.op for n in gm.graph.nodes].count("get_attr") == 1 and fake_constants(gm) == []
    (node,) = gm.graph.find_nodes(op="get_attr")
    with T.FakeTensorMode():
        setattr(gm, node.target, torch.ones(2))
    assert fake_constants(gm) == [node.target]


# ---------------------------------------------------------------- 2 gloo ranks: the numbers


def _reuse_worker(rank: int, world: int) -> dict:
    from parallel.auto.runtime import local_shard

    made: list = []
    init = StepGraph.__init__

    def counting(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    StepGraph.__init__ = counting
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, model.args.vocab_size, (GLOBAL_B, SEQ + 1), generator=g)
    tok, lab = data[:, :-1], data[:, 1:]
    out: dict = {}
    with _autop(mesh, model) as autop:
        autop.add_input_constraints([(Shard(0),), (Shard(0),)])
        plan = autop.optimize_placement(verbose=False)  # every rank estimates here: its own trace
        modules = {"reused": autop.apply_placement(plan), "fresh": autop.apply_placement(plan)}
    for name, pm in modules.items():
        pm.to_empty(device="cpu")
        torch.manual_seed(0)
        pm.init_weights()
        runner = pm.plan_runner
        lt, ll = (local_shard(x, mesh, runner.input_placements(i)) for i, x in enumerate((tok, lab)))
        before = len(made)
        loss = pm.forward_backward(lt, ll)
        (sg,) = pm.step_graphs.values()
        out[name] = {"loss": loss.detach().clone(), "traced_now": len(made) - before,
                     "reused": sg is made[0],
                     "grads": {f: p.grad.full_tensor().clone() for f, p in pm.named_parameters()}}
    out["traces"] = len(made)
    return out


@pytest.mark.slow  # 2 gloo ranks
def test_reused_graph_gives_the_fresh_graphs_loss_and_gradients():
    outs = run_distributed(_reuse_worker, WORLD, timeout=300)
    for rank, out in enumerate(outs):
        reused, fresh = out["reused"], out["fresh"]
        assert reused["reused"] and reused["traced_now"] == 0, (rank, reused["traced_now"])  # the estimate's graph
        assert not fresh["reused"] and fresh["traced_now"] == 1
        assert out["traces"] == 2
        torch.testing.assert_close(reused["loss"], fresh["loss"], rtol=1e-5, atol=0)
        assert reused["grads"].keys() == fresh["grads"].keys()
        for f, g in reused["grads"].items():
            torch.testing.assert_close(g, fresh["grads"][f], rtol=1e-5, atol=1e-7, msg=f)


@pytest.mark.slow
def test_the_partition_is_made_once_per_graph_and_checkpointing_policy():
    """Runners of different plans share the joint graph's forward/backward partition
    (runner.phase_graphs): the same GraphModules for the same policy, their own for another,
    and an estimate made from the shared partition equals one made from a fresh partition,
    after another policy re-tagged the joint graph in between."""
    with fake_world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        with _autop(mesh, _model()) as autop:
            plan = autop.optimize_placement(verbose=False)
            first = autop.estimate_memory(plan)
            runner = autop.traced_step.runner
            graph = autop.graph
            assert len(graph.phase_graphs) == 1
            presets.ddp(autop)  # another plan, the same policy: the same partition
            other = autop.optimize_placement(verbose=False)
            assert other.placement_digest() != plan.placement_digest()
            autop.estimate_memory(other)
            assert autop.traced_step.runner.fwd_gm is runner.fwd_gm and len(graph.phase_graphs) == 1
            full = RuntimeOptions(ac_mode="full")  # another policy: its own partition, recomputing more
            autop.estimate_memory(plan, full)
            assert autop.traced_step.runner.fwd_gm is not runner.fwd_gm and len(graph.phase_graphs) == 2
            assert autop.traced_step.runner.recomputed > runner.recomputed
            again = autop.estimate_memory(plan)  # the first policy again: the kept partition
            assert autop.traced_step.runner.fwd_gm is runner.fwd_gm
            graph.phase_graphs.clear()
            fresh = autop.estimate_memory(plan)  # a new partition of the (re-tagged) joint graph
            assert autop.traced_step.runner.fwd_gm is not runner.fwd_gm
    assert again.peak_bytes == fresh.peak_bytes == first.peak_bytes
    assert again.summary() == fresh.summary() == first.summary()


@pytest.mark.slow
def test_another_planner_on_the_same_graph_and_mesh_reuses_the_estimate(traces):
    """A sweep's points on one trace and one mesh: a plan one planner estimated is not traced
    again by the next (the same bytes); another runtime option is; the planner that made an
    estimate traces again when asked (apply_placement takes that step graph)."""
    with fake_world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        model = _model()
        with _autop(mesh, model) as autop:
            plan = autop.optimize_placement(verbose=False)
            graph = autop.graph
            autop.estimate_memory(plan)
            assert len(traces) == 2 and autop.traced_step is not None
        tok = torch.zeros(GLOBAL_B, SEQ, dtype=torch.long, device="meta")
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, graph=graph,
                          planner=PlannerConfig(hardware="h100", time_limit=30)) as again:
            est = again.estimate_memory(plan)
            assert len(traces) == 2 and again.traced_step is None
            assert est == plan.memory
            full = again.estimate_memory(plan, RuntimeOptions(ac_mode="full"))
            assert len(traces) == 3 and full.recompute == "full" and est.recompute == "none"
