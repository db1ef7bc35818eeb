"""Helpers of the plan-materialisation tests (test_apply*.py): plans made once in the
parent (fake world), replayed and run on gloo ranks, compared with a 1-rank run."""

from __future__ import annotations

import contextlib

import torch
from dist_utils import run_distributed  # noqa: F401

GLOBAL_B, SEQ = 4, 16
OVERRIDES = {"n_layers": 2}
LR = 1e-3


def batch(vocab: int, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (GLOBAL_B, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def build(name: str, device: str = "meta"):
    from models import build_model

    if device != "meta":
        torch.manual_seed(0)
    return build_model(name, "debug", device=device, **OVERRIDES)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def reference(name: str, steps: int) -> dict:
    """1 rank: losses per step and the step-0 gradients."""
    return train_reference(build(name, "cpu"), steps)


def train_reference(model, steps: int) -> dict:
    """Train `model` (plain, 1 rank) on the shared batches: losses per step, step-0 gradients."""
    from models import cross_entropy_loss

    opt = _optimizer(model.parameters())
    losses, grads = [], {}
    for step in range(steps):
        tok, lab = batch(model.args.vocab_size, step)
        opt.zero_grad()
        loss = cross_entropy_loss(model(tok), lab)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def add_constraints(autop, kind: str, mesh_ndim: int) -> None:
    """Constraint sets that force the plan into a DDP-, FSDP- or TP-like shape (presets)."""
    from torch.distributed.tensor import Replicate, Shard

    from parallel.auto.search import presets

    if kind == "default":
        return
    data = (Shard(0),) + (Replicate(),) * (mesh_ndim - 1)
    if kind == "tp" and mesh_ndim == 1:  # pure TP: every rank sees the whole batch
        data = (Replicate(),)
    autop.add_input_constraints([data, data])
    if kind == "ddp":  # replicated parameters, batch-sharded data: gradient all-reduce
        presets.ddp(autop)
    elif kind == "fsdp":  # batch-sharded data, default (fully sharded) parameter budget
        pass
    elif kind == "fsdp_strict":  # FSDP exactly: every forward matmul/embedding on a gathered weight
        presets.fsdp(autop)
    elif kind == "tp":  # projections column/row sharded on the last (tp) axis; 2-D: FSDP on dp
        presets.megatron(autop, mesh_ndim - 1, fsdp_other_axes=mesh_ndim > 1)
    else:
        raise ValueError(kind)


def _inputs(name: str):
    model = build(name)
    tok = torch.zeros(GLOBAL_B, SEQ, dtype=torch.long)
    return model, (tok, tok)


# one joint-graph trace per model and process: the trace depends neither on the mesh nor on
# the plan, so the plans and replays of a module share it (as a sweep does, trainer/sweep_point.py)
_GRAPHS: dict[str, object] = {}


@contextlib.contextmanager
def _planner(name: str, mesh, **settings):
    """AutoParallel (entered) for a fresh meta `name` model on `mesh`, on this process's trace of it;
    `settings`: PlannerConfig fields."""
    from parallel.auto.api import AutoParallel, lm_loss
    from parallel.auto.config import PlannerConfig

    model, inputs = _inputs(name)
    with AutoParallel(model, inputs, mesh, loss_fn=lm_loss, graph=_GRAPHS.get(name),
                      planner=PlannerConfig(**settings)) as autop:
        _GRAPHS[name] = autop.graph
        yield autop


def make_plans(jobs, shape, names, time_limit: float = 15.0, solver: str = "auto",
               hardware: str = "cpu") -> list[dict]:
    """Plan each (model, kind) of `jobs` on one fake world and mesh in this process (the
    plans share its trace and strategy enumeration); returns the plans' JSON."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.api import PlanningError, fake_world

    ws = 1
    for s in shape:
        ws *= s
    out = []
    with fake_world(ws):
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        for name, kind in jobs:
            for attempt in range(3):  # a short time limit may end before any feasible point
                with _planner(name, mesh, hardware=hardware, solver=solver, time_limit=time_limit * 2**attempt,
                              memory_estimate=False) as autop:  # numerics tests: the peak is not asserted
                    add_constraints(autop, kind, len(shape))
                    try:
                        plan = autop.optimize_placement(verbose=False)
                        break
                    except PlanningError as e:
                        if "found no solution" not in str(e) or attempt == 2:
                            raise
            out.append(plan.to_json())
    return out


def run_job(mesh, job: dict) -> dict:
    """Replay a plan on this rank, train `steps` steps on local shards, gather results."""
    from parallel.auto.plan import Plan
    from parallel.auto.runtime import local_shard

    with _planner(job["model"], mesh, hardware="cpu") as autop:
        pm = autop.apply_placement(Plan.from_json(job["plan"]), job.get("options"))  # RuntimeOptions
        model = autop.model
    pm.to_empty(device="cpu")
    torch.manual_seed(0)
    pm.init_weights()
    runner = pm.plan_runner
    opt = _optimizer(pm.parameters())
    losses, grads = [], {}
    for step in range(job["steps"]):
        tok, lab = batch(model.args.vocab_size, step)
        lt = local_shard(tok, mesh, runner.input_placements(0))
        ll = local_shard(lab, mesh, runner.input_placements(1))
        opt.zero_grad()
        loss = pm(lt, ll)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "deviations": runner.stats["deviations"],
            "local_graphs": bool(runner.local_graphs_cache), "stats": dict(runner.stats),
            "block_copies": dict(runner.block_copy_counts), "recomputed": runner.recomputed,
            "placements": {n: tuple(p.placements) for n, p in pm.named_parameters()}}


def worker(rank: int, world_size: int, shape, names, jobs: list[dict]) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    return [run_job(mesh, job) for job in jobs]


def compare(out: dict, ref: dict) -> tuple[float, float, float]:
    """(max abs grad diff, max rel grad diff (vs the grad's max), max loss diff)."""
    abs_d = rel_d = 0.0
    for n, g in ref["grads"].items():
        d = (out["grads"][n] - g).abs().max().item()
        abs_d = max(abs_d, d)
        rel_d = max(rel_d, d / max(g.abs().max().item(), 1e-30))
    n = len(out["losses"])
    loss_d = max(abs(a - b) for a, b in zip(out["losses"], ref["losses"][:n]))
    return abs_d, rel_d, loss_d


def grads_close(out: dict, ref: dict, rtol: float = 1e-4, atol: float = 1e-6) -> list[str]:
    bad = []
    for n, g in ref["grads"].items():
        if not torch.allclose(out["grads"][n], g, rtol=rtol, atol=atol):
            bad.append(n)
    return bad


def worker_with_layers(rank: int, world_size: int, shape, names, jobs: list[dict], n_layers: int) -> list[dict]:
    """`worker` for models of `n_layers` layers (the plans were made for that depth)."""
    OVERRIDES["n_layers"] = n_layers
    _GRAPHS.clear()
    return worker(rank, world_size, shape, names, jobs)
