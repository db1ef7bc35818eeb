"""Shared loop for recipe numerics tests: same model, data and optimizer on 1 rank or N ranks.

``run_steps(spec)`` builds the debug model (seed 0), applies the recipes named in ``spec``
on a gloo mesh when ``spec["mesh"]`` is set, trains ``steps`` AdamW steps on a fixed
global batch and returns the global mean loss per step and the full (gathered)
gradients of step 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from models import build_model, cross_entropy_loss
from parallel.mesh import CP, dp_rank_and_degree
from parallel.recipes.cp import cp_shard_batch
from parallel.recipes.tp import loss_parallel_context, loss_value

GLOBAL_BATCH, SEQ = 4, 32


def batch(step: int, vocab: int):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _full(g):
    return g.full_tensor() if isinstance(g, DTensor) else g


def build(spec):
    torch.manual_seed(0)
    # the debug flavor with 2 layers (the 2 shared cores): same code paths, half the time
    return build_model(spec.get("model", "llama3"), "debug", device="cpu",
                       **spec.get("overrides", {"n_layers": 2}))


def run_steps(spec) -> dict:
    model = build(spec)
    mesh = None
    pos_fn = None
    dp_rank, dp_size = 0, 1
    if spec.get("mesh"):
        shape, names = spec["mesh"]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = spec["apply"](model, mesh)
        dp_rank, dp_size = dp_rank_and_degree(mesh)  # row-major over the data axes
        if CP in names:
            pos_fn = lambda t, labels: cp_shard_batch(t, labels, mesh, CP)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-3), foreach=False)
    losses, grads = [], {}
    steps = spec.get("steps", 5)
    for step in range(steps):
        tok, lab = batch(step, model.args.vocab_size)
        b = GLOBAL_BATCH // dp_size
        tok, lab = tok[dp_rank * b:(dp_rank + 1) * b], lab[dp_rank * b:(dp_rank + 1) * b]
        pos = None
        if pos_fn is not None:
            tok, lab, pos = pos_fn(tok, lab)
        with loss_parallel_context(model):
            loss = cross_entropy_loss(model(tok, pos), lab)
            loss.backward()
        lv = loss_value(loss).detach().clone()
        if dist.is_initialized():
            dist.all_reduce(lv)
            lv /= dist.get_world_size()
        losses.append(lv.item())
        if step == 0:
            grads[step] = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def worker(rank, world, spec):
    out = run_steps(spec)
    return out if rank == 0 else {"losses": out["losses"]}


def compare(ref: dict, got: dict, tol: float = 1e-4) -> dict:
    loss_diff = max(abs(a - b) for a, b in zip(ref["losses"], got["losses"]))
    grad_diff = grad_rel = 0.0
    for step, gs in ref["grads"].items():
        assert set(gs) == set(got["grads"][step]), "parameter names differ"
        for n, g in gs.items():
            d = (g - got["grads"][step][n]).abs().max().item()
            grad_diff = max(grad_diff, d)
            # relative to the parameter's largest gradient: catches scale errors in tiny grads
            grad_rel = max(grad_rel, d / max(g.abs().max().item(), 1e-12))
    return {"loss": loss_diff, "grad": grad_diff, "grad_rel": grad_rel}
