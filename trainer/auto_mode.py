"""Trainer integration of the planner: `[parallelism] mode = "auto"`.

    model, how = auto_parallelize_for_training(model, mesh, job_config, sample_batch)

1. The mesh comes from the degrees (`parallel/mesh.py`); its axis names are labels only:
   the planner decides what each axis does. The data loader gives every data-parallel
   rank (`dp_replicate` x `dp_shard` coordinates) its own local batch, so the tokens and
   labels are constrained to Shard(0) on those axes and Replicate on the others.
2. Rank 0 plans (trace -> candidates -> problem -> solve) with the `[parallelism]` knobs
   (hardware profile, solver, memory budget, seeding, time limit, repeated blocks) and
   broadcasts the plan (JSON), or its error, which every rank then raises; every rank
   checks the plan against its own trace (same graph, same candidate menus) and all
   ranks verify they hold the identical plan. `parallelism.plan_file` applies a saved
   plan without solving; a plan made for another model, mesh or input shape is refused.
3. The plan summary and objective are logged, the plan JSON is written to
   `<dump_folder>/<job.name>/plan.json`, and the model is materialised as a
   ParallelModule (parallel/auto/runtime) whose forward takes the per-rank
   (tokens, labels) and returns the global mean loss.

The planner's errors (no feasible plan, a plan file that does not fit, a bad hardware
profile) become ConfigErrors naming the `[parallelism]` key to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from parallel.auto.api import AutoParallel
from parallel.auto.config import PlannerConfig
from parallel.auto.cost import ProfileError
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.plan.html import save_html
from parallel.auto.problem.placement_problem import MemoryLimitError, PlanningError
from parallel.auto.request import BaseJob, PlanRequest, data_degree, planning, resolve_planner
from parallel.auto.runtime import RuntimeOptions
from parallel.mesh import CP
from parallel.precision import is_mixed, mixed_precision_policy

from .config import ConfigError, JobConfig, load_config
from .device import gpu_profile

logger = logging.getLogger("autotitan")


def planner_mp_policy(training_cfg: Any) -> Optional[MixedPrecisionPolicy]:
    """The `[training]` policy for the planner (None when training is plain fp32)."""
    policy = mixed_precision_policy(training_cfg.mixed_precision_param, training_cfg.mixed_precision_reduce)
    return policy if is_mixed(policy) else None


def planner_config(job_config: JobConfig, world_size: int | None = None, device_type: str | None = None
                   ) -> PlannerConfig:
    """The job's planner settings, whole: `[parallelism]`'s, with `[optimizer] implementation`;
    given the job's world size, resolved (config.resolve_planner: hardware "auto" is this
    GPU's shipped profile or this machine measured with every rank, cached)."""
    planner = job_config.parallelism.planner.replace(optimizer=job_config.optimizer.implementation)
    if world_size is None:
        return planner
    return resolve_planner(planner, world_size, device_type, recalibrate=job_config.parallelism.recalibrate,
                           gpu_profile=gpu_profile)


def plan_request(job_config: JobConfig, mesh: DeviceMesh | None = None, *, local_batch_size: int | None = None,
                 seq_len: int | None = None, dp_degree: int | None = None) -> PlanRequest:
    """The planning request of this job (on `mesh`: its settings resolved for that mesh, see
    planner_config; its data degree, else `dp_degree`, sets the micro-batches of `[training]
    global_batch_size`)."""
    planner = planner_config(job_config, *((math.prod(mesh.shape), getattr(mesh, "device_type", None))
                                           if mesh is not None else ()))
    t = job_config.training
    runtime = runtime_options(job_config)
    dp = data_degree(mesh) if mesh is not None else dp_degree
    if dp is not None:  # gradient accumulation: the step graph runs without reductions, their sum is held
        runtime = dataclasses.replace(runtime, micro_batches=t.micro_batches(dp))
    return PlanRequest(local_batch_size=local_batch_size or t.local_batch_size, seq_len=seq_len or t.seq_len,
                       planner=planner, runtime=runtime, mp_policy=planner_mp_policy(t))


def runtime_options(job_config: JobConfig) -> RuntimeOptions:
    """How the plan runs, from the job: AC, resharding, overlap, Inductor compilation (the
    request builder adds the load-balanced sequence order of a cp axis)."""
    ac, par, t = job_config.activation_checkpoint, job_config.parallelism, job_config.training
    return RuntimeOptions(ac_mode=ac.resolved(par.mode), ac_option=ac.selective_ac_option,
                          reshard_after_forward=par.reshard_after_forward,
                          overlap=par.overlap, reduce_bucket_bytes=int(par.reduce_bucket_mb * 2**20),
                          compile=t.compile, compile_fallback=t.compile_fallback,
                          compile_mode=t.compile_mode)


