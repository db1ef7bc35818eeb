"""FSDP2 / HSDP recipe: ``fully_shard`` every transformer block, then the root module.
(``dp_replicate`` without a shard or cp axis is DDP: :mod:`parallel.recipes.ddp`.)

One implementation for both: on a 1-D mesh ``fully_shard`` is FSDP (parameters are
DTensors sharded on dim 0; the forward all-gathers one block at a time, the backward
reduce-scatters gradients); on a 2-D mesh ``(dp_replicate, dp_shard_cp)`` it is HSDP
(sharded over the second axis, replicated over the first: gradients reduce-scattered
within a shard group, then all-reduced across replicas). Gradients are averaged over the
mesh, which with equal tokens per rank gives the gradient of the global mean loss.

The ``cp`` axis is folded into the shard axis (``dp_shard_cp``), as in TorchTitan:
parameters are replicated over cp in the math, so sharding them there too is free, and
FSDP's gradient reduction then also averages over the cp ranks (each holds an equal share
of the sequence, so the average of local mean losses is the global mean).

Composes with TP: blocks whose parameters are already DTensors on the ``tp`` axis get
2-D (FSDP x TP) or 3-D (HSDP x TP) parameters. ``[training] mixed_precision_param`` /
``mixed_precision_reduce`` become FSDP2's policy (:func:`parallel.precision.mixed_precision_policy`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models import transformer_blocks
from parallel.mesh import CP, DP_REPLICATE, DP_SHARD, DP_SHARD_CP, axis_names, flatten_axes

__all__ = ["apply_fsdp", "data_parallel_mesh"]

PreShard = Callable[[nn.Module, DeviceMesh, MixedPrecisionPolicy], None]


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh FSDP/HSDP runs on: ``(dp_replicate, dp_shard_cp)`` (2-D, HSDP) when both are
    present, else the 1-D shard axis (``dp_shard`` x ``cp``); ``None`` when the mesh has no
    shard/context axis (``dp_replicate`` alone is DDP, :mod:`parallel.recipes.ddp`)."""
    names = axis_names(mesh)
    if DP_SHARD not in names and CP not in names:
        return None
    shard = flatten_axes(mesh, (DP_SHARD, CP), DP_SHARD_CP)
    if DP_REPLICATE not in names:
        return shard
    # a flattened axis (dp_shard_cp) can be sliced together with an original one by name
    return mesh[DP_REPLICATE, axis_names(shard)[0]]


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None, *,
               reshard_after_forward: bool = True, pre_shard: PreShard | None = None) -> nn.Module:
    """Shard each transformer block, then the root (embeddings, final norm, output).

    ``dp_mesh`` 1-D = FSDP, 2-D ``(replicate, shard)`` = HSDP. The last block is not
    resharded after forward: the backward needs its parameters right away.
    ``pre_shard(block, dp_mesh, policy)`` runs before each block is sharded (EP shards
    the experts on their own mesh there, :func:`parallel.recipes.ep.experts_fsdp_filter`).
    """
    policy = mp_policy or MixedPrecisionPolicy()
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        if pre_shard is not None:
            pre_shard(block, dp_mesh, policy)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model
