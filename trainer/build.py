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

from models import build_model
from parallel.auto.runtime import is_parallel_module
from parallel.precision import dtype_of

from .auto_mode import PlanSource
from .config import JobConfig
from .device import sharded_init_is_exact
from .hf_checkpoint import export_hf_config, initial_arg_overrides
from .parallelizer import ParallelismMode


def init_weights(model: torch.nn.Module, device: torch.device, seed: int, sharded: bool = False) -> None:
    """Storage on `device`, then the model's own init from the job's seed (`sharded`: a
    ParallelModule's ranks draw only their shards)."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(sharded=True) if sharded and is_parallel_module(model) else model.init_weights()


def build_parallel_model(cfg: JobConfig, parallelizer: ParallelismMode, device: torch.device, vocab_size: int,
                         sample_batch: Any, plan_source: Optional[PlanSource] = None,
                         storage: Callable[[], ContextManager] = contextlib.nullcontext) -> torch.nn.Module:
    """The job's model on `device`, initialised from the job's seed and parallelized by the
    job's mode (recipe or plan), in train mode. `storage`: the context the weights are
    allocated in (the dry run's FakeTensorMode; the trainer's real memory by default)."""
    overrides = {**initial_arg_overrides(cfg), **cfg.model.arg_overrides()}  # an HF start's RoPE and eps
    model = build_model(cfg.model.name, cfg.model.flavor, device="meta", vocab_size=vocab_size, **overrides)
    if cfg.checkpoint.last_save_in_hf:
        export_hf_config(cfg, model.args)  # a model with no HF equivalent: the config error now, not after training
    sharded = sharded_init_is_exact(device)
    if not sharded:
        with storage():
            init_weights(model, device, cfg.job.seed)  # in fp32, then cast: the same values as a single-device run
    if cfg.training.dtype != "float32":
        model = model.to(dtype_of(cfg.training.dtype))
    model = parallelizer.parallelize(model, sample_batch, plan_source)
    if sharded:
        with storage():
            init_weights(model, device, cfg.job.seed, sharded=True)
    model.train()
    return model
