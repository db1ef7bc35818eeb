"""Trainer integration of the planner: `[parallelism] mode = "auto"`.

    model = auto_parallelize_for_training(model, mesh, job_config, sample_batch)

1. The mesh comes from the degrees (`parallel/mesh.py`); its axis names are labels only:
   the planner decides what each axis does. The data loader gives every data-parallel
   rank (`dp_replicate` x `dp_shard` coordinates) its own local batch, so the tokens and
   labels are constrained to Shard(0) on those axes and Replicate on the others.
2. Rank 0 plans (trace -> candidates -> problem -> solve) with the configured hardware
   profile, solver and memory budget and broadcasts the plan (JSON); every rank then
   checks it against its own trace (same graph, same candidate menus) and all ranks
   verify they hold the identical plan. `parallelism.plan_file` replays a saved plan
   without solving; a plan made for another model, mesh or input shape is refused.
3. The plan summary and objective are logged, the plan JSON is written to
   `<dump_folder>/<job.name>/plan.json`, and the model is materialised as a
   ParallelModule (parallel/auto/runtime) whose forward takes the per-rank
   (tokens, labels) and returns the global mean loss.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.tensor import Replicate, Shard

from parallel.auto.api import AutoParallel, lm_loss
from parallel.auto.plan import Plan

logger = logging.getLogger("autotitan")

DATA_AXES = ("dp_replicate", "dp_shard")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def data_placements(mesh: Any) -> tuple:
    """Shard(0) (batch) on the data-parallel axes, Replicate on the others."""
    names = mesh.mesh_dim_names or ()
    return tuple(Shard(0) if n in DATA_AXES else Replicate() for n in names)


def data_degree(mesh: Any) -> int:
    names = mesh.mesh_dim_names or ()
    d = 1
    for n, s in zip(names, mesh.shape):
        if n in DATA_AXES:
            d *= s
    return d


def mixed_precision_policy(training_cfg: Any) -> Any:
    """MixedPrecisionPolicy for bf16 compute (None when training is plain fp32)."""
    param = _DTYPES[training_cfg.mixed_precision_param]
    reduce = _DTYPES[training_cfg.mixed_precision_reduce]
    if param == torch.float32 and reduce == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def plan_digest(plan: Any) -> str:
    d = plan.to_json()
    d.pop("timings", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def auto_parallelize_for_training(model: nn.Module, mesh: Any, job_config: Any, sample_batch: Any) -> nn.Module:
    """Plan (or replay a plan for) `model` on `mesh` and return the ParallelModule.

    sample_batch: the per-rank (tokens, labels) of the data loader; the global batch is
    the local one times the data-parallel degree. Without a mesh (single process) the
    model is returned unchanged.
    """
    if mesh is None:
        logger.info("parallelism.mode = auto on a single process: nothing to plan, training the model as is")
        return model
    par = job_config.parallelism
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" in names:
        from trainer.config import ConfigError

        raise ConfigError(
            f"{getattr(job_config, 'source', 'config')}: 'parallelism.context_parallel_degree' > 1 with mode = "
            f'"auto": the trainer splits the sequence into load-balanced CP chunks, which the planner\'s '
            "inputs cannot express; use the degree as a data/tensor axis (data_parallel_shard_degree or "
            "tensor_parallel_degree) and let the planner choose, or mode = \"manual\"")
    if job_config.activation_checkpoint.mode != "none":
        logger.warning("activation_checkpoint.mode = %r is ignored in auto mode (the plan runs the traced joint graph)",
                       job_config.activation_checkpoint.mode)
    if job_config.training.compile:
        logger.warning("training.compile is ignored in auto mode: the ParallelModule runs eagerly")
    tokens, labels = sample_batch
    dp = data_degree(mesh)
    gshape = (tokens.shape[0] * dp, *tokens.shape[1:])
    g_inputs = (torch.zeros(gshape, dtype=tokens.dtype, device="meta"),
                torch.zeros(gshape, dtype=labels.dtype, device="meta"))
    pl = data_placements(mesh)
    mp_policy = mixed_precision_policy(job_config.training)
    rank = _rank()
    run_dir = Path(job_config.job.dump_folder) / job_config.job.name
    with AutoParallel(model, g_inputs, mesh, loss_fn=lm_loss, mp_policy=mp_policy, hardware=par.hardware,
                      solver=par.solver) as autop:
        autop.add_input_constraints([pl, pl])
        if par.memory_budget_low is not None or par.memory_budget_high is not None:
            autop.add_parameter_memory_constraint(low=par.memory_budget_low, high=par.memory_budget_high)
        if par.plan_file:
            input_shapes = [[list(x.shape), str(x.dtype)] for x in g_inputs]
            plan = Plan.load(par.plan_file, model=model, mesh=mesh, input_shapes=input_shapes)
            how = f"replayed from {par.plan_file}"
        else:
            payload = [None]
            if rank == 0:
                plan = autop.optimize_placement(verbose=True)
                payload = [plan.to_json()]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(payload, src=0)
            if rank != 0:
                plan = Plan.from_json(payload[0])
            how = f"solved by {plan.solver} ({plan.status})"
        digest = plan_digest(plan)
        _check_agreement(digest)
        if rank == 0:
            logger.info("auto-parallel plan %s, objective %.1f µs, digest %s\n%s", how, plan.objective_us, digest,
                        plan.summary())
            run_dir.mkdir(parents=True, exist_ok=True)
            plan.save(str(run_dir / "plan.json"))
            logger.info("plan saved to %s", run_dir / "plan.json")
        pmodel = autop.apply_placement(plan)
    return pmodel


def _check_agreement(digest: str) -> None:
    """Every rank must apply the same plan."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks disagree on the plan: digests {digests}")
