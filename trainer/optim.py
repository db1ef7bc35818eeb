"""AdamW, the warmup + decay LR schedule, and gradient clipping that is correct for
sharded (DTensor) gradients on any mix of meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from .config import LRScheduler, Optimizer


def build_optimizer(model: torch.nn.Module, opt_cfg: Optimizer) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (plain or DTensor), as ``[optimizer]`` says. Plain
    and DTensor parameters together (TP without SP leaves the norms plain) go in two groups:
    a foreach kernel takes one kind."""
    params = [p for p in model.parameters() if p.requires_grad]
    kinds = [[p for p in params if not isinstance(p, DTensor)], [p for p in params if isinstance(p, DTensor)]]
    if all(kinds):
        params = [{"params": kind} for kind in kinds]
    return torch.optim.AdamW(
        params, lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
        foreach=opt_cfg.implementation == "foreach", fused=opt_cfg.implementation == "fused" or None)


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


def build_lr_scheduler(optimizer: torch.optim.Optimizer, sched_cfg: LRScheduler, total_steps: int) -> LambdaLR:
    """LambdaLR over ``WarmupDecay``; ``decay_steps = -1`` decays over the rest of the run."""
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
    current config's schedule (through the scheduler's public state dict)."""
    n = int(state["last_epoch"])
    lrs = [base * fn(n) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    sd = scheduler.state_dict()
    sd.update({"last_epoch": n, "_step_count": n + 1, "_last_lr": lrs})
    scheduler.load_state_dict(sd)
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr


# --------------------------------------------------------------------------- clipping


def _params_by_mesh(parameters: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters with a gradient, grouped so that torch's norm and clipping can stack
    each group: DTensor gradients by mesh (EP puts the experts on another mesh than the
    rest), plain tensors together. Groups come in parameter order, the same on every
    rank, so their collectives match up."""
    groups: dict = {}
    for prm in parameters:
        g = prm.grad
        if g is not None:
            groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(prm)
    return list(groups.values())


@torch.no_grad()
def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients as if they were full tensors on one device.

    ``torch.nn.utils.get_total_norm`` per mesh group; a DTensor group's norm comes back as
    a DTensor (partial over the mesh axes the gradients are sharded on), which
    ``full_tensor`` reduces; the groups' norms are then combined. Returns a plain fp32
    scalar tensor, equal on every rank.
    """
    norms = []
    for params in _params_by_mesh(parameters):
        n = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float().cpu())
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, pp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Compute the total gradient norm (see ``total_grad_norm``) and, when
    ``max_norm > 0``, scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` with
    ``torch.nn.utils.clip_grads_with_norm_``, one call per mesh group. ``pp_group``: pipeline
    parallel, each rank holds some stages' parameters: the norms are combined over it."""
    groups = _params_by_mesh(parameters)
    flat = [p for params in groups for p in params]
    total = total_grad_norm(flat, norm_type)
    if pp_group is not None:
        total = _combine_over(total, norm_type, pp_group, flat[0].grad.device if flat else torch.device("cpu"))
    if max_norm > 0:
        for params in groups:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _combine_over(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup,
                  device: torch.device) -> torch.Tensor:
    """The norm of the gradients of all ranks of ``group`` from each rank's norm of its own."""
    t = norm.to(device)
    if math.isinf(norm_type):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.cpu()
    t = t ** norm_type
    dist.all_reduce(t, group=group)
    return (t ** (1.0 / norm_type)).cpu()


@torch.no_grad()
def follow_parameters(optimizer: torch.optim.Optimizer, moved: dict[str, tuple]) -> None:
    """Point `optimizer` at new parameters (`moved`: {fqn: (old, new)}, e.g. after a re-plan
    changed their placements) and move its state with them: every DTensor state of the same
    shape as its parameter (AdamW's exp_avg, exp_avg_sq) is redistributed to the new
    parameter's placements; scalars (step) are kept. LR schedule and step count stay."""
    new_of = {id(old): new for old, new in moved.values()}
    for group in optimizer.param_groups:
        missing = [i for i, p in enumerate(group["params"]) if id(p) not in new_of]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters were not moved (e.g. index {missing[0]})")
        group["params"] = [new_of[id(p)] for p in group["params"]]
    state = {}
    for old, new in moved.values():
        if old not in optimizer.state:
            continue
        state[new] = {k: _follow(v, old, new) for k, v in optimizer.state.pop(old).items()}
    optimizer.state.update(state)


def _follow(value, old, new):
    """One optimizer state entry of `old`, at `new`'s placements (a private copy)."""
    if not (isinstance(value, DTensor) and value.shape == old.shape):
        return value
    local = value.redistribute(new.device_mesh, new.placements).to_local()
    return DTensor.from_local(local.clone(memory_format=torch.contiguous_format), new.device_mesh,
                              new.placements, run_check=False, shape=new.shape, stride=new.stride())
