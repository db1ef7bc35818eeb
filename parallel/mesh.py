"""DeviceMesh from the ``[parallelism]`` section.

Axes, outermost first: ``dp_replicate, dp_shard, cp, tp``. Axes of size 1 are left out
(a mesh of one axis ``dp_shard`` of size 1 when every degree is 1). Expert parallel
reuses ranks of ``dp_shard x cp`` and is derived by the EP recipe, not built here.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
CP = "cp"
TP = "tp"
EP = "ep"
DP_SHARD_CP = "dp_shard_cp"  # dp_shard x cp flattened: where FSDP shards (recipes)
DP_SHARD_MOD_EP = "dp_shard_mod_ep"  # what is left of dp_shard_cp once ep is carved out
AXES = (DP_REPLICATE, DP_SHARD, CP, TP)
"""The mesh axes the trainer builds, outermost first (defined once; use these names)."""
DATA_AXES = (DP_REPLICATE, DP_SHARD)
"""Axes over which ranks read different batches."""


def mesh_shape(parallelism_cfg, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, axis names) for the mesh, size-1 axes omitted (at least one axis).
    Raises ValueError when the degrees do not multiply to ``world_size``."""
    deg = parallelism_cfg.resolved_degrees(world_size)
    sizes = [deg[a] for a in AXES]
    prod = 1
    for s in sizes:
        prod *= s
    if prod != world_size:
        raise ValueError(f"parallelism degrees {dict(zip(AXES, sizes))} multiply to {prod}, "
                         f"not the world size {world_size}")
    kept = [(s, a) for s, a in zip(sizes, AXES) if s > 1] or [(1, "dp_shard")]
    shape, names = zip(*kept)
    return tuple(shape), tuple(names)


def build_mesh(parallelism_cfg, world_size: int, device_type: str = "cpu") -> DeviceMesh:
    """The training mesh. Needs an initialised default process group of ``world_size``
    ranks (a real one, or the fake one for planning)."""
    shape, names = mesh_shape(parallelism_cfg, world_size)
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"build_mesh: world_size {world_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def dp_mesh(mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
    """The data-parallel sub-mesh (``dp_replicate`` and/or ``dp_shard``), or None."""
    if mesh is None or mesh.mesh_dim_names is None:
        return None
    names = [a for a in ("dp_replicate", "dp_shard") if a in mesh.mesh_dim_names]
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[tuple(names)]


def dp_rank_and_degree(mesh: Optional[DeviceMesh]) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks and their number (0, 1 without
    data parallelism). Ranks that differ only in cp/tp coordinates share a dp rank and
    so read the same batch."""
    sub = dp_mesh(mesh)
    if sub is None:
        return 0, 1
    coords = sub.get_coordinate()
    rank = 0
    for c, size in zip(coords, sub.mesh.shape):
        rank = rank * size + c
    return rank, sub.size()
