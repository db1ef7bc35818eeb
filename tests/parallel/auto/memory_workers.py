"""Helpers of the memory-estimate test (test_memory_measured.py): plans and their estimates
made in the parent (fake world), then run on gloo ranks where the live tensor bytes of a
training step (parameters, buffers, AdamW states and the step's peak) are measured."""

from __future__ import annotations

import torch

GLOBAL_B, SEQ = 8, 128  # activations of the same order as the model states: the estimate's hard part
OVERRIDES = {"n_layers": 1}


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

    from parallel.auto import presets

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


# one joint-graph trace per process: it depends neither on the mesh nor on the plan, so the
# plans of a module share it (as apply_workers' plans do)
_GRAPH: list = []


def plan_and_estimate(world: int, kind: str, ac_modes: list[str]) -> tuple[dict, dict]:
    """(plan JSON, AC mode -> estimated peak bytes) on a fake world of `world` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.api import AutoParallel, fake_world, lm_loss
    from parallel.auto.config import PlannerConfig
    from parallel.auto.runtime import RuntimeOptions

    with fake_world(world):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model, inputs = _model_and_inputs()
        # the estimates below are the ones asserted: the plan's own (default RuntimeOptions) is skipped
        with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, graph=_GRAPH[0] if _GRAPH else None,
                          planner=PlannerConfig(hardware="cpu", time_limit=30, memory_estimate=False)) as autop:
            _GRAPH[:] = [autop.graph]
            constrain(autop, kind)
            plan = autop.optimize_placement(verbose=False)
            est = {ac: autop.estimate_memory(plan, RuntimeOptions(ac_mode=ac)) for ac in ac_modes}
    return plan.to_json(), {ac: e.to_json() for ac, e in est.items()}


def _state_bytes(pm: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the storages alive between steps: parameter shards, buffers, optimizer states."""
    from torch.distributed.tensor import DTensor

    from parallel import _torch as T

    seen: dict[int, int] = {}
    tensors = [p.to_local() if isinstance(p, DTensor) else p for p in pm.parameters()] + list(pm.buffers())
    for state in opt.state.values():
        tensors += [v.to_local() if isinstance(v, DTensor) else v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        seen[T.storage_id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def measure(mesh, plan_json: dict, ac: str) -> dict:
    """Train two steps (AdamW foreach, clipping, as the trainer does); the second is measured."""
    from parallel.auto.api import AutoParallel, lm_loss
    from parallel.auto.config import PlannerConfig
    from parallel.auto.plan import Plan
    from parallel.auto.runtime import RuntimeOptions, local_shard
    from parallel.measure import MemoryTracker
    from trainer.optim import clip_grad_norm_

    model, inputs = _model_and_inputs()
    with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="cpu")) as autop:
        pm = autop.apply_placement(Plan.from_json(plan_json), RuntimeOptions(ac_mode=ac))
    pm.to_empty(device="cpu")
    torch.manual_seed(0)
    pm.init_weights()
    runner = pm.plan_runner
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
    out = {}
    for step in range(2):
        tok, lab = batch(model.args.vocab_size, step)
        lt, ll = (local_shard(x, mesh, runner.input_placements(i)) for i, x in enumerate((tok, lab)))
        opt.zero_grad(set_to_none=True)
        base = _state_bytes(pm, opt)
        tracker = MemoryTracker()
        tracker.exclude([list(pm.parameters()), list(pm.buffers()), [lt, ll],
                         [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]])
        with tracker:
            loss = pm.forward_backward(lt, ll)
            clip_grad_norm_(pm.parameters(), 1.0)
            opt.step()
        out = {"base": base, "step_peak": tracker.peak, "peak": base + tracker.peak, "loss": loss.item()}
    return out


def worker(rank: int, world_size: int, jobs: list[tuple[dict, str]]) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return [measure(mesh, plan, ac) for plan, ac in jobs]
