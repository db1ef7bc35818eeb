"""The job's model, built as the trainer builds it: meta -> parallel -> initialised.

One function for the trainer and the dry run (`trainer/dry_run_auto.py`), so that a dry run
of a GPU job goes through the very branch the GPUs take: where sharded initialisation
reproduces the single-device init (CUDA: DTensor's offset-based RNG), the model is
parallelized on meta and every rank initialises only its shards (a 70B model never exists
whole on one GPU); elsewhere (CPU) every rank initialises the whole model, then keeps its
shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ContextManager, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from models import build_model
from parallel import _torch as T
from parallel.auto.runtime import is_parallel_module
from parallel.precision import dtype_of
from parallel.recipes import RecipeError, apply_compile, apply_recipe

from .auto import PlanSource, auto_parallelize_for_training
from .config import ConfigError, JobConfig
from .device import sharded_init_is_exact


def parallelize(model: torch.nn.Module, mesh: Optional[DeviceMesh], job_config: JobConfig,
                sample_batch: Any, plan_constraints: Optional[Callable[[Any], None]] = None,
                plan_source: Optional[PlanSource] = None) -> torch.nn.Module:
    """The one place where the model becomes parallel. ``mesh`` is None without a
    process group (single process): the model is returned as is (compiled if asked).
    A recipe's error (a degree that does not fit) becomes a ConfigError naming the file.
    `plan_constraints(autop)`: auto mode, constraints added to the planner before solving;
    `plan_source`: auto mode, where the plan comes from (trainer/auto.py PlanSource)."""
    if job_config.training.compile and job_config.training.compile_fallback:
        T.compile_errors_fall_back(True)  # manual mode's per-block torch.compile; auto mode has its own
    if job_config.parallelism.mode == "auto":
        return auto_parallelize_for_training(model, mesh, job_config, sample_batch, plan_constraints,
                                             source=plan_source)
    if mesh is None:
        return apply_compile(model) if job_config.training.compile else model
    try:
        return apply_recipe(model, mesh, job_config)
    except RecipeError as e:
        raise ConfigError(f"{job_config.source}: {e}") from None


def init_weights(model: torch.nn.Module, device: torch.device, seed: int, sharded: bool = False) -> None:
    """Storage on `device`, then the model's own init from the job's seed (`sharded`: a
    ParallelModule's ranks draw only their shards)."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(sharded=True) if sharded and is_parallel_module(model) else model.init_weights()


def build_parallel_model(cfg: JobConfig, mesh: Optional[DeviceMesh], device: torch.device, vocab_size: int,
                         sample_batch: Any, plan_constraints: Optional[Callable[[Any], None]] = None,
                         plan_source: Optional[PlanSource] = None,
                         storage: Callable[[], ContextManager] = contextlib.nullcontext) -> torch.nn.Module:
    """The job's model on `device`, initialised from the job's seed and parallelized (recipe
    or plan), in train mode. `storage`: the context the weights are allocated in (the dry
    run's FakeTensorMode; the trainer's real memory by default)."""
    model = build_model(cfg.model.name, cfg.model.flavor, device="meta", vocab_size=vocab_size,
                        **cfg.model.arg_overrides())
    sharded = sharded_init_is_exact(device)
    if not sharded:
        with storage():
            init_weights(model, device, cfg.job.seed)  # in fp32, then cast: the same values as a single-device run
    if cfg.training.dtype != "float32":
        model = model.to(dtype_of(cfg.training.dtype))
    model = parallelize(model, mesh, cfg, sample_batch, plan_constraints, plan_source)
    if sharded:
        with storage():
            init_weights(model, device, cfg.job.seed, sharded=True)
    model.train()
    return model
