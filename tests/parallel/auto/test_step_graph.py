"""The training step as one per-device graph, built on a fake 2-rank world (no processes):
what the overlap pass moves, what activation checkpointing recomputes, and that the
recomputed ops keep their planned placements (same names as in the joint graph)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from models import build_model
from parallel import _torch as T
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.plan import Plan
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.runtime.schedule import _buffer_chain, _input_derived, _is_collective, _is_wait
from parallel.auto.runtime.step_graph import StepGraph
from parallel.auto.search import presets

GLOBAL_B, SEQ = 16, 128  # activations outweigh the weights: FSDP's gradient reduce-scatters pay


def _model_and_inputs() -> tuple[torch.nn.Module, tuple]:
    tok = torch.zeros(GLOBAL_B, SEQ, dtype=torch.long)
    return build_model("llama3", "debug", device="meta", n_layers=2), (tok, tok)


def _step_graph(plan_json: dict, options: RuntimeOptions, executable: bool = True) -> tuple[StepGraph, object]:
    model, inputs = _model_and_inputs()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="h100")) as autop:
        pm = autop.apply_placement(Plan.from_json(plan_json), options)
    runner = pm.plan_runner
    with T.FakeTensorMode(allow_non_fake_inputs=True):
        params = [DTensor.from_local(torch.empty(p.to_local().shape), mesh, p.placements, run_check=False,
                                     shape=p.shape, stride=p.stride()) for p in pm.parameters()]
        buffers = [torch.empty(b.shape, dtype=b.dtype) for b in pm.buffers()]
        inputs = [DTensor.from_local(torch.zeros((GLOBAL_B // 2, SEQ), dtype=torch.long), mesh,
                                     runner.input_placements(i), run_check=False, shape=(GLOBAL_B, SEQ),
                                     stride=(SEQ, 1)) for i in range(2)]
        return StepGraph(runner, params, buffers, inputs, overlap=options.overlap, executable=executable), runner


@pytest.fixture(scope="module")
def fsdp_plan() -> dict:
    """FSDP's compute (every forward matmul on a gathered weight), batch-sharded data."""
    model, inputs = _model_and_inputs()
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="h100")) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])
            presets.fsdp(autop)
            return autop.optimize_placement(verbose=False).to_json()


def _ops(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and T.op_name(n.target) == name]