def base_job(job_config: JobConfig) -> BaseJob:
    """What a sweep or the mesh search takes from this job: its model and planning request."""
    m = job_config.model
    gb = job_config.training.global_batch_size
    return BaseJob(model=m.name, flavor=m.flavor, model_args=tuple(sorted(m.arg_overrides().items())),
                   request=plan_request(job_config), global_batch_size=gb if gb > 0 else None)


def load_base_job(config: str | None) -> BaseJob:
    """:func:`base_job` of a job config by name or path (ConfigError when it cannot be read)."""
    return base_job(load_config(config, validate=False))


def plan_digest(plan: Plan) -> str:
    """A short hash of the plan without its timings and its simulated step (derived from the
    rest, and absent from plan files saved before it was kept): equal on ranks that hold the same plan."""
    d = plan.to_json()
    d.pop("timings", None)
    d.pop("timeline", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def auto_parallelize_for_training(model: nn.Module, mesh: Optional[DeviceMesh], job_config: JobConfig,
                                  sample_batch: Any, constraints: Optional[Callable[[AutoParallel], None]] = None,
                                  *, source: Optional["PlanSource"] = None) -> tuple[nn.Module, str]:
    """Plan (or replay a plan for) `model` on `mesh`: (the ParallelModule, where its plan came from).

    sample_batch: the per-rank (tokens, labels) of the data loader; the global batch is
    the local one times the data-parallel degree. Without a mesh (single process) the
    model is returned unchanged. Planner errors are raised as ConfigErrors on every rank.
    `source`: where the plan comes from when it is not `parallelism.plan_file` or a fresh
    solve (a plan of this job for this shape, a replay at a new shape, the run's plan).
    """
    if mesh is None:
        logger.info("parallelism.mode = auto on a single process: nothing to plan, training the model as is")
        return model, "not planned (a single process)"
    _check_supported(job_config, mesh)
    with planner_errors(job_config):
        return _plan_and_apply(model, mesh, job_config, sample_batch, constraints, source or PlanSource())


@contextlib.contextmanager
def planner_errors(job_config: JobConfig) -> Iterator[None]:
    """The planner's errors as the ConfigError naming the `[parallelism]` key to change: a plan
    file that does not fit, no feasible plan, a bad hardware profile."""
    par, src = job_config.parallelism, job_config.source
    try:
        yield
    except PlanMismatchError as e:
        raise ConfigError(f"{src}: 'parallelism.plan_file' = {par.plan_file!r}: {e}") from None
    except PlanningError as e:
        raise _planning_error(job_config, e) from None
    except ProfileError as e:
        raise ConfigError(f"{src}: 'parallelism.hardware' = {par.planner.hardware!r}: {e}") from None


@dataclass
class PlanSource:
    """Where the plan comes from, first match wins: `cached` (a plan this job made for this
    very shape: applied as is), `replay` (the current plan's placements, re-priced and kept
    at a new shape), `parallelism.plan_file` (when `resuming` on another world size or
    sequence length and it does not fit: re-planned, as logged), else a fresh solve on rank 0."""

    cached: Optional[Plan] = None
    replay: Optional[Plan] = None
    resuming: bool = False


def _check_supported(job_config: JobConfig, mesh: DeviceMesh) -> None:
    """Refuse what the planner's inputs cannot express: a sequence the load-balanced CP order
    (2 chunks per cp rank) does not divide."""
    cp, seq = job_config.parallelism.degrees.context_parallel_degree, job_config.training.seq_len
    if CP in (mesh.mesh_dim_names or ()) and seq % (2 * cp):
        raise ConfigError(
            f"{job_config.source}: 'parallelism.context_parallel_degree' = {cp}: does not divide the sequence: "
            f"training.seq_len = {seq} must be a multiple of {2 * cp} (2 load-balanced chunks per cp rank); "
            "change [training] seq_len or the degree")


def _planning_error(job_config: JobConfig, e: PlanningError) -> ConfigError:
    """No feasible plan: name the budget keys the user set (or the mode) and the fix."""
    p = job_config.parallelism.planner
    if isinstance(e, MemoryLimitError):  # the message says what does not fit and what to change
        what = (f"'parallelism.memory_limit_gib' = {p.memory_limit_gib}" if p.memory_limit_gib is not None
                else f"'parallelism.hardware' = {p.hardware!r} (the profile's memory_limit_gib; "
                     "parallelism.memory_limit_gib overrides it)")
        return ConfigError(f"{job_config.source}: {what}: {e}")
    budgets = [f"'parallelism.{k}' = {getattr(p, k)}" for k in ("memory_budget_low", "memory_budget_high")
               if getattr(p, k) is not None]
    if budgets:
        what = " and ".join(budgets)
        fix = "loosen the budget (a fraction of the parameters' bytes per device) or unset it"
    else:
        what, fix = "'parallelism.mode' = 'auto'", 'change the parallelism degrees, or use mode = "manual"'
    return ConfigError(f"{job_config.source}: {what}: the planner finds no plan ({e}); {fix}")


def _plan_and_apply(model: nn.Module, mesh: DeviceMesh, job_config: JobConfig, sample_batch: Any,
                    constraints: Optional[Callable[[AutoParallel], None]], source: PlanSource
                    ) -> tuple[nn.Module, str]:
    """Trace, get the plan (replayed, or solved on rank 0 and broadcast), check, log, apply."""
    par = job_config.parallelism
    tokens, _ = sample_batch
    saved = Plan.load(par.plan_file) if par.plan_file else None  # a bad file fails before tracing
    request = plan_request(job_config, mesh, local_batch_size=tokens.shape[0], seq_len=tokens.shape[1])
    with planning(model, mesh, request) as autop:
        if constraints is not None:
            constraints(autop)
        g_inputs = autop.input_fn
        input_shapes = [[list(x.shape), str(x.dtype)] for x in g_inputs]
        if source.cached is not None:
            source.cached.check_compatible(model=model, mesh=mesh, input_shapes=input_shapes, source="the cached plan")
            plan, how = source.cached, f"taken from this job's plan for inputs {input_shapes}"
        elif source.replay is not None:
            plan = autop.replay_placement(source.replay)
            how = f"replayed (the previous plan's placements, re-priced for inputs {input_shapes})"
        elif saved is not None and _fitting_plan_file(saved, autop, input_shapes, par.plan_file, source.resuming):
            plan, how = saved, f"loaded from {par.plan_file}"
        else:
            plan = _solve_on_rank0(autop)
            how = f"solved by {plan.solver} ({plan.status}) for mesh {tuple(mesh.shape)}, inputs {input_shapes}"
        digest = plan_digest(plan)
        _check_agreement(digest)
        if _rank() == 0:
            _log_and_save(plan, how, digest, Path(job_config.job.dump_folder) / job_config.job.name)
        return autop.apply_placement(plan), how


def _solve_on_rank0(autop: AutoParallel) -> Plan:
    """Rank 0 solves and broadcasts the plan (see solve_in_group)."""
    return solve_in_group(autop, None)


def solve_in_group(autop: AutoParallel, group: Optional[dist.ProcessGroup]) -> Plan:
    """The first rank of `group` (None: of the world) solves and broadcasts the plan, or its
    error: then every rank raises that error (instead of waiting forever in the broadcast)."""
    payload: list[Any] = [None]
    error: Optional[Exception] = None
    first = (dist.get_rank(group) if group is not None else _rank()) == 0
    if first:
        try:
            payload = [autop.optimize_placement(verbose=True).to_json()]
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            payload = [_sendable(e)]
    if (dist.get_world_size(group) if group is not None else _world()) > 1:
        dist.broadcast_object_list(payload, group=group, group_src=0)
    if error is not None:
        raise error
    if isinstance(payload[0], Exception):
        raise payload[0]
    return Plan.from_json(payload[0])


def _fitting_plan_file(saved: Plan, autop: AutoParallel, input_shapes: list, path: str, resuming: bool
                       ) -> Optional[Plan]:
    """`parallelism.plan_file` when it fits this model, mesh and inputs. When it does not: a
    resumed job whose shape changed (another world size, another sequence length) re-plans,
    saying so (None); a fresh job, or a plan of another model, refuses it (PlanMismatchError).
    Every rank reads the same file and decides alike."""
    saved.check_compatible(model=autop.model, source=path)  # another model is always the user's mistake
    try:
        saved.check_compatible(mesh=autop.mesh, input_shapes=input_shapes, source=path)
        return saved
    except PlanMismatchError as e:
        if not resuming:
            raise
        if _rank() == 0:
            logger.info("re-planning for this job's mesh %s and inputs %s: the job resumes on another shape and "
                        "parallelism.plan_file does not fit it (%s)", tuple(autop.mesh.shape), input_shapes, e)
        return None


def _sendable(e: Exception) -> Exception:
    """`e` itself when it pickles (the planner's errors do), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"planning failed on rank 0: {type(e).__name__}: {e}")


def _log_and_save(plan: Plan, how: str, digest: str, run_dir: Path) -> None:
    logger.info("auto-parallel plan %s, objective %.1f µs, digest %s\n%s", how, plan.objective_us, digest,
                plan.summary())
    run_dir.mkdir(parents=True, exist_ok=True)
    plan.save(str(run_dir / "plan.json"))
    logger.info("plan saved to %s", run_dir / "plan.json")
    save_html(plan, run_dir / "plan.html")
    logger.info("plan picture (parameters per mesh axis, collectives, memory) saved to %s", run_dir / "plan.html")


def _check_agreement(digest: str) -> None:
    """Every rank must apply the same plan."""
    if _world() == 1:
        return
    digests: list[Any] = [None] * _world()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks disagree on the plan: digests {digests}")
