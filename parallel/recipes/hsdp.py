"""FSDP2 / HSDP over the data-parallel axes of the N-D mesh, with a mixed-precision policy.

``fully_shard`` on a 2-D mesh ``(dp_replicate, dp_shard_cp)`` is HSDP: parameters are
sharded over the second axis and replicated over the first (gradients reduce-scattered
within a shard group, then all-reduced across replicas). On a 1-D mesh it is FSDP.

The ``cp`` axis is folded into the shard axis (``dp_shard_cp``), as in TorchTitan:
parameters are replicated over cp in the math, so sharding them there too is free, and
FSDP's gradient reduction then also averages over the cp ranks (each holds an equal share
of the sequence, so the average of local mean losses is the global mean).

Composes with TP: blocks whose parameters are already DTensors on the ``tp`` axis get
2-D (FSDP x TP) or 3-D (HSDP x TP) parameters.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from parallel import _torch as T

__all__ = ["flatten_axes", "data_parallel_mesh", "apply_hsdp", "mp_policy"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def flatten_axes(mesh: DeviceMesh, axes: Sequence[str], name: str) -> DeviceMesh:
    """1-D mesh over the named ``axes`` of ``mesh`` (flattened in order; one axis: the slice).

    Uses ``DeviceMesh._flatten`` through ``parallel._torch`` (torch 2.13 has no public
    way); call it outside any fake mode. Once flattened, ``mesh[name]`` also works.
    """
    axes = [a for a in axes if a in _names(mesh)]
    if not axes:
        raise ValueError(f"mesh {_names(mesh)} has none of the axes {list(axes)}")
    if len(axes) == 1:
        return mesh if mesh.ndim == 1 else mesh[axes[0]]
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return T.flatten_mesh(mesh[tuple(axes)], name)


def data_parallel_mesh(mesh: DeviceMesh) -> Optional[DeviceMesh]:
    """The mesh FSDP/HSDP runs on: ``(dp_replicate, dp_shard_cp)`` (2-D, HSDP) when both are
    > 1, else the 1-D shard axis (``dp_shard`` x ``cp``, or ``dp_replicate`` alone, which
    then is sharded too); ``None`` when the mesh has no data/context axis."""
    names = _names(mesh)
    shard_axes = [a for a in ("dp_shard", "cp") if a in names]
    has_rep = "dp_replicate" in names
    if not shard_axes and not has_rep:
        return None
    if shard_axes:
        shard = flatten_axes(mesh, shard_axes, "dp_shard_cp")
        if not has_rep:
            return shard
        # a flattened axis (dp_shard_cp) can be sliced together with an original one by name
        return mesh["dp_replicate", _names(shard)[0]]
    return mesh["dp_replicate"] if mesh.ndim > 1 else mesh


def mp_policy(param_dtype="float32", reduce_dtype="float32") -> MixedPrecisionPolicy:
    """``MixedPrecisionPolicy`` from dtype names (``"float32"``, ``"bfloat16"``)."""
    pd = _DTYPES[param_dtype] if isinstance(param_dtype, str) else param_dtype
    rd = _DTYPES[reduce_dtype] if isinstance(reduce_dtype, str) else reduce_dtype
    return MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd)


def apply_hsdp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype="float32",
               reduce_dtype="float32", reshard_after_forward: bool = True,
               module_filter=None) -> nn.Module:
    """``fully_shard`` every transformer block, then the root (embeddings, norm, output).

    ``dp_mesh`` 1-D = FSDP, 2-D ``(replicate, shard)`` = HSDP. The last block is not
    resharded after forward (its parameters are needed again at once in backward).
    """
    policy = mp_policy(param_dtype, reduce_dtype)
    layers = list(model.layers)
    for i, block in enumerate(layers):
        if module_filter is not None:
            module_filter(block, dp_mesh, policy)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model
