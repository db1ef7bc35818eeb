"""Activation checkpointing chosen per transformer block (RuntimeOptions.ac_blocks, one of
parallel.activation_checkpoint.AC_CHOICES each): the joint graph's forward is tagged block by
block (full: the whole block recomputed; op: the per-op pattern, its matmul count per block);
bad choices and a length other than the model's number of blocks are errors; and on 2 gloo
ranks every choice, and a mixed one, trains with the losses of one rank without checkpointing.
Their memory estimates against the allocator's peak: test_memory_measured.py (one launch with
that file's plans)."""

from __future__ import annotations

import operator

import pytest
import torch
from apply_workers import grads_close, make_plans, reference, run_distributed, worker
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import CheckpointPolicy

from models import build_model
from parallel.activation_checkpoint import _MM_OPS, AC_CHOICES, SAC_SAVE_OPS, block_policies, tag_recomputation
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.runtime.runner import block_indices, phase_graphs
from parallel.auto.trace.joint import FWD

MUST, PREFER = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


@pytest.fixture(scope="module")
def joint():
    """The 2-layer debug LLaMA's joint graph, its forward nodes and their blocks."""
    tok = torch.zeros(2, 16, dtype=torch.long)
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="cpu")) as autop:
            graph = autop.graph
    forward = [n for n in graph.gm.graph.nodes if graph.phase.get(n.name) == FWD and n.op == "call_function"]
    return graph, forward, block_indices(graph)


def _tags(forward, block_of, policies) -> dict[int, list]:
    tag_recomputation(forward, block_of, policies)
    out: dict[int, list] = {0: [], 1: []}
    for n in forward:
        if n.name in block_of:
            out[block_of[n.name]].append((n, n.meta.get("recompute"), n.meta.get("ac_graph_id")))
    return out


def _seeded(n) -> bool:
    m = n.args[0] if n.target is operator.getitem else n
    return torch.Tag.nondeterministic_seeded in getattr(m.target, "tags", ())


def test_block_policies_map_the_job_s_settings():
    assert block_policies("none", "op", 2) == ("none", "none")
    assert block_policies("full", "op", 3) == ("full",) * 3
    assert block_policies("selective", "op", 2) == ("op", "op")
    assert block_policies("selective", 2, 5) == ("full", "none", "full", "none", "full")
    assert set(AC_CHOICES) == {"none", "op", "full"}
    with pytest.raises(ValueError, match="positive integer"):
        block_policies("selective", "0", 2)


def test_mixed_choices_tag_each_block_by_its_own(joint):
    _, forward, block_of = joint
    assert max(block_of.values()) == 1
    mixed = _tags(forward, block_of, ("full", "op"))
    full = [(n.name, t) for n, t, _ in mixed[0]]
    assert full and all(t == (MUST if _seeded(n) else PREFER) for n, t, _ in mixed[0]), full
    assert any(t == PREFER for _, t in full) and all(g == 0 for _, _, g in mixed[0])
    mm = [t for n, t, _ in mixed[1] if n.target in _MM_OPS]  # the count starts again in block 1
    assert len(mm) >= 4 and mm == [MUST if i % 2 == 0 else PREFER for i in range(len(mm))], mm
    attn = [t for n, t, _ in mixed[1] if n.target in SAC_SAVE_OPS - _MM_OPS]  # attention (seeded too)
    assert attn and all(t == MUST for t in attn)
    assert all(g == 1 for _, _, g in mixed[1])
    # each block is tagged as the uniform policy of its choice tags it
    op_only = [(n.name, t) for n, t, _ in _tags(forward, block_of, ("op", "op"))[1]]
    assert op_only == [(n.name, t) for n, t, _ in mixed[1]]
    none_full = _tags(forward, block_of, ("none", "full"))
    assert all(t is None and g is None for _, t, g in none_full[0])
    assert [t for _, t, _ in none_full[1]] == [MUST if _seeded(n) else PREFER for n, _, _ in none_full[1]]


