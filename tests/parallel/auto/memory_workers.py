"""Helpers of the memory-estimate test (test_memory_measured.py): plans made in the parent
(fake world), then run on gloo ranks, which estimate them (on gloo, as the trainer's rank 0
does: gloo's all-gather staging counted) and measure a training step
by the allocator (parallel.measure.AllocatorPeak: every allocation of the step, from the
profiler's memory events) on top of the state alive before it (parameter shards, buffers,
AdamW states: parallel.measure.state_bytes)."""

from __future__ import annotations

import torch

GLOBAL_B, SEQ = 8, 256  # the peak in the backward (activations > the model states), yet a small step
OVERRIDES = {"n_layers": 2}


def batch(vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, vocab, (GLOBAL_B, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _model_and_inputs() -> tuple[torch.nn.Module, tuple]:
    from models import build_model

    tok = torch.zeros(GLOBAL_B, SEQ, dtype=torch.long)
    return build_model("llama3", "debug", device="meta", **OVERRIDES), (tok, tok)


def constrain(autop, kind: str) -> None:
    """DDP-, FSDP- or TP-like plans (presets), or the planner's free choice ("auto")."""
    from torch.distributed.tensor import Replicate, Shard

    from parallel.auto.search import presets

    ndim = autop.mesh.ndim
    data = (Replicate(),) if kind == "tp" else (Shard(0),) + (Replicate(),) * (ndim - 1)
    autop.add_input_constraints([data, data])
    if kind == "ddp":
        presets.ddp(autop)
    elif kind == "fsdp":
        presets.fsdp(autop)
    elif kind == "tp":
        presets.megatron(autop, ndim - 1)
    elif kind != "auto":
        raise ValueError(kind)


def runtime_options(ac, micro_batches: int = 1):
    """RuntimeOptions of an AC choice: a mode ("none", "full"), "op" (per-op SAC on every block)
    or a tuple of per-block choices (ac_blocks)."""
    from parallel.auto.runtime import RuntimeOptions

    if isinstance(ac, tuple):
        return RuntimeOptions(ac_blocks=ac, micro_batches=micro_batches)
    if ac == "op":
        return RuntimeOptions(ac_mode="selective", ac_option="op", micro_batches=micro_batches)
    return RuntimeOptions(ac_mode=ac, micro_batches=micro_batches)


# one joint-graph trace per process: it depends neither on the mesh nor on the plan, so the
# plans of a module share it (as apply_workers' plans do)
_GRAPH: list = []


def plan_and_estimate(world: int, kind: str, ac_modes: list) -> tuple[dict, dict]:
    """(plan JSON, AC choice (`runtime_options`) -> estimate JSON) on a fake world of `world` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.api import AutoParallel, fake_world, lm_loss
    from parallel.auto.config import PlannerConfig

    with fake_world(world):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model, inputs = _model_and_inputs()
        # the estimates below are the ones asserted: the plan's own (default RuntimeOptions) is skipped
        with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, graph=_GRAPH[0] if _GRAPH else None,
                          planner=PlannerConfig(hardware="cpu", time_limit=30, memory_estimate=False)) as autop:
            _GRAPH[:] = [autop.graph]
            constrain(autop, kind)
            plan = autop.optimize_placement(verbose=False)
            est = {ac: autop.estimate_memory(plan, runtime_options(ac)) for ac in ac_modes}
    return plan.to_json(), {ac: e.to_json() for ac, e in est.items()}


def measure(mesh, plan_json: dict, ac, micro_batches: int = 1) -> dict:
    """Train two steps (AdamW foreach, clipping, as the trainer does); the second is measured.
    `micro_batches` > 1: each step accumulates that many batches of the plan's shape, all but
    the last under `no_gradient_sync` (as the trainer does)."""
    import contextlib

    from parallel.auto.api import AutoParallel, lm_loss
    from parallel.auto.config import PlannerConfig
    from parallel.auto.plan import Plan
    from parallel.auto.runtime import local_shard
    from parallel.measure import AllocatorPeak, phase, state_bytes
    from trainer.optim import clip_grad_norm_

    model, inputs = _model_and_inputs()
    with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="cpu")) as autop:
        plan = Plan.from_json(plan_json)
        options = runtime_options(ac, micro_batches)
        pm = autop.apply_placement(plan, options)
        est = autop.estimate_memory(plan, options).to_json()  # on gloo: as the trainer's
    pm.to_empty(device="cpu")
    torch.manual_seed(0)
    pm.init_weights()
    runner = pm.plan_runner
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
    out = {}
    for step in range(2):
        micro = [[local_shard(x, mesh, runner.input_placements(i)) for i, x in
                  enumerate(batch(model.args.vocab_size, step * micro_batches + k))] for k in range(micro_batches)]
        opt.zero_grad(set_to_none=True)
        base = state_bytes(pm, opt)
        with AllocatorPeak() as mem:
            with phase("forward_backward"):
                for k, (lt, ll) in enumerate(micro):
                    with pm.no_gradient_sync() if k < micro_batches - 1 else contextlib.nullcontext():
                        loss = pm.forward_backward(lt, ll, grad_scale=1.0 / micro_batches)
            with phase("clip"):
                clip_grad_norm_(pm.parameters(), 1.0)
            with phase("optimizer"):
                opt.step()
        m = mem.result
        out = {"base": base, "step_peak": m.peak_bytes, "peak": base + m.peak_bytes, "phase": m.phase,
               "op": m.op, "loss": loss.item(), "estimate": est}
    return out


def worker(rank: int, world_size: int, jobs: list[tuple]) -> list[dict]:
    """`jobs`: (plan JSON, AC choice (`runtime_options`)[, micro-batches])."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return [measure(mesh, *job) for job in jobs]
