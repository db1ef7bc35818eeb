"""Models from torch itself trained with a plan on 2 gloo ranks: losses and gradients equal
one rank's (fp32, rtol 1e-4). TransformerEncoder with a key padding mask (per-device forward
and backward graphs under autograd); the T5-style relative bias whose bucket table is a
lifted constant (get_attr) every rank must hold, and nn.Transformer, whose causal-mask check
was folded at trace time (both as one per-device training-step graph, the trainer's way);
and a model of factory ops, a torch.tensor literal and copies."""

import pytest
import torch
import torch_models as tm
from apply_workers import run_distributed

NAMES = ("padded_encoder", "relative_bias", "seq2seq", "factory_ops")
STEP_GRAPH = ("relative_bias", "seq2seq")
STEPS, LR = 3, 1e-2


def _plans() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from parallel.auto.api import AutoParallel, fake_world
    from parallel.auto.config import PlannerConfig

    out = {}
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for name in NAMES:
            with AutoParallel(tm.build(name), lambda name=name: tm.inputs(name), mesh,
                              planner=PlannerConfig(hardware="cpu")) as autop:
                autop.add_input_constraints([(Shard(0),)] * len(tm.inputs(name)))  # batch-sharded data, masks too
                out[name] = autop.optimize_placement(verbose=False).to_json()
    return out


def _train(model, step_fn) -> dict:
    """`step_fn(step)`: forward and backward of one step; returns the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = step_fn(step)
        if step == 0:
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def _worker(rank, world_size, plans):
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.api import AutoParallel
    from parallel.auto.config import PlannerConfig
    from parallel.auto.plan import Plan
    from parallel.auto.runtime import local_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    out = {}
    for name in NAMES:
        with AutoParallel(tm.build(name), lambda name=name: tm.inputs(name), mesh,
                          planner=PlannerConfig(hardware="cpu")) as autop:
            pm = autop.apply_placement(Plan.from_json(plans[name]))
        runner = pm.plan_runner

        def step(i, pm=pm, runner=runner, name=name):
            xs = [local_shard(x, mesh, runner.input_placements(k)) for k, x in enumerate(tm.inputs(name, i))]
            if name in STEP_GRAPH:
                return pm.forward_backward(*xs)
            return _backward(pm(*xs))

        out[name] = _train(pm, step)
        out[name]["stats"] = dict(runner.stats)
        out[name]["sharded_params"] = sum(any(not p.is_replicate() for p in w.placements) for w in pm.parameters())
        out[name]["input0"] = str(runner.input_placements(0))
    return out


def _backward(loss):
    loss.backward()
    return loss


@pytest.mark.slow
def test_torch_models_on_two_ranks_equal_one_rank():
    plans = _plans()
    results = run_distributed(_worker, 2, plans, timeout=400)
    for name in NAMES:
        model = tm.build(name)
        ref = _train(model, lambda i, model=model, name=name: _backward(model(*tm.inputs(name, i))))
        for out in results:
            got = out[name]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)
            for n, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-6, msg=f"{name}: grad of {n}")
            assert got["sharded_params"] > 0 and got["input0"] == "(Shard(dim=0),)", name  # FSDP-like, not replicated
            stats = got["stats"]
            assert stats.get("deviations", 0) == 0 and stats.get("interpreted_steps", 0) == 0, (name, stats)
            assert stats["step_graph_steps" if name in STEP_GRAPH else "local_graph_steps"] == STEPS, (name, stats)
        print(f"{name}: losses {['%.5f' % v for v in ref['losses']]} equal on 2 ranks "
              f"({results[0][name]['sharded_params']} sharded parameters, input 0 {results[0][name]['input0']})")
