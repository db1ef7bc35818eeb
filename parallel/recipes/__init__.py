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

    if tp > 1:
        raise _not_yet("tensor parallel", "tensor_parallel_degree", tp, "tp.py")
    if cp > 1:
        raise _not_yet("context parallel", "context_parallel_degree", cp, "cp.py")
    if par.expert_parallel_degree > 1:
        raise _not_yet("expert parallel", "expert_parallel_degree",
                       par.expert_parallel_degree, "ep.py")

    if job_config.activation_checkpoint.mode != "none":
        try:
            from trainer.activation_checkpoint import apply_ac
        except ImportError as e:
            raise NotImplementedError(
                f"activation checkpointing ([activation_checkpoint] mode = "
                f"{job_config.activation_checkpoint.mode!r}) is not available yet ({e}); "
                f'set mode = "none"') from None
        model = apply_ac(model, job_config.activation_checkpoint) or model

    if dp_rep > 1:
        raise _not_yet("HSDP / replicated data parallel", "data_parallel_replicate_degree",
                       dp_rep, "hsdp.py")
    if dp_shard > 1:
        from .fsdp import apply_fsdp, mixed_precision_policy
        model = apply_fsdp(model, mesh["dp_shard"], mixed_precision_policy(job_config.training))
    return model