@pytest.mark.slow
def test_overlap_prefetches_gathers_and_defers_waits(fsdp_plan):
    with fake_world(2):
        # one reduction bucket per block (this tiny model's blocks all fit one 25 MiB bucket)
        plain, _ = _step_graph(fsdp_plan, RuntimeOptions(overlap=False, reduce_bucket_bytes=0))
        sg, runner = _step_graph(fsdp_plan, RuntimeOptions(overlap=True, reduce_bucket_bytes=0))
    rep = sg.overlap
    print(rep)
    assert rep.collectives == plain.collectives == sg.collectives > 0
    assert rep.prefetched_gathers >= 4 and rep.waits_moved >= 2
    nodes = list(sg.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    derived = _input_derived(sg.gm.graph)  # parameter gathers: fed by parameter shards only
    gathers = [n for n in nodes if _is_collective(n) and T.op_name(n.target) == "all_gather_into_tensor"
               and all(a in derived for c in _buffer_chain(n) for a in c.all_input_nodes if a not in _buffer_chain(n))]
    assert len(gathers) >= 6
    # prefetch: gather k starts before the first op that reads gather k-1's result ...
    for prev, cur in zip(gathers, gathers[1:]):
        wait = next(u for u in prev.users if _is_wait(u))
        assert pos[cur] < max(pos[u] for u in wait.users), (prev, cur)
    # ... and every wait sits right before (cheap ops aside) the first op that needs it
    for w in [n for n in nodes if _is_wait(n)]:
        assert all(pos[u] > pos[w] for u in w.users)
    # gradient reductions: each is waited for once the next has started (one in flight, FSDP's), not all at
    # the end of the step, where every unreduced bucket would still be alive
    rs = [n for n in nodes if _is_collective(n) and T.op_name(n.target) == "reduce_scatter_tensor"]
    rs_waits = [next(u for u in n.users if _is_wait(u)) for n in rs]
    assert len(rs) >= 3 and rep.reductions_bounded >= len(rs) - 1
    for k in range(len(rs) - 2):
        assert pos[rs[k]] < pos[rs_waits[k]] < pos[rs[k + 2]], (rs[k], rs_waits[k], rs[k + 2])
    # a CPU (gloo) mesh: never two all-gathers of one group in flight (schedule.py: they corrupt the heap)
    assert gathers_in_flight(plain.gm) == 1 and gathers_in_flight(sg.gm) == 1


def gathers_in_flight(gm: torch.fx.GraphModule) -> int:
    """The most all-gathers of one process group started and not yet waited for, in graph order."""
    open_: dict[object, set] = {}
    most = 0
    for n in gm.graph.nodes:
        if _is_collective(n) and T.op_name(n.target) == "all_gather_into_tensor":
            group = n.args[-1]
            open_.setdefault(group, set()).add(n)
            most = max(most, len(open_[group]))
        elif _is_wait(n):
            for members in open_.values():
                members.discard(n.args[0])
    return most


def test_one_gather_per_group_on_gloo_keeps_the_other_groups_overlapped():
    """Three all-gathers on one group and one on another, each read after a matmul: the
    overlap pass starts them all at once; with `one_gather_per_group` (what a CPU mesh's
    step graph gets) each waits for its group's previous one, while the other group's
    gather stays in flight across them."""
    from torch.distributed import _functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from parallel.auto.runtime.schedule import schedule_overlap

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def step(x, a, b, c, d):
            ga, gb, gc = (funcol.all_gather_single(w, 0, (mesh, 0)) for w in (a, b, c))
            gd = funcol.all_gather_single(d, 0, (mesh, 1))
            y = x @ x
            y = y @ y + ga.sum()
            y = y @ y + gb.sum()
            return y @ y + gc.sum() + gd.sum()

        args = (torch.randn(64, 64), *[torch.randn(1024) for _ in range(4)])
        graphs = {}
        for serial in (False, True):
            with T.FakeTensorMode():
                gm = make_fx(step, tracing_mode="fake")(*args)
            graphs[serial] = (gm, schedule_overlap(gm, one_gather_per_group=serial))
    assert gathers_in_flight(graphs[False][0]) == 3  # precondition: the plain pass overlaps them all
    gm, rep = graphs[True]
    assert gathers_in_flight(gm) == 1 and rep.gathers_serialised == 2
    nodes = list(gm.graph.nodes)
    starts = [n for n in nodes if _is_collective(n)]
    tp_gather = next(n for n in starts if n.args[-1] != starts[0].args[-1])
    tp_wait = next(u for u in tp_gather.users if _is_wait(u))
    assert nodes.index(tp_wait) > max(nodes.index(n) for n in starts)  # still in flight across the others


def test_reductions_over_two_axes_are_bounded_stage_by_stage():
    """Six gradients, each reduced over both axes of a 2 x 2 mesh (a reduce-scatter per axis,
    the second reading the first), issued after the whole backward as the runner does: every
    stage waits one chain behind (its buffer freed), the second stage starts right after the
    first is waited for; none is left to the end of the step."""
    from torch.distributed import _functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from parallel.auto.runtime.schedule import schedule_overlap

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))

        def step(x, *ws):
            grads, y = [], x
            for w in ws:  # the backward: one gradient per block
                y = torch.tanh(y @ w)
                grads.append(y.float())
            return [funcol.reduce_scatter_single(funcol.reduce_scatter_single(g, "sum", 0, (mesh, 1)), "sum", 0,
                                                 (mesh, 0)) for g in grads]

        args = (torch.randn(64, 64, dtype=torch.bfloat16), *[torch.randn(64, 64, dtype=torch.bfloat16)] * 6)
        with T.FakeTensorMode():
            gm = make_fx(step, tracing_mode="fake")(*args)
        rep = schedule_overlap(gm)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    stage0 = [n for n in nodes if _is_collective(n) and not _is_wait(n.args[0])]
    wait = {c: next(u for u in c.users if _is_wait(u)) for c in stage0}
    stage1 = [next(u for u in wait[c].users if _is_collective(u)) for c in stage0]
    wait.update({c: next(u for u in c.users if _is_wait(u)) for c in stage1})
    tanh = [pos[n] for n in nodes if n.op == "call_function" and T.op_name(n.target) == "tanh"]
    starts = [pos[c] for c in stage0] + [len(nodes)]  # chain k + 1's stage 0 (the end after the last)
    assert len(stage0) == len(stage1) == len(tanh) == 6
    for k in range(6):
        w0, c1, w1 = pos[wait[stage0[k]]], pos[stage1[k]], pos[wait[stage1[k]]]
        if k + 1 < 6:  # stage 0 of chain k: waited for once chain k + 1 (after its gradient) has started
            assert tanh[k + 1] < starts[k + 1] < w0 < starts[k + 2], k
        assert w0 < c1 <= w0 + 3, k  # stage 1 starts right after stage 0 is waited for ...
        if k + 2 < 6:  # ... and is waited for one chain later
            assert starts[k + 2] < w1 < starts[k + 3], k
    assert rep.reductions_bounded >= 8


