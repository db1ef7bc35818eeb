"""Hand-written parallelism recipes (the baseline the planner is compared against).

``apply_recipe(model, mesh, job_config)`` applies, in order: tensor/sequence parallel
(``tp``), context parallel (``cp``), expert parallel (``ep``), activation checkpointing,
``compile``, then data parallel (FSDP over ``dp_shard x cp``, HSDP with ``dp_replicate``;
``dp_replicate`` alone is DDP). Each recipe is a reusable function in its own module
(tp.py, cp.py, ep.py, fsdp.py, ddp.py).
A degree that does not fit the model, the sequence or the mesh raises :class:`RecipeError`
before anything is changed; the trainer reports it as a config error.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models import transformer_blocks
from parallel.activation_checkpoint import apply_ac
from parallel.mesh import CP, DP_REPLICATE, TP, axis_size, submesh
from parallel.precision import dtype_of, mixed_precision_policy

from .cp import apply_cp, validate_cp
from .ddp import apply_ddp, is_ddp_mesh, validate_ddp
from .ep import apply_ep, build_ep_meshes, experts_fsdp_filter, validate_ep_mesh, validate_ep_model
from .errors import RecipeError
from .fsdp import apply_fsdp, data_parallel_mesh
from .tp import apply_tp, validate_tp

__all__ = ["RecipeError", "apply_compile", "apply_recipe", "is_ddp_mesh", "validate_recipe"]


def validate_recipe(model: nn.Module, mesh: DeviceMesh, job_config: Any) -> None:
    """:class:`RecipeError` for the first degree that does not fit the model, the sequence
    or the mesh: checked up front, so a bad config fails before the model is touched."""
    tp, cp = axis_size(mesh, TP), axis_size(mesh, CP)
    ep = job_config.parallelism.degrees.expert_parallel_degree
    validate_ddp(mesh)
    if tp > 1:
        validate_tp(model.args, tp)
    if cp > 1:
        validate_cp(job_config.training.seq_len, cp)
    if ep > 1:
        validate_ep_model(model.args, ep)
        validate_ep_mesh(mesh, ep)


def apply_recipe(model: nn.Module, mesh: DeviceMesh, job_config: Any, *, ddp: bool = True) -> nn.Module:
    """Parallelize ``model`` (materialised or on meta) on ``mesh`` per ``job_config``.
    ``ddp=False`` leaves a DDP mesh's model unreplicated (the dry run simulates the reducer,
    :func:`parallel.recipes.ddp.simulate_ddp`: DDP cannot be built on fake tensors)."""
    par, training = job_config.parallelism, job_config.training
    validate_recipe(model, mesh, job_config)
    if axis_size(mesh, TP) > 1:
        apply_tp(model, mesh[TP], sequence_parallel=par.degrees.enable_sequence_parallel)
    if axis_size(mesh, CP) > 1:
        apply_cp(model, mesh, CP)
    experts_dp = None
    if par.degrees.expert_parallel_degree > 1:
        experts_dp, ep_mesh = build_ep_meshes(mesh, par.degrees.expert_parallel_degree)
        apply_ep(model, ep_mesh)
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.resolved("manual"), ac.selective_ac_option)
    if training.compile:
        apply_compile(model)
    if is_ddp_mesh(mesh):
        if not ddp:
            return model
        return apply_ddp(model, submesh(mesh, DP_REPLICATE), dtype_of(training.mixed_precision_reduce))
    dp = data_parallel_mesh(mesh)
    if dp is None or dp.size() == 1:
        return model
    pre_shard = experts_fsdp_filter(experts_dp, dp.size()) if experts_dp is not None else None
    policy = mixed_precision_policy(training.mixed_precision_param, training.mixed_precision_reduce)
    return apply_fsdp(model, dp, policy, pre_shard=pre_shard)


def apply_compile(model: nn.Module) -> nn.Module:
    """``compile`` each transformer block in place (after TP/AC, before FSDP), as TorchTitan
    does: repeated blocks share one compiled graph. ``nn.Module.compile`` keeps the module
    objects, so parameter names (and checkpoints) are the same with and without it."""
    for block in transformer_blocks(model):
        block.compile(fullgraph=False)
    return model
