"""Hand-written parallelism recipes (the baseline the planner is compared against).

``apply_recipe(model, mesh, job_config)`` applies, in order: tensor/sequence parallel
(``tp``), context parallel (``cp``), expert parallel (``ep``), activation checkpointing,
then data parallel (FSDP over ``dp_shard``, HSDP over ``dp_replicate x dp_shard``).
Each recipe is a reusable function in its own module (fsdp.py, tp.py, cp.py, ep.py,
hsdp.py). A recipe that is not wired in yet raises ``NotImplementedError`` naming the
degree and the module to write.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh


class RecipeError(ValueError):
    """A parallelism degree that does not fit the model or the job (the message names the
    `[parallelism]` key and its value); the trainer reports it as a config error."""


def _axis(mesh: DeviceMesh, name: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.shape[names.index(name)] if name in names else 1


def _not_yet(what: str, key: str, value: int, module: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} is not implemented in the manual recipes yet ([parallelism] {key} = "
        f"{value}; recipe module parallel/recipes/{module}). Set it to 1, or use "
        f'[parallelism] mode = "auto".')


def apply_recipe(model: nn.Module, mesh: DeviceMesh, job_config) -> nn.Module:
    """Parallelize ``model`` (materialised or on meta) on ``mesh`` per ``job_config``."""
    par = job_config.parallelism
    tp, cp = _axis(mesh, "tp"), _axis(mesh, "cp")
    dp_rep, dp_shard = _axis(mesh, "dp_replicate"), _axis(mesh, "dp_shard")

    # recipes helper: TP(+SP) -> CP -> EP, validated as config errors first
    ep = par.expert_parallel_degree
    experts_filter = None
    _validate_recipe(model, job_config, tp, cp, ep)
    if tp > 1:
        from .tp import apply_tp
        apply_tp(model, mesh["tp"], sequence_parallel=par.enable_sequence_parallel)
    if cp > 1:
        from .cp import apply_cp
        apply_cp(model, mesh, "cp")
    if ep > 1:
        from .ep import apply_ep, build_ep_meshes, experts_fsdp_filter
        experts_dp, ep_mesh = build_ep_meshes(mesh, ep)
        apply_ep(model, ep_mesh)

    if job_config.activation_checkpoint.mode != "none":
        try:
            from parallel.activation_checkpoint import apply_ac
        except ImportError as e:
            raise NotImplementedError(
                f"activation checkpointing ([activation_checkpoint] mode = "
                f"{job_config.activation_checkpoint.mode!r}) is not available yet ({e}); "
                f'set mode = "none"') from None
        model = apply_ac(model, job_config.activation_checkpoint) or model
    if job_config.training.compile:
        apply_compile(model)

    if dp_rep > 1 or cp > 1 or ep > 1:  # HSDP, and FSDP over dp_shard x cp (recipes helper)
        from .hsdp import apply_hsdp, data_parallel_mesh
        dp = data_parallel_mesh(mesh)
        if ep > 1:
            experts_filter = experts_fsdp_filter(experts_dp, dp.size())
        return apply_hsdp(model, dp, param_dtype=job_config.training.mixed_precision_param,
                          reduce_dtype=job_config.training.mixed_precision_reduce,
                          module_filter=experts_filter)
    if dp_shard > 1:
        from .fsdp import apply_fsdp, mixed_precision_policy
        model = apply_fsdp(model, mesh["dp_shard"], mixed_precision_policy(job_config.training))
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """``torch.compile`` each transformer block in place (after TP/AC, before FSDP), as
    TorchTitan does: repeated blocks share one compiled graph."""
    import torch
    from .fsdp import transformer_blocks
    layers = model.layers
    for i, block in enumerate(transformer_blocks(model)):
        compiled = torch.compile(block, fullgraph=False)
        if isinstance(layers, nn.ModuleDict):
            layers[list(layers.keys())[i]] = compiled
        else:
            layers[i] = compiled
    return model


def _validate_recipe(model: nn.Module, job_config, tp: int, cp: int, ep: int) -> None:
    """Degrees that do not fit the model or the sequence -> ConfigError naming the key."""
    from trainer.config import ConfigError
    checks = []
    if tp > 1:
        from .tp import validate_tp
        checks.append(("tensor_parallel_degree", tp, lambda: validate_tp(model.args, tp)))
    if cp > 1:
        from .cp import validate_cp
        checks.append(("context_parallel_degree", cp,
                       lambda: validate_cp(job_config.training.seq_len, cp)))
    if ep > 1:
        from .ep import validate_ep_model
        checks.append(("expert_parallel_degree", ep, lambda: validate_ep_model(model.args, ep)))
        if job_config.parallelism.data_parallel_replicate_degree > 1:
            def _no_hsdp():
                raise ValueError("expert parallel with data_parallel_replicate_degree > 1 (HSDP) "
                                 "is not supported by the manual recipes; use "
                                 "data_parallel_shard_degree instead")
            checks.append(("expert_parallel_degree", ep, _no_hsdp))
    for key, value, check in checks:
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{job_config.source}: 'parallelism.{key}' = {value}: {e}") from None
