"""A model nobody here wrote (a `transformers` T5: encoder and decoder stacks whose blocks
share their indices) planned fully sharded on a fake world: every gradient reduction
bucket holds ONE repeated block (encoder block i and decoder block i never share one),
and each reduction is waited for once the next has started, not at the end of the step. With
a bucket cap (DDP's rule) blocks smaller than the cap share a reduction: consecutive ones in
the order the backward produces them, each closed bucket holding at least the cap."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from parallel import _torch as T

tf = pytest.importorskip("transformers")

_WORLD, _B, _S = 2, 4, 16
_CAP = 60_000  # bytes: about two of this T5's blocks (encoder ~34 kB of fp32 gradients, decoder ~51 kB)
_CHEAP = {"view", "_unsafe_view", "reshape", "slice", "split", "split_with_sizes", "_to_copy", "alias", "detach",
          "clone", "contiguous", "t", "permute", "unflatten", "flatten", "narrow", "select", "squeeze", "unsqueeze"}


def _t5() -> torch.nn.Module:
    cfg = tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=64,
                      dropout_rate=0.0, decoder_start_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        return tf.T5ForConditionalGeneration(cfg)


def _loss(model, src, tgt, labels):
    logits = model(input_ids=src, decoder_input_ids=tgt).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _is_coll(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"


def _reduction_of(n: fx.Node) -> fx.Node | None:
    """The collective (behind its wait and layout ops) a gradient output comes from."""
    stack, seen = [n], set()
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if _is_coll(a) and T.op_name(a.target) != "wait_tensor":
            return a
        if a.op == "call_function" and (a.target.__name__ == "getitem" or T.op_name(a.target) in _CHEAP
                                        or _is_coll(a)):
            stack.extend(a.all_input_nodes)
    return None


@pytest.fixture(scope="module")
def step_graph():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from parallel.auto.api import AutoParallel, fake_world
    from parallel.auto.config import PlannerConfig
    from parallel.auto.runtime.memory import _fake_dtensor
    from parallel.auto.runtime.options import RuntimeOptions
    from parallel.auto.runtime.runner import PlanRunner
    from parallel.auto.runtime.step_graph import StepGraph
    from parallel.auto.search import presets

    tok = torch.zeros(_B, _S, dtype=torch.long)
    with fake_world(_WORLD):
        mesh = init_device_mesh("cpu", (_WORLD,), mesh_dim_names=("dp",))
        with AutoParallel(_t5(), (tok, tok, tok), mesh, loss_fn=_loss,
                          planner=PlannerConfig(hardware="cpu", memory_estimate=False)) as autop:
            autop.add_input_constraints([(Shard(0),)] * 3)
            presets.fsdp(autop)  # fully sharded, gathered for compute: every gradient is reduce-scattered
            plan = autop.optimize_placement(verbose=False)
            # one bucket per block (the cap off); the default 25 MiB cap would join this tiny model's blocks
            jg = autop.graph
            runner = PlanRunner(jg, autop.candidates, plan, mesh, options=RuntimeOptions(reduce_bucket_bytes=0))
            with T.FakeTensorMode(allow_non_fake_inputs=True):
                params = [_fake_dtensor(jg.params[f].meta["val"], runner.param_placements(f), mesh)
                          for f in runner.param_names]
                buffers = [torch.empty(tuple(jg.buffers[f].meta["val"].shape)) for f in runner.buffer_names]
                inputs = [_fake_dtensor(n.meta["val"], runner.input_placements(i), mesh)
                          for i, n in enumerate(runner.input_nodes)]
                sg = StepGraph(runner, params, buffers, inputs, executable=False)
                capped = PlanRunner(jg, autop.candidates, plan, mesh, options=RuntimeOptions(reduce_bucket_bytes=_CAP))
                joined = StepGraph(capped, params, buffers, inputs, executable=False)
            names = [f for f, has in zip(runner.param_names, sg.has_grad) if has]
    return sg, names, joined


@pytest.mark.slow
def test_t5_gradient_buckets_follow_repeated_blocks(step_graph):
    from parallel.auto.trace.joint import layer_prefix

    sg, names, _ = step_graph
    outs = sg.gm.graph.output_node().args[0][len(sg.out_specs):]
    assert len(outs) == len(names)
    bucket: dict[fx.Node, set[str]] = {}
    for fqn, out in zip(names, outs):
        c = _reduction_of(out)
        if c is None:  # computed at its own placement (e.g. a small replicated bias table)
            continue
        bucket.setdefault(c, set()).add(layer_prefix(fqn) or "(outside blocks)")
    assert sum(1 for o in outs if _reduction_of(o) is not None) >= 0.9 * len(outs)
    blocks = {b for members in bucket.values() for b in members}
    assert {"encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"} <= blocks
    for c, members in bucket.items():
        assert len(members) == 1, f"{c.name} reduces the gradients of {sorted(members)} together"


def test_gradient_reductions_are_waited_for_one_bucket_behind(step_graph):
    sg, _, _ = step_graph
    nodes = list(sg.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    outs = sg.gm.graph.output_node().args[0][len(sg.out_specs):]
    reductions = sorted({_reduction_of(o) for o in outs} - {None}, key=pos.__getitem__)
    assert len(reductions) >= 5  # 4 blocks and what lies outside them
    waits = [next(u for u in c.users if T.op_name(u.target) == "wait_tensor") for c in reductions]
    for k in range(len(reductions) - 2):  # at most two reductions in flight
        assert pos[waits[k]] < pos[reductions[k + 2]], (reductions[k].name, waits[k].name)
    assert sg.overlap.reductions_bounded >= len(reductions) - 2


def _buckets(sg, names: list[str]) -> dict[fx.Node, list[str]]:
    outs = sg.gm.graph.output_node().args[0][len(sg.out_specs):]
    bucket: dict[fx.Node, list[str]] = {}
    for fqn, out in zip(names, outs):
        c = _reduction_of(out)
        if c is not None:
            bucket.setdefault(c, []).append(fqn)
    return bucket


def test_a_bucket_cap_joins_consecutive_blocks_until_the_cap(step_graph):
    sg, names, joined = step_graph
    per_block, capped = _buckets(sg, names), _buckets(joined, names)
    assert len(capped) < len(per_block)  # fewer collectives
    block_of = {f: i for i, members in enumerate(per_block.values()) for f in members}  # in the graph's order
    for members in capped.values():
        blocks = sorted({block_of[f] for f in members})
        # the per-block buckets it joins: whole ones (every member of each), next to each other
        assert sum(len(list(per_block.values())[b]) for b in blocks) == len(members)
        assert blocks == list(range(blocks[0], blocks[-1] + 1)), blocks
    sizes = [c.args[0].meta["val"].numel() * c.args[0].meta["val"].element_size() for c in capped]  # the flat buffer
    assert sum(s >= _CAP for s in sizes) >= len(sizes) - 2  # only the last bucket of each group may stay short
