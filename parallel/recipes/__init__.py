"""Hand-written parallelism recipes (the baseline the planner is compared against).

``apply_recipe(model, mesh, job_config)`` applies, in order: tensor/sequence parallel
(``tp``), context parallel (``cp``), expert parallel (``ep``), activation checkpointing,
``compile``, then data parallel (FSDP over ``dp_shard x cp``, HSDP with ``dp_replicate``;
``dp_replicate`` alone is DDP). Each recipe is a reusable function in its own module
(tp.py, cp.py, ep.py, fsdp.py, ddp.py). ``apply_pipeline`` (pp.py) splits the model into
pipeline stages over the ``pp`` axis first and applies the rest to each stage module.
A degree that does not fit the model, the sequence or the mesh raises :class:`RecipeError`
before anything is changed; the trainer reports it as a config error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models import transformer_blocks
from parallel.activation_checkpoint import apply_ac
from parallel.mesh import CP, DP_REPLICATE, PP, TP, axis_size, submesh
from parallel.precision import dtype_of, mixed_precision_policy

from .cp import apply_cp, validate_cp
from .ddp import apply_ddp, is_ddp_mesh, validate_ddp
from .ep import apply_ep, build_ep_meshes, experts_fsdp_filter, validate_ep_mesh, validate_ep_model
from .errors import RecipeError
from .fsdp import apply_fsdp, data_parallel_mesh
from .pp import Pipeline, apply_pp, check_composition
from .tp import apply_tp, validate_tp

__all__ = ["Pipeline", "RecipeError", "apply_compile", "apply_pipeline", "apply_recipe", "is_ddp_mesh",
           "validate_pipeline", "validate_recipe"]


def validate_recipe(model: nn.Module, mesh: DeviceMesh, job_config: Any) -> None:
    """:class:`RecipeError` for the first degree that does not fit the model, the sequence
    or the mesh: checked up front, so a bad config fails before the model is touched."""
    tp, cp = axis_size(mesh, TP), axis_size(mesh, CP)
    ep = job_config.parallelism.degrees.expert_parallel_degree
    validate_pipeline(mesh, job_config)
    validate_ddp(mesh)
    if tp > 1:
        validate_tp(model.args, tp)
    if cp > 1:
        validate_cp(job_config.training.seq_len, cp)
    if ep > 1:
        validate_ep_model(model.args, ep)
        validate_ep_mesh(mesh, ep)


def validate_pipeline(mesh: DeviceMesh, job_config: Any) -> None:
    """:class:`RecipeError` for what a pipeline (a ``pp`` axis) does not compose with
    (:func:`parallel.recipes.pp.check_composition`)."""
    deg = job_config.parallelism.degrees
    check_composition(axis_size(mesh, PP), deg.data_parallel_replicate_degree, is_ddp_mesh(mesh))


def apply_pipeline(model: nn.Module, mesh: DeviceMesh, job_config: Any, device: torch.device,
                   loss_fn: Callable) -> Pipeline:
    """Pipeline parallel on the ``pp`` axis: this rank's stages of ``model``, each parallelized
    by :func:`apply_recipe` on the other axes, under the job's schedule (:mod:`parallel.recipes.pp`).
    TP runs without loss parallel (the schedule computes the last stage's loss) and without
    sequence parallel (a stage's input is the whole sequence: its RoPE tables are cut to it)."""
    validate_pipeline(mesh, job_config)
    return apply_pp(model, mesh, job_config.parallelism.pipeline, job_config.training.local_batch_size, device,
                    loss_fn, lambda part: apply_recipe(part, mesh, job_config, loss_parallel=False,
                                                       sequence_parallel=False))


def apply_recipe(model: nn.Module, mesh: DeviceMesh, job_config: Any, *, ddp: bool = True,
                 loss_parallel: bool = True, sequence_parallel: bool = True) -> nn.Module:
    """Parallelize ``model`` (materialised or on meta) on ``mesh`` per ``job_config``.
    ``ddp=False`` leaves a DDP mesh's model unreplicated (the dry run simulates the reducer,
    :func:`parallel.recipes.ddp.simulate_ddp`: DDP cannot be built on fake tensors).
    ``loss_parallel=False``: TP leaves the logits whole; ``sequence_parallel=False``: TP
    without SP whatever ``enable_sequence_parallel`` says (both: a pipeline stage's)."""
    par, training = job_config.parallelism, job_config.training
    validate_recipe(model, mesh, job_config)
    if axis_size(mesh, TP) > 1:
        apply_tp(model, mesh[TP], sequence_parallel=par.degrees.enable_sequence_parallel and sequence_parallel,
                 loss_parallel=loss_parallel)
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
