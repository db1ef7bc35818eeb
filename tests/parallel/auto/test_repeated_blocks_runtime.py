"""Repeated transformer blocks traced once (runtime/repeated_blocks.py): the step graph made
with copies of the first block's nodes is node for node the graph the interpreter traces
block by block (ops, arguments, shapes, which values share storage), so the memory estimate
is the same to the byte; and on gloo ranks a plan run through the copies trains like one rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import pytest
import torch
from apply_workers import (
    _GRAPHS,
    OVERRIDES,
    compare,
    grads_close,
    make_plans,
    reference,
    run_distributed,
    worker_with_layers,
)
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel import _torch as T
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.cost.memory import value_storages
from parallel.auto.regions import moe_dispatch
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.runtime.memory import step_memory, trace_step
from parallel.auto.runtime.runner import PlanRunner

LAYERS = 6


def _form(gm: torch.fx.GraphModule) -> list[tuple]:
    """The graph with node names replaced by positions and storages by first appearance."""
    pos: dict[torch.fx.Node, int] = {}
    storages: dict[Hashable, int] = {}  # as the memory walk tells them apart
    out = []
    for i, n in enumerate(gm.graph.nodes):
        pos[n] = i
        leaves, tree = T.tree_flatten((n.args, dict(n.kwargs)))
        args = tuple(("node", pos[a]) if isinstance(a, torch.fx.Node) else a for a in leaves)
        tensors = [t for t in T.tree_flatten(n.meta.get("val"))[0] if isinstance(t, torch.Tensor)]
        vals = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset(), str(t.device),
                      storages.setdefault(key, len(storages)))
                     for t, (key, _) in zip(tensors, value_storages(n), strict=True))
        out.append((n.op, n.target if n.op == "call_function" else n.op, str(tree), args, vals))
    return out


def _traced_both(model_name: str, shape: tuple, names: tuple, options: RuntimeOptions):
    """One plan's step graph traced twice, with block copies and with every block
    interpreted: ((step, estimate) copied, (step, estimate) interpreted)."""
    model_name, _, with_bias = model_name.partition("+")  # "+bias": each MoE layer's expert_bias buffer
    extra = {"load_balance_coeff": 0.0} if with_bias else {}  # the buffer, never updated (auto mode)
    model = build_model(model_name, "debug", device="meta", n_layers=LAYERS, **extra)
    tok = torch.zeros(8, 64, dtype=torch.long)
    with fake_world(int(torch.tensor(shape).prod())):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        regions = (moe_dispatch.NAME,) if model_name == "deepseek_v3" else ()
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, regions=regions,
                          planner=PlannerConfig(hardware="h100", memory_estimate=False)) as autop:
            plan = autop.optimize_placement(verbose=False)
            out = []
            for copy in (True, False):
                old = PlanRunner.copy_blocks
                PlanRunner.copy_blocks = copy
                try:
                    step = trace_step(autop.graph, autop.candidates, plan, mesh, options=options)
                finally:
                    PlanRunner.copy_blocks = old
                out.append((step, step_memory(step, mesh)))
            return out


# one case per path: a 1-D mesh bucketed and unbucketed; a 2x2 mesh with full AC and kept gathers (the
# plain 2x2 plan is the same path without them) and with per-op SAC on Qwen3; DeepSeek-V3's MoE layers with
# their expert-bias buffer (the MoE layers without it are the same path less the buffer)
@pytest.mark.parametrize("model,shape,names,options", [
    ("llama3", (4,), ("dp",), RuntimeOptions()),
    # unbucketed: each gradient reduced on its own (a later layer's: a copy of the first's)
    ("llama3", (4,), ("dp",), dataclasses.replace(RuntimeOptions(), bucket=False)),
    pytest.param("llama3", (2, 2), ("dp", "tp"), dataclasses.replace(RuntimeOptions(), ac_mode="full",
                                                                     reshard_after_forward=False),
                 marks=pytest.mark.slow),
    pytest.param("qwen3", (2, 2), ("dp", "tp"), dataclasses.replace(RuntimeOptions(), ac_mode="selective",
                                                                    ac_option="op"), marks=pytest.mark.slow),
    # a dense layer, then MoE layers (a local_map region each), with a buffer in every MoE layer (the
    # aux-loss-free expert bias): a block's own, not a value outside the blocks (as one it made every
    # layer a kind of its own: nothing was copied, 671B's estimate took 72 s instead of 28 s)
    pytest.param("deepseek_v3+bias", (4,), ("dp",), RuntimeOptions(), marks=pytest.mark.slow),
], ids=["llama-dp4", "llama-dp4-unbucketed", "llama-dp2xtp2-ac-full-keep-gathers", "qwen3-dp2xtp2-sac",
        "dsv3-bias-dp4"])
@pytest.mark.slow
def test_copied_blocks_are_the_traced_graph(model, shape, names, options):
    (copied, estimate), (traced, reference_estimate) = _traced_both(model, shape, names, options)
    counts = copied.runner.block_copy_counts
    # the first layer reads the embedding, the last feeds the final norm, the second (forward)
    # and the one before the last (backward) read those: the others are copies (DeepSeek-V3:
    # its first layer is dense, so the first two MoE layers are their own kind)
    own = 1 if model.startswith("deepseek_v3") else 0
    assert counts["fwd_copied"] >= LAYERS - 3 - own and counts["bwd_copied"] >= LAYERS - 4 - own, counts
    assert counts["fwd_refused"] == counts["bwd_refused"] == 0, counts
    if copied.runner.stats["bucketed_grad_reductions"] > LAYERS:  # a bucket per block and more
        assert counts["grad_reductions_copied"] >= LAYERS - 2, counts
    if not options.bucket:  # every parameter of a layer after the first: a copied reduction
        per_layer = len(copied.runner.graph.params) // LAYERS
        assert counts["grad_reductions_copied"] >= (LAYERS - 1) * per_layer, counts
    assert traced.runner.block_copy_counts == {}
    a, b = _form(copied.step_graph.gm), _form(traced.step_graph.gm)
    assert len(a) == len(b)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    assert first is None, (first, a[first], b[first])
    assert copied.step_graph.collectives == traced.step_graph.collectives
    assert estimate.peak_bytes == reference_estimate.peak_bytes
    assert estimate.summary() == reference_estimate.summary()


SHAPE, NAMES = (2,), ("dp",)
TRAIN_LAYERS = 4
KINDS = ["default", "fsdp", "tp"]


@pytest.fixture(scope="module")
def results():
    old = OVERRIDES["n_layers"]
    OVERRIDES["n_layers"] = TRAIN_LAYERS
    _GRAPHS.clear()  # this process's traces are of the shallower models of the other tests
    try:
        plans = make_plans([("llama3", k) for k in KINDS], SHAPE, NAMES)
        ref = reference("llama3", 1)
    finally:
        OVERRIDES["n_layers"] = old
        _GRAPHS.clear()
    jobs = [{"model": "llama3", "kind": k, "steps": 1, "plan": p} for k, p in zip(KINDS, plans)]
    outs = run_distributed(worker_with_layers, 2, SHAPE, NAMES, jobs, TRAIN_LAYERS, timeout=400)
    return ref, {k: [o[i] for o in outs] for i, k in enumerate(KINDS)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_copied_blocks_train_like_one_rank(results, kind):
    ref, by_kind = results
    for out in by_kind[kind]:
        copies = out["block_copies"]
        assert copies.get("fwd_copied", 0) + copies.get("bwd_copied", 0) > 0, copies
        assert not grads_close(out, ref), grads_close(out, ref)
        abs_d, rel_d, loss_d = compare(out, ref)
        assert loss_d <= 1e-4 * max(ref["losses"]), (out["losses"], ref["losses"])
        assert out["deviations"] == 0
