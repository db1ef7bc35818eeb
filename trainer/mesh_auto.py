"""Mesh search for a job: ``[parallelism] mesh = "auto"`` and ``scripts/plan.py --mesh auto``.

Every mesh of the world size that the layout rules allow (parallel/auto/mesh_search.py:
dp_replicate, dp_shard, cp, tp; a cp degree only where the sequence splits load-balanced;
a cp axis is planned as the trainer feeds it: the sequence in load-balanced order with
its positions, attention a region that may shard it) is planned as a sweep point with the job's model, shapes,
planner knobs and budget (cached, seeded as the planner seeds), meshes whose memory does
not fit are dropped, the rest ranked by predicted step time per token (tokens/s: the
global batch, local batch x data-parallel degree, differs between meshes). The trainer then builds the
best one: rank 0 searches in a spawned process (its own fake world; the job's real process
group stays untouched) and broadcasts the chosen degrees, or the error, to every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from parallel.auto.cost import HardwareProfile, ProfileError, load_hardware
from parallel.auto.mesh_search import Candidate, MeshSearchError, MeshSpec, enumerate_meshes, rank_candidates
from parallel.mesh import CP, DP_REPLICATE, DP_SHARD, TP

from .auto import planning_hardware
from .config import JobConfig
from .errors import ConfigError
from .sweep import Progress, run_points
from .sweep_point import PlanCache
from .sweep_report import markdown_table, memory_note
from .sweep_spec import Point, planner_of

logger = logging.getLogger("autotitan")
RANK_COLUMNS = ("rank", "mesh", "batch x seq", "step ms", "tokens/s", "MFU", "mem GiB", "OOM", "plan s", "status",
                "plan")


def search_points(cfg: JobConfig, world: int, hardware: str | HardwareProfile,
                  vocab_size: int | None = None) -> list[Point]:
    """One point per candidate mesh of ``world`` devices for the job ``cfg``."""
    hw = load_hardware(hardware)
    t, par = cfg.training, cfg.parallelism
    budget = par.memory_budget_high if par.memory_budget_high is not None else "auto"
    return [Point(index=i, model=cfg.model.name, flavor=cfg.model.flavor,
                  model_args=tuple(sorted(cfg.model.arg_overrides().items())), mesh=spec,
                  local_batch_size=t.local_batch_size, seq_len=t.seq_len, ac_mode=cfg.activation_checkpoint.mode,
                  hardware=hardware, memory_high=budget, planner=planner_of(cfg), vocab_size=vocab_size,
                  mesh_auto=True)
            for i, spec in enumerate(searched_meshes(world, hw.gpus_per_node, t.seq_len))]


def searched_meshes(world: int, gpus_per_node: int, seq_len: int) -> list[MeshSpec]:
    """The meshes the search plans: dp_replicate, dp_shard, cp, tp laid out on nodes, a cp
    degree only where the load-balanced split works (seq_len a multiple of 2 x cp)."""
    specs = enumerate_meshes(world, gpus_per_node, axes=(DP_REPLICATE, DP_SHARD, CP, TP))
    return [s for s in specs if seq_len % (2 * s.degree(CP)) == 0]


def rank_rows(points: list[Point], rows: list[dict]) -> list[dict]:
    """Rows ranked: fitting meshes by predicted step time per token, i.e. tokens/s (``rank``
    1, 2, ...; see :func:`rank_candidates`), then the dropped ones (OOM, planning failures)
    with ``rank`` "-" and their reason."""
    cands = [Candidate(p.mesh, r.get("objective_us"), r.get("status") == "ok", r.get("status", ""),
                       tokens=p.global_batch * p.seq_len) for p, r in zip(points, rows)]
    by_mesh = {p.mesh: r for p, r in zip(points, rows)}
    out = []
    for i, c in enumerate(rank_candidates(cands)):
        r = dict(by_mesh[c.mesh])
        r["rank"] = i + 1 if c.fits and c.step_us is not None else "-"
        out.append(r)
    return out


def search_meshes(cfg: JobConfig, world: int, hardware: str | HardwareProfile, *, workers: int = 2,
                  cache: PlanCache | None = None, vocab_size: int | None = None,
                  out: Callable[[str], None] | None = None) -> list[dict]:
    """Plan every candidate mesh (cached) and return the ranked rows (see :func:`rank_rows`);
    ``out`` prints the progress lines (default: stderr)."""
    points = search_points(cfg, world, hardware, vocab_size)
    rows = run_points(points, workers=workers, cache=cache if cache is not None else PlanCache(),
                      progress=Progress(len(points), out))
    return rank_rows(points, rows)


def ranked_table(rows: list[dict]) -> str:
    """The ranked rows as Markdown, with the memory column's meaning under it."""
    table = markdown_table(rows, columns=RANK_COLUMNS)
    note = memory_note(rows)
    return table + (f"\n{note}" if note else "")


def degrees_of(row: dict) -> dict[str, int]:
    """The `[parallelism]` degrees of a row's mesh label (dp_shard=4,tp=2 -> ...)."""
    sizes = dict((n, int(s)) for n, s in (kv.split("=") for kv in row["mesh"].split(",")))
    return {"data_parallel_replicate_degree": sizes.get(DP_REPLICATE, 1),
            "data_parallel_shard_degree": sizes.get(DP_SHARD, 1), "tensor_parallel_degree": sizes.get(TP, 1),
            "context_parallel_degree": sizes.get(CP, 1)}


def choose_mesh(cfg: JobConfig, world: int, device_type: str, vocab_size: int) -> JobConfig:
    """The trainer's ``mesh = "auto"``: every rank calls this; rank 0 searches, all ranks
    get the best mesh's degrees (a copy of ``cfg`` with them set) or the same ConfigError."""
    par = cfg.parallelism
    hw = planning_hardware(par, None, device_type)  # "auto": measured with every rank
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        payload = [_search_on_rank0(cfg, world, hw, vocab_size)]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        raise payload[0]
    par = dataclasses.replace(par, mesh="", **payload[0])
    return dataclasses.replace(cfg, parallelism=par)


def _search_on_rank0(cfg: JobConfig, world: int, hw: Any, vocab_size: int) -> dict | Exception:
    where = f"{cfg.source}: 'parallelism.mesh' = 'auto'"
    try:
        logger.info("mesh search: planning every mesh of %d devices (cached plans are reused)", world)
        rows = search_meshes(cfg, world, hw, workers=1, vocab_size=vocab_size, out=logger.info)
    except (MeshSearchError, ProfileError) as e:
        return ConfigError(f"{where}: {e}; set the degrees instead")
    logger.info("mesh search, ranked by predicted tokens/s:\n%s", ranked_table(rows))
    best = next((r for r in rows if r["rank"] == 1), None)
    if best is None:
        return ConfigError(f"{where}: no mesh of {world} devices has a plan that fits ({rows[0]['status']} ...); "
                           "lower the budget, the batch or the sequence, or set the degrees")
    logger.info("mesh search: building the best mesh %s (%.1f ms predicted per step)", best["mesh"], best["step_ms"])
    return degrees_of(best)
