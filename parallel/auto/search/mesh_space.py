"""Which meshes could a job of N devices run on, and which is fastest?

The planner decides what every mesh axis does, but not the mesh itself. This module
enumerates the meshes a user could build — factorizations of N into the named axes
``dp_replicate, dp_shard, (cp,) tp``, outermost first, laid out on nodes of
``gpus_per_node`` devices — and ranks planned candidates by predicted step time per token.

Layout rules (ranks are numbered row-major, the last axis varies fastest):
  * ``tp`` divides the node size: tensor parallelism stays on the intra-node links;
  * ``dp_replicate`` is the outermost, inter-node axis: when the world spans nodes, the
    axes inside it (``dp_shard x cp x tp``) fill whole nodes; and it only appears with a
    ``dp_shard`` axis (HSDP) — replicate alone is the same problem as shard alone;
  * a world larger than one node is a whole number of nodes.
``cp`` is enumerated only when asked (``axes`` including it): sweeps with ``mesh = "auto"``
keep to the data and tensor axes, the trainer's mesh search (trainer/mesh_auto.py) asks
for it.
Planning is done by the caller (one plan per mesh); ranking only reads the results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from parallel.mesh import AXES, CP, DATA_AXES, DP_REPLICATE, DP_SHARD, TP

SEARCH_AXES = (DP_REPLICATE, DP_SHARD, TP)
"""Axes enumerated by default (cp only when asked: see the module docstring)."""

DEFAULT_NAMES = {1: (DP_SHARD,), 2: (DP_SHARD, TP), 3: (DP_REPLICATE, DP_SHARD, TP), 4: AXES}
"""Axis names of an unnamed mesh string ("4x8") by its number of axes."""


class MeshSearchError(ValueError):
    """A world size or mesh that no layout can serve."""


@dataclass(frozen=True)
class MeshSpec:
    """A mesh shape with its axis names, outermost first (size-1 axes left out)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def label(self) -> str:
        """``dp_shard=4,tp=8``: readable and parseable back by :func:`parse_mesh`."""
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.shape))

    def data_axes(self) -> list[int]:
        """Indices of the batch-sharded axes (dp_replicate, dp_shard), as the trainer's loader
        feeds them: a mesh without one (tp alone) sees one local batch, replicated."""
        return [i for i, n in enumerate(self.names) if n in DATA_AXES]

    def degree(self, axis: str) -> int:
        return self.shape[self.names.index(axis)] if axis in self.names else 1


def parse_mesh(text: str, names: Sequence[str] | Mapping[int, Sequence[str]] | None = None) -> MeshSpec:
    """``"4x8"`` (default names by rank, :data:`DEFAULT_NAMES`) or ``"dp_shard=4,tp=8"``; size-1
    axes left out. ``names`` names the axes of a ``"4x8"`` string instead of the defaults: one
    name per axis, or a table by number of axes (a caller's own defaults); names given so may
    be any distinct names (``dp``, the one-word data axis of tools/plan.py, included)."""
    text = text.strip()
    try:
        if "=" in text:
            pairs = [p.split("=") for p in text.split(",")]
            axis_names = tuple(n.strip() for n, _ in pairs)
            sizes = tuple(int(s) for _, s in pairs)
        else:
            sizes = tuple(int(x) for x in text.lower().split("x"))
            table = names if isinstance(names, Mapping) else DEFAULT_NAMES
            axis_names = tuple(names) if names is not None and not isinstance(names, Mapping) else table[len(sizes)]
    except (ValueError, KeyError):
        raise MeshSearchError(f"mesh {text!r} is not a mesh: write it as 4x8 (1 to 4 axes) or "
                              "dp_shard=4,tp=8 (axis=size, comma-separated)") from None
    own = names is not None and "=" not in text  # the caller's names: any distinct names
    if len(axis_names) != len(sizes) or len(set(axis_names)) != len(axis_names):
        raise MeshSearchError(f"mesh {text!r}: axis names {', '.join(axis_names)} are not one distinct name per axis")
    if (not own and any(n not in AXES for n in axis_names)) or any(s < 1 for s in sizes):
        raise MeshSearchError(f"mesh {text!r}: axes must be distinct names among {', '.join(AXES)} with sizes "
                              ">= 1")
    kept = [(s, n) for s, n in zip(sizes, axis_names) if s > 1] or [(sizes[-1], axis_names[-1])]
    return MeshSpec(tuple(s for s, _ in kept), tuple(n for _, n in kept))


