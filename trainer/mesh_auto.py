"""The trainer's ``[parallelism] mesh = "auto"``: search the meshes, build the best.

The search itself is parallel/auto/search/mesh_search.py (every mesh of the world size planned
with the job's whole planning request at the job's global batch, ranked by the predicted
time of that step); the chosen mesh's local batch (global / its data degree / its
micro-batches) becomes the job's `local_batch_size`, the global batch its
`global_batch_size`. The launcher
(train.py) resolves the mesh before it builds the Trainer: rank 0 searches in a spawned
process (its own fake world; the job's real process group stays untouched) and broadcasts
the chosen degrees, or the error, to every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.distributed as dist

from parallel.auto.cost import ProfileError
from parallel.auto.search.mesh_search import degrees_of, ranked_table, search_global_batch, search_meshes
from parallel.auto.search.mesh_space import MeshSearchError
from parallel.auto.search.pipeline_points import pipeline_settings

from .auto_mode import base_job, planner_config
from .config import JobConfig
from .data import DataError, TokenizerError, tokenizer_for
from .device import local_device
from .errors import ConfigError
from .metrics import setup_logging

logger = logging.getLogger("autotitan")


def resolve_mesh(cfg: JobConfig) -> JobConfig:
    """`cfg` with the mesh search's degrees when `[parallelism] mesh = "auto"` in a process
    group (every rank calls this), else `cfg` itself (a single process trains unsharded)."""
    if cfg.parallelism.mesh != "auto" or not (dist.is_available() and dist.is_initialized()):
        return cfg
    setup_logging(dist.get_rank())  # the search's progress and ranked table are the job's first log lines
    try:
        vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else tokenizer_for(cfg).vocab_size
    except (DataError, TokenizerError) as e:
        raise ConfigError(f"{cfg.source}: {e}") from None
    return choose_mesh(cfg, dist.get_world_size(), local_device(cfg.job.device).type, vocab)
def choose_mesh(cfg: JobConfig, world: int, device_type: str, vocab_size: int) -> JobConfig:
    """The trainer's ``mesh = "auto"``: every rank calls this; rank 0 searches, all ranks
    get the best mesh's degrees (a copy of ``cfg`` with them set) or the same ConfigError."""
    par = cfg.parallelism
    hw = planner_config(cfg, world, device_type).hardware  # "auto": measured with every rank
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        payload = [_search_on_rank0(cfg, world, hw, vocab_size)]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], Exception):
        raise payload[0]
    chosen = payload[0]
    par = dataclasses.replace(par, mesh="", degrees=dataclasses.replace(par.degrees, **chosen["degrees"]))
    if chosen["pipeline"]:  # a pipelined pick: its schedule and microbatch rows
        par = dataclasses.replace(par, pipeline=dataclasses.replace(par.pipeline, **chosen["pipeline"]))
    training = dataclasses.replace(cfg.training, local_batch_size=chosen["local_batch_size"],
                                   global_batch_size=chosen["global_batch_size"])
    return dataclasses.replace(cfg, parallelism=par, training=training)


def _search_on_rank0(cfg: JobConfig, world: int, hw: Any, vocab_size: int) -> dict | Exception:
    where = f"{cfg.source}: 'parallelism.mesh' = 'auto'"
    try:
        logger.info("mesh search: planning every mesh of %d devices (cached plans are reused)", world)
        rows = search_meshes(base_job(cfg), world, hw, workers=1, vocab_size=vocab_size, out=logger.info)
    except (MeshSearchError, ProfileError) as e:
        return ConfigError(f"{where}: {e}; set the degrees instead")
    gb = search_global_batch(base_job(cfg), world)
    logger.info("mesh search at global batch %d, ranked by predicted step time:\n%s", gb, ranked_table(rows))
    best = next((r for r in rows if r["rank"] == 1), None)
    if best is None:
        return ConfigError(f"{where}: no mesh of {world} devices has a plan that fits ({rows[0]['status']} ...); "
                           "lower the budget, the batch or the sequence, or set the degrees")
    logger.info("mesh search: building the best mesh %s (local batch %d x %d micro-batches, %.1f ms predicted per "
                "step)", best["mesh"], best["local_batch"], best.get("micro_batches", 1), best["step_ms"])
    pipeline = pipeline_settings(best)  # a data rank's batch is all of its microbatches
    local = best["local_batch"] * (best["micro_batches"] if pipeline else 1)
    return {"degrees": degrees_of(best), "local_batch_size": local, "global_batch_size": gb, "pipeline": pipeline}
