"""AdamW, the warmup + decay LR schedule, and gradient clipping that is correct for
sharded (DTensor) gradients on any mix of meshes."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.optim.lr_scheduler import LambdaLR

from parallel import _torch as T


def build_optimizer(model: torch.nn.Module, opt_cfg) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
        foreach=opt_cfg.implementation == "foreach")


class WarmupDecay:
    """lr factor: linear warmup from 1/(warmup+1) to 1 over ``warmup_steps``, then linear
    or cosine decay to ``min_lr_factor`` over ``decay_steps`` (constant with "none").

    A picklable callable, so LambdaLR's state_dict stores it by value. ``step`` is the
    number of optimizer steps already taken (LambdaLR's ``last_epoch``)."""

    def __init__(self, warmup_steps: int, decay_steps: int, decay: str, min_lr_factor: float):
        self.warmup_steps = warmup_steps
        self.decay_steps = max(1, decay_steps)
        self.decay = decay
        self.min_lr_factor = min_lr_factor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "none":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        if self.decay == "linear":
            shape = 1.0 - progress
        else:  # cosine
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * shape


def build_lr_scheduler(optimizer, sched_cfg, total_steps: int) -> LambdaLR:
    decay_steps = sched_cfg.decay_steps
    if decay_steps < 0:
        decay_steps = total_steps - sched_cfg.warmup_steps
    fn = WarmupDecay(sched_cfg.warmup_steps, decay_steps, sched_cfg.decay,
                     sched_cfg.min_lr_factor)
    return LambdaLR(optimizer, fn)


def lr_schedule_state(scheduler: LambdaLR) -> dict:
    """What a checkpoint keeps of the schedule: its position only. The shape (warmup,
    decay, steps) always comes from the config of the run that resumes."""
    return {"last_epoch": int(scheduler.last_epoch)}


def restore_lr_schedule(scheduler: LambdaLR, state: dict) -> None:
    """Move ``scheduler`` to the saved position and set the optimizer's lrs from the
    current config's schedule."""
    n = int(state["last_epoch"])
    scheduler.last_epoch = n
    scheduler._step_count = n + 1
    lrs = [base * fn(n) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


# --------------------------------------------------------------------------- clipping


def _shard_groups(g: DTensor) -> tuple:
    """Mesh dims over which this DTensor's local pieces must be summed (Shard dims)."""
    return tuple(i for i, p in enumerate(g.placements) if p.is_shard())


def _local_norms(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    """sum |t|^p (or max |t| for p = inf) over a list of local tensors, fp32 scalar."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([n.float().cpu() for n in T.foreach_norm(tensors, p)])
    return norms.max() if math.isinf(p) else (norms ** p).sum()


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients as if they were full tensors on one device.

    Plain tensors count as they are. For a DTensor, each rank's local shard contributes
    its local sum of |g|^p, which is summed over exactly the mesh dims on which the
    DTensor is sharded (never over replicated dims, which would double count). Partial
    gradients are reduced first. Gradients may live on different meshes (FSDP + TP + EP).
    Returns a plain fp32 scalar tensor, equal on every rank.
    """
    p = float(norm_type)
    is_inf = math.isinf(p)
    plain: list[torch.Tensor] = []
    # (mesh id, shard dims) -> (mesh, shard dims, [local tensors]); insertion order is the
    # parameter order, the same on every rank, so the collectives below match up.
    groups: dict = {}
    for prm in parameters:
        g = prm.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(isinstance(pl, Partial) for pl in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial)
                                                   else pl for pl in g.placements])
            dims = _shard_groups(g)
            key = (id(g.device_mesh), dims)
            groups.setdefault(key, (g.device_mesh, dims, []))[2].append(g.to_local())
        else:
            plain.append(g)
    total = _local_norms(plain, p)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for mesh, dims, locals_ in groups.values():
        acc = _local_norms(locals_, p)
        for d in dims:
            t = acc.to(mesh.device_type) if mesh.device_type != "cpu" else acc
            dist.all_reduce(t, op=op, group=mesh.get_group(d))
            acc = t.cpu()
        total = torch.maximum(total, acc) if is_inf else total + acc
    return total if is_inf else total ** (1.0 / p)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Compute the total gradient norm (see ``total_grad_norm``) and, when
    ``max_norm > 0``, scale every gradient by ``min(1, max_norm / (norm + 1e-6))``."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_dev: dict = {}
        for prm in params:
            g = prm.grad
            local = g.to_local() if isinstance(g, DTensor) else g
            by_dev.setdefault((local.device, local.dtype), []).append(local)
        for (dev, dtype), ts in by_dev.items():
            T.foreach_mul_(ts, coef.to(dev, dtype))
    return total