def check_world(world: int, gpus_per_node: int) -> None:
    """Raise MeshSearchError when ``world`` devices are no whole number of nodes (nor one node's part)."""
    if world < 1:
        raise MeshSearchError(f"world size {world} must be >= 1")
    if world > gpus_per_node and world % gpus_per_node:
        raise MeshSearchError(f"world size {world} is not a whole number of nodes of {gpus_per_node} devices: "
                              f"no mesh lays it out; use a multiple of {gpus_per_node} (or at most one node)")


def _factorizations(n: int, k: int) -> Iterable[tuple[int, ...]]:
    """Ordered k-tuples of positive integers whose product is n."""
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, k - 1):
                yield (d, *rest)


def _layout_ok(deg: dict[str, int], world: int, gpn: int) -> bool:
    if gpn % deg[TP]:
        return False  # tensor parallelism within a node
    if deg[DP_REPLICATE] > 1:
        if deg[DP_SHARD] == 1:
            return False  # replicate alone duplicates shard alone
        inner = world // deg[DP_REPLICATE]
        if world > gpn and inner % gpn:
            return False  # the replicate axis runs between whole nodes
    return True


def enumerate_meshes(world: int, gpus_per_node: int, axes: Sequence[str] = SEARCH_AXES) -> list[MeshSpec]:
    """Every mesh of ``world`` devices over ``axes`` (a subset of dp_replicate, dp_shard,
    cp, tp; kept in that order) that obeys the layout rules; size-1 axes left out."""
    check_world(world, gpus_per_node)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise MeshSearchError(f"unknown mesh axes {unknown}; axes are {', '.join(AXES)}")
    order = [a for a in AXES if a in axes]
    out: list[MeshSpec] = []
    for sizes in _factorizations(world, len(order)):
        deg = {a: 1 for a in AXES} | dict(zip(order, sizes))
        if not _layout_ok(deg, world, gpus_per_node):
            continue
        kept = [(deg[a], a) for a in order if deg[a] > 1] or [(1, DP_SHARD)]
        spec = MeshSpec(tuple(s for s, _ in kept), tuple(a for _, a in kept))
        if spec not in out:
            out.append(spec)
    if not out:
        raise MeshSearchError(f"no mesh of axes {list(order)} lays out {world} devices on nodes of {gpus_per_node}")
    return out


def uses_context_parallel(spec: MeshSpec) -> bool:
    return CP in spec.names


@dataclass
class MeshOption:
    """One planned mesh: predicted step time (None when planning failed), the tokens one
    step processes, whether it fits, and why not."""

    mesh: MeshSpec
    step_us: float | None
    fits: bool
    reason: str = ""
    tokens: int = 1

    @property
    def us_per_token(self) -> float:
        return self.step_us / self.tokens if self.step_us is not None else float("inf")


def rank_mesh_options(options: Sequence[MeshOption]) -> list[MeshOption]:
    """Fitting meshes by predicted step time per token (fastest first), then the rest in
    their order. Per token: a mesh's global batch is the local batch times its
    data-parallel degree, so meshes of one world size step over different token counts
    (equal counts: the order of the step times)."""
    ok = sorted((c for c in options if c.fits and c.step_us is not None), key=lambda c: (c.us_per_token, c.mesh.shape))
    return ok + [c for c in options if c not in ok]
