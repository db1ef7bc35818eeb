"""DeviceMesh from the ``[parallelism]`` section, and the mesh axes every layer names.

Axes, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. Axes of size 1 are left out
(a mesh of one axis ``dp_shard`` of size 1 when every degree is 1). In manual mode expert
parallel reuses ranks of ``dp_shard x cp`` and is derived by the EP recipe, not built here;
in auto mode (``expert_axis``) ``dp_shard`` is built as ``dp_shard_mod_ep x ep``, the same
rank groups, two data axes the planner places on (experts expert-parallel on whichever it
chooses). The axis names are defined here once; other modules use these constants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel import _torch as T
from parallel.settings import ParallelDegrees

DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
CP = "cp"
TP = "tp"
EP = "ep"
PP = "pp"  # pipeline parallel: the outermost axis (manual mode; the recipes' pp.py)
DP_SHARD_CP = "dp_shard_cp"  # dp_shard x cp flattened: where FSDP shards (recipes)
DP_SHARD_MOD_EP = "dp_shard_mod_ep"  # what is left of dp_shard_cp once ep is carved out
AXES = (DP_REPLICATE, DP_SHARD, CP, TP)
"""The mesh axes the planner places on, outermost first (defined once; use these names). The
trainer's mesh may also have ``pp`` outside them (MESH_AXES)."""
MESH_AXES = (PP, *AXES)
"""The axes the trainer builds, outermost first."""
DATA_AXES = (DP_REPLICATE, DP_SHARD, DP_SHARD_MOD_EP, EP)
"""Axes over which ranks read different batches (in mesh order; the last two: auto mode's
``dp_shard`` split for expert parallel)."""


def mesh_shape(degrees: ParallelDegrees, world_size: int, *, expert_axis: bool = False
               ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, axis names) for the mesh, size-1 axes omitted (at least one axis).
    `expert_axis` (auto mode): an expert-parallel degree splits ``dp_shard`` into
    ``dp_shard_mod_ep x ep``, and a ``pp`` axis alone gets a size-1 ``dp_shard`` beside it (the
    axis its stages are planned on). Raises ValueError when the degrees do not multiply to
    ``world_size`` or the expert degree does not divide ``dp_shard``."""
    deg = degrees.resolved(world_size)
    sizes = [deg[a] for a in MESH_AXES]
    prod = math.prod(sizes)
    if prod != world_size:
        raise ValueError(f"parallelism degrees {dict(zip(MESH_AXES, sizes))} multiply to {prod}, "
                         f"not the world size {world_size}")
    pairs = list(zip(sizes, MESH_AXES))
    ep = deg[EP]
    if expert_axis and ep > 1:
        if deg[DP_SHARD] % ep:
            raise ValueError(f"expert_parallel_degree {ep} does not divide data_parallel_shard_degree {deg[DP_SHARD]}")
        i = MESH_AXES.index(DP_SHARD)
        pairs[i:i + 1] = [(deg[DP_SHARD] // ep, DP_SHARD_MOD_EP), (ep, EP)]
    kept = [(s, a) for s, a in pairs if s > 1] or [(1, DP_SHARD)]
    if expert_axis and [a for _, a in kept] == [PP]:
        kept.append((1, DP_SHARD))
    shape, names = zip(*kept)
    return tuple(shape), tuple(names)


def build_mesh(degrees: ParallelDegrees, world_size: int, device_type: str, *, expert_axis: bool = False
               ) -> DeviceMesh:
    """The training mesh (`expert_axis`: see `mesh_shape`). Needs an initialised default
    process group of ``world_size`` ranks (a real one, or the fake one for planning)."""
    shape, names = mesh_shape(degrees, world_size, expert_axis=expert_axis)
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"build_mesh: world_size {world_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    world = dist.group.WORLD if dist.is_initialized() else None
    key = (device_type, shape, names)
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not world:  # first of its shape, or the world was re-created
        cached = _MESHES[key] = (world, init_device_mesh(device_type, shape, mesh_dim_names=names))
    return cached[1]


_MESHES: dict[tuple, tuple[Any, DeviceMesh]] = {}
"""One mesh per (device, shape, axes) and default process group in a process. Why: every
new mesh makes new sub-groups, whose names the compiled step graph bakes in; a second
trainer of the same shape in one process (a sweep, a resume test) then misses Inductor's
cache and leaks groups. The default group is kept with its mesh: a re-created world
replaces the entry."""


def axis_names(mesh: DeviceMesh | None) -> tuple[str, ...]:
    """The mesh's axis names (empty for no mesh or an unnamed one)."""
    return tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()


def axis_size(mesh: DeviceMesh | None, axis: str) -> int:
    """Size of the named axis; 1 when the mesh has no such axis (size-1 axes are left out)."""
    names = axis_names(mesh)
    return mesh.shape[names.index(axis)] if axis in names else 1


def submesh(mesh: DeviceMesh, axis: str | None) -> DeviceMesh:
    """The 1-D sub-mesh of ``axis``: ``mesh`` itself when ``axis`` is None, when the mesh is
    unnamed, or when it is already the 1-D mesh of that axis (recipes take either)."""
    names = axis_names(mesh)
    if axis is None or not names or names == (axis,):
        return mesh
    return mesh[axis]


def flatten_axes(mesh: DeviceMesh, axes: Sequence[str], name: str) -> DeviceMesh:
    """1-D mesh over those of ``axes`` that ``mesh`` has (flattened in order; one: its slice).

    torch 2.13 has no public flatten (``parallel._torch.flatten_mesh``); call it outside any
    fake mode. Once flattened, ``mesh[name]`` also works (a second call reuses it).
    """
    present = [a for a in axes if a in axis_names(mesh)]
    if not present:
        raise ValueError(f"mesh {axis_names(mesh)} has none of the axes {list(axes)}")
    if len(present) == 1:
        return submesh(mesh, present[0])
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return T.flatten_mesh(mesh[tuple(present)], name)


def dp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The data-parallel sub-mesh (``dp_replicate`` and/or ``dp_shard``), or None."""
    names = [a for a in DATA_AXES if a in axis_names(mesh)]
    if not names:
        return None
    return mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]


def dp_rank_and_degree(mesh: DeviceMesh | None) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks and their number (0, 1 without
    data parallelism). Ranks that differ only in cp/tp coordinates share a dp rank and
    so read the same batch."""
    sub = dp_mesh(mesh)
    if sub is None:
        return 0, 1
    rank = 0
    for c, size in zip(sub.get_coordinate(), sub.mesh.shape):
        rank = rank * size + c
    return rank, sub.size()