@pytest.mark.slow
def test_analysis_step_graph_has_the_same_schedule_and_refuses_to_run(fsdp_plan):
    """runtime/memory.py walks a step graph built with executable=False (its code is not
    regenerated after scheduling): same nodes in the same order as the one the runtime runs,
    whose only changes are the sums it now writes in place and the fresh buffers it
    all-reduces in place (the walk prices them as new tensors: an estimate above the run by
    at most those)."""
    with fake_world(2):
        run, _ = _step_graph(fsdp_plan, RuntimeOptions(overlap=True))
        walk, _ = _step_graph(fsdp_plan, RuntimeOptions(overlap=True), executable=False)
    assert run.adds_in_place > 0 and walk.adds_in_place == 0
    sums = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)  # an in-place sum writes into either summand

    def listing(gm):
        return [(n.name, sorted(map(str, n.args))) if n.target in sums
                else n.format_node().replace("all_reduce_.default", "all_reduce.default") for n in gm.graph.nodes]

    assert listing(walk.gm) == listing(run.gm)
    assert walk.overlap.starts_moved == run.overlap.starts_moved > 0
    assert run.gm.code == run.gm.graph.python_code("self").src  # the runtime's code follows the schedule
    with pytest.raises(RuntimeError, match="executable=False"):
        walk([], [], [])


@pytest.mark.slow
@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_recomputes_in_the_step_graph(fsdp_plan, mode, option):
    with fake_world(2):
        none, _ = _step_graph(fsdp_plan, RuntimeOptions())
        ac, runner = _step_graph(fsdp_plan, RuntimeOptions(ac_mode=mode, ac_option=option))
    saved_none = len(none.gm.graph.find_nodes(op="placeholder"))
    mm_none, mm_ac = len(_ops(none.gm, "mm")), len(_ops(ac.gm, "mm"))
    print(f"{mode}/{option}: {runner.recomputed} forward nodes recomputed, matmuls {mm_none} -> {mm_ac}, "
          f"saved values {len(runner.saved_names)}")
    assert runner.recomputed > 0
    assert mm_ac > mm_none if (mode, option) != ("selective", "op") else mm_ac >= mm_none
    assert saved_none == len(ac.gm.graph.find_nodes(op="placeholder"))  # same step inputs
    # recomputed ops are the joint graph's own nodes: their planned specs apply in backward
    assert set(n.name for n in runner.bwd_gm.graph.nodes if n.op == "call_function") <= set(runner.spec) | {
        n.name for n in runner.bwd_gm.graph.nodes if n.target is operator.getitem}


def test_the_loss_needs_no_barrier_between_forward_and_backward(fsdp_plan):
    """The token count the mean loss divides by is all-reduced from the labels before the
    forward's first matmul (runtime/loss_sync.py), and the loss's own all-reduce is waited
    for by the step's output only: no op of the backward waits for a collective the
    forward's last ops start."""
    with fake_world(2):
        sg, _ = _step_graph(fsdp_plan, RuntimeOptions(overlap=True))
    assert sg.loss_syncs_moved == 2
    nodes = list(sg.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    first_mm = min(pos[n] for n in _ops(sg.gm, "mm"))
    reductions = [n for n in nodes if _is_collective(n) and T.op_name(n.target).startswith("all_reduce")]
    counted = [n for n in reductions if T.op_name(n.args[0].target) == "_to_copy"]
    assert len(counted) == 1 and pos[counted[0]] < first_mm
    labels = [n for n in nodes if n.op == "placeholder"][-1]
    assert labels in counted[0].args[0].args[0].args[0].all_input_nodes  # _to_copy(sum(ne(labels)))
    nll_fwd = _ops(sg.gm, "nll_loss_forward")[0]
    loss_reduce = next(n for n in reductions if n.args[0].args[0] is nll_fwd)
    (wait,) = loss_reduce.users
    assert pos[wait] > max(pos[n] for n in _ops(sg.gm, "mm"))  # after the backward's last matmul
    assert {T.op_name(u.target) if u.op == "call_function" else u.op for u in wait.users} <= {"view", "output"}
