"""DDP recipe: ``data_parallel_replicate_degree`` alone is torch's own data parallel.

Every rank holds the whole model as plain tensors; torch's ``DistributedDataParallel``
reducer (through ``replicate``, the composable form TorchTitan uses: the module keeps its
class and parameter names, so checkpoints and compiled blocks are the same as without it)
all-reduces the gradients in buckets (``bucket_cap_mb``, torch's default 25 MB) while the
backward still runs, and averages them over the replicas: with equal tokens per rank that
is the gradient of the global mean loss. DDP is built at the first forward (it broadcasts
rank 0's parameters then), so the recipe also applies to a model still on ``meta``.

Mixed precision: the parameters stay in their dtype and the forward runs under autocast
(the trainer's manual mode does that for every non-FSDP model); ``mixed_precision_reduce``
below the parameters' dtype all-reduces each bucket in that dtype (a comm hook doing what
torch's ``bf16_compress_hook`` does, which refuses anything but CUDA/NCCL), otherwise the
gradients are reduced in their own dtype.

DDP is the data-parallel axis alone: with ``dp_shard`` (HSDP) or ``cp`` the replicate axis
is FSDP2's (:mod:`parallel.recipes.fsdp`); ``dp_replicate`` with ``tp`` and no shard axis is
refused (TorchTitan does the same: DDP does not compose with TP here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel import _torch as T
from parallel.mesh import CP, DP_REPLICATE, DP_SHARD, axis_names, axis_size

from .errors import RecipeError

__all__ = ["BUCKET_CAP_MB", "apply_ddp", "compress_hook", "ddp_reducer", "is_ddp_mesh", "simulate_ddp", "validate_ddp"]

BUCKET_CAP_MB = 25.0  # torch's DistributedDataParallel default
_KEY = "data_parallel_replicate_degree"


def is_ddp_mesh(mesh: DeviceMesh | None) -> bool:
    """True when the mesh's data parallelism is DDP: a ``dp_replicate`` axis and neither
    ``dp_shard`` nor ``cp`` (whose presence makes the replicate axis HSDP's)."""
    names = axis_names(mesh)
    return DP_REPLICATE in names and DP_SHARD not in names and CP not in names


def validate_ddp(mesh: DeviceMesh) -> None:
    """:class:`RecipeError` when the DDP-shaped mesh has another axis (tp): not composed."""
    if not is_ddp_mesh(mesh):
        return
    others = [n for n in axis_names(mesh) if n != DP_REPLICATE]
    if others:
        raise RecipeError(_KEY, axis_size(mesh, DP_REPLICATE),
                          f"data_parallel_replicate_degree without data_parallel_shard_degree is DDP, which the "
                          f"recipes do not compose with {', '.join(others)}; set data_parallel_shard_degree > 1 "
                          f"(HSDP / FSDP x TP) or drop the {', '.join(others)} degree")


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, reduce_dtype: torch.dtype | None = None,
              bucket_cap_mb: float = BUCKET_CAP_MB) -> nn.Module:
    """``replicate`` ``model`` over the 1-D ``dp_mesh`` (after TP-free AC and compile); gradients
    all-reduced in ``reduce_dtype`` when it is a 16-bit type below the parameters' dtype."""
    if dp_mesh.ndim != 1:
        raise ValueError(f"DDP runs on a 1-D mesh, got {axis_names(dp_mesh)}")
    model = T.replicate(model, device_mesh=dp_mesh, bucket_cap_mb=bucket_cap_mb)
    param_dtype = next(model.parameters()).dtype
    if reduce_dtype is not None and reduce_dtype.is_floating_point and reduce_dtype.itemsize < param_dtype.itemsize:
        model.register_comm_hook(dp_mesh.get_group(), compress_hook(reduce_dtype))
    return model


def compress_hook(dtype: torch.dtype) -> Callable[[dist.ProcessGroup, dist.GradBucket], torch.futures.Future]:
    """A DDP comm hook all-reducing each gradient bucket in ``dtype`` (divided by the group
    size first, against overflow) and copying the mean back into the bucket (any backend)."""

    def hook(group, bucket):  # unannotated: DDP checks the annotations, and these would be strings
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())

        def decompress(fut):
            return buffer.copy_(fut.value()[0])

        return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)

    return hook


def ddp_reducer(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel running the model: the model itself (a DDP wrapper) or
    `replicate`'s (None: neither, or before its first forward)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    return T.ddp_of(model)


def simulate_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucket_cap_mb: float = BUCKET_CAP_MB) -> list[torch.Tensor]:
    """What DDP's reducer allocates and communicates, for a model of fake tensors (the dry
    run: ``DistributedDataParallel`` cannot be built on them). torch's own bucket assignment
    of the gradients in backward order (approximated as the reverse of the parameters'
    order, as the reducer's first guess), one flat buffer per bucket (the reducer's, alive
    as long as the model), and one ``all_reduce`` of a bucket once all its gradients are
    accumulated. Returns the buffers."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    group = dp_mesh.get_group()
    buffers = []
    for idx in T.ddp_buckets(params, int(bucket_cap_mb * 2**20)):
        members = [params[i] for i in idx]
        flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
        left = [len(members)]

        def ready(_p: torch.Tensor, flat: torch.Tensor = flat, left: list = left, n: int = len(members)) -> None:
            left[0] -= 1
            if left[0] == 0:
                dist.all_reduce(flat, group=group)
                left[0] = n

        for p in members:
            p.register_post_accumulate_grad_hook(ready)
        buffers.append(flat)
    return buffers
