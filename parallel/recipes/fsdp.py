"""FSDP2 recipe: ``fully_shard`` every transformer block, then the root module.

Parameters become DTensors sharded on dim 0 over the data-parallel mesh; the forward
all-gathers one block at a time, the backward reduce-scatters gradients (averaged over
the mesh, which with equal tokens per rank gives the gradient of the global mean loss).
``[training] mixed_precision_param`` / ``mixed_precision_reduce`` map to FSDP2's
``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mixed_precision_policy(training_cfg) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=DTYPES[training_cfg.mixed_precision_param],
                                reduce_dtype=DTYPES[training_cfg.mixed_precision_reduce])


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no 'layers' container of blocks")
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard each block, then the root (embeddings, final norm, output). The last block
    is not resharded after forward: the backward needs it right away."""
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy,
                reshard_after_forward=reshard_after_forward)
    return model