def test_bad_ac_blocks_raise(joint):
    graph, forward, block_of = joint
    with pytest.raises(ValueError, match="'fast' is not an activation checkpointing choice"):
        RuntimeOptions(ac_blocks=("full", "fast"))
    with pytest.raises(ValueError, match="tuple of"):
        RuntimeOptions(ac_blocks="full")
    assert RuntimeOptions(ac_blocks=["full", "op"]).ac_blocks == ("full", "op")  # JSON lists kept as tuples
    with pytest.raises(ValueError, match="3 choices but the model has 2 transformer blocks"):
        phase_graphs(graph, block_of, RuntimeOptions(ac_blocks=("full", "op", "none")), "cpu")
    with pytest.raises(ValueError, match="block 1 has no activation checkpointing choice"):
        tag_recomputation(forward, block_of, ("full",))
    with pytest.raises(ValueError, match="choices"):
        tag_recomputation(forward, block_of, ("full", "selective"))
    opts = RuntimeOptions(ac_mode="full", ac_blocks=("none", "op"))  # ac_blocks overrides the mode
    assert opts.ac_policies(2) == ("none", "op") and opts.ac_label == "per block: none, op"
    assert opts.ac_level == "selective" and RuntimeOptions(ac_blocks=("full", "full")).ac_level == "full"


@pytest.mark.slow
def test_blocks_of_other_choices_are_not_copies_and_the_step_graph_is_the_traced_one():
    """Repeated blocks copied only where the choices agree (runtime/repeated_blocks.py): the step
    graph is the one traced block by block, and so is the estimate."""
    from test_repeated_blocks_runtime import _form, _traced_both

    choices = ("full", "op", "op", "none", "full", "op")
    (copied, est), (traced, ref) = _traced_both("llama3", (4,), ("dp",), RuntimeOptions(ac_blocks=choices))
    counts = copied.runner.block_copy_counts
    assert counts["fwd_copied"] >= 1 and counts["bwd_copied"] >= 1, counts  # layers.2: a copy of layers.1
    assert _form(copied.step_graph.gm) == _form(traced.step_graph.gm)
    assert est.peak_bytes == ref.peak_bytes and est.recompute == "per block: " + ", ".join(choices)
    assert est.recompute_by_block == {f"layers.{i}": c for i, c in enumerate(choices)}


CHOICES = {"none": RuntimeOptions(), "op": RuntimeOptions(ac_mode="selective", ac_option="op"),
           "full": RuntimeOptions(ac_mode="full"), "full,op": RuntimeOptions(ac_blocks=("full", "op")),
           "blocks none,full": RuntimeOptions(ac_blocks=("none", "full"))}
STEPS = 3


@pytest.mark.slow  # 2 gloo ranks, one launch for every choice
def test_every_choice_trains_like_one_rank_without_checkpointing():
    ref = reference("llama3", STEPS)
    plan = make_plans([("llama3", "fsdp")], (2,), ("dp",))[0]
    jobs = [{"model": "llama3", "kind": "fsdp", "steps": STEPS, "plan": plan, "options": o} for o in CHOICES.values()]
    outs = run_distributed(worker, 2, (2,), ("dp",), jobs, timeout=300)
    print(f"\n1 rank, no AC: {ref['losses']}")
    for i, name in enumerate(CHOICES):
        for rank, out in enumerate(outs):
            print(f"2 ranks, AC {name:<18} rank {rank}: {out[i]['losses']} (recomputed {out[i]['recomputed']})")
            torch.testing.assert_close(out[i]["losses"], ref["losses"], rtol=1e-5, atol=0)
            assert out[i]["deviations"] == 0 and not grads_close(out[i], ref)
    rec = {name: outs[0][i]["recomputed"] for i, name in enumerate(CHOICES)}
    assert rec["none"] < rec["op"] < rec["full"] and rec["none"] < rec["full,op"] < rec["full"], rec
