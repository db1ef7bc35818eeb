"""A model nobody here wrote (a `transformers` T5: encoder and decoder stacks whose blocks
share their indices) planned fully sharded on a fake world: every gradient reduction
bucket holds ONE repeated block (encoder block i and decoder block i never share one),
and each reduction is waited for once the next has started, not at the end of the step."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from parallel import _torch as T

tf = pytest.importorskip("transformers")

_WORLD, _B, _S = 2, 4, 16
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

    from parallel.auto import presets
    from parallel.auto.api import AutoParallel, fake_world
    from parallel.auto.config import PlannerConfig
    from parallel.auto.runtime.memory import _fake_dtensor
    from parallel.auto.runtime.runner import PlanRunner
    from parallel.auto.runtime.step_graph import StepGraph

    tok = torch.zeros(_B, _S, dtype=torch.long)
    with fake_world(_WORLD):
        mesh = init_device_mesh("cpu", (_WORLD,), mesh_dim_names=("dp",))
        with AutoParallel(_t5(), (tok, tok, tok), mesh, loss_fn=_loss,
                          planner=PlannerConfig(hardware="cpu", memory_estimate=False)) as autop:
            autop.add_input_constraints([(Shard(0),)] * 3)
            presets.fsdp(autop)  # fully sharded, gathered for compute: every gradient is reduce-scattered
            plan = autop.optimize_placement(verbose=False)
            jg, runner = autop.graph, PlanRunner(autop.graph, autop.candidates, plan, mesh)
            with T.FakeTensorMode(allow_non_fake_inputs=True):
                params = [_fake_dtensor(jg.params[f].meta["val"], runner.param_placements(f), mesh)
                          for f in runner.param_names]
                buffers = [torch.empty(tuple(jg.buffers[f].meta["val"].shape)) for f in runner.buffer_names]
                inputs = [_fake_dtensor(n.meta["val"], runner.input_placements(i), mesh)
                          for i, n in enumerate(runner.input_nodes)]
                sg = StepGraph(runner, params, buffers, inputs, executable=False)
            names = [f for f, has in zip(runner.param_names, sg.has_grad) if has]
    return sg, names


def test_t5_gradient_buckets_follow_repeated_blocks(step_graph):
    from parallel.auto.trace import layer_prefix

    sg, names = step_graph
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
    sg, _ = step_graph
    nodes = list(sg.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    outs = sg.gm.graph.output_node().args[0][len(sg.out_specs):]
    reductions = sorted({_reduction_of(o) for o in outs} - {None}, key=pos.__getitem__)
    assert len(reductions) >= 5  # 4 blocks and what lies outside them
    waits = [next(u for u in c.users if T.op_name(u.target) == "wait_tensor") for c in reductions]
    for k in range(len(reductions) - 2):  # at most two reductions in flight
        assert pos[waits[k]] < pos[reductions[k + 2]], (reductions[k].name, waits[k].name)
    assert sg.overlap.reductions_bounded >= len(reductions) - 2
