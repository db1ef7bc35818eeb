"""Trainer integration of the planner: `[parallelism] mode = "auto"`.

    model = auto_parallelize_for_training(model, mesh, job_config, sample_batch)

1. The mesh comes from the degrees (`parallel/mesh.py`); its axis names are labels only:
   the planner decides what each axis does. The data loader gives every data-parallel
   rank (`dp_replicate` x `dp_shard` coordinates) its own local batch, so the tokens and
   labels are constrained to Shard(0) on those axes and Replicate on the others.
2. Rank 0 plans (trace -> candidates -> problem -> solve) with the `[parallelism]` knobs
   (hardware profile, solver, memory budget, seeding, time limit, layer clustering) and
   broadcasts the plan (JSON), or its error, which every rank then raises; every rank
   checks the plan against its own trace (same graph, same candidate menus) and all
   ranks verify they hold the identical plan. `parallelism.plan_file` replays a saved
   plan without solving; a plan made for another model, mesh or input shape is refused.
3. The plan summary and objective are logged, the plan JSON is written to
   `<dump_folder>/<job.name>/plan.json`, and the model is materialised as a
   ParallelModule (parallel/auto/runtime) whose forward takes the per-rank
   (tokens, labels) and returns the global mean loss.

The planner's errors (no feasible plan, a plan file that does not fit, a bad hardware
profile) become ConfigErrors naming the `[parallelism]` key to change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from parallel.auto.api import AutoParallel, lm_loss
from parallel.auto.contracts import marked_regions
from parallel.auto.cost import AUTO, HardwareProfile, ProfileError
from parallel.auto.cost.calibrate import profile_for_group
from parallel.auto.moe_dispatch import declare_moe_dispatch
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.plan_html import save_html
from parallel.auto.problem import PlanningError
from parallel.auto.runtime import RuntimeOptions
from parallel.mesh import CP, DATA_AXES
from parallel.precision import is_mixed, mixed_precision_policy

from .config import ConfigError, JobConfig
from .device import gpu_profile

logger = logging.getLogger("autotitan")


def data_placements(mesh: DeviceMesh) -> tuple:
    """Shard(0) (batch) on the data-parallel axes, Replicate on the others."""
    names = mesh.mesh_dim_names or ()
    return tuple(Shard(0) if n in DATA_AXES else Replicate() for n in names)


def data_degree(mesh: DeviceMesh) -> int:
    """Number of data-parallel ranks (product of the data axes' sizes)."""
    names = mesh.mesh_dim_names or ()
    d = 1
    for n, s in zip(names, mesh.shape):
        if n in DATA_AXES:
            d *= s
    return d


def planner_mp_policy(training_cfg: Any) -> Optional[MixedPrecisionPolicy]:
    """The `[training]` policy for the planner (None when training is plain fp32)."""
    policy = mixed_precision_policy(training_cfg.mixed_precision_param, training_cfg.mixed_precision_reduce)
    return policy if is_mixed(policy) else None


def planning_hardware(par: Any, mesh: DeviceMesh | None, device_type: str | None = None) -> str | HardwareProfile:
    """The cost model's profile: a named one, or with "auto" this GPU's shipped profile or
    this machine measured for the job's world size (cached; every rank takes part)."""
    if par.hardware != AUTO:
        return par.hardware
    device = torch.device(mesh.device_type if mesh is not None else device_type)
    return gpu_profile() or profile_for_group(recalibrate=par.recalibrate, device=device)


def runtime_options(job_config: JobConfig) -> RuntimeOptions:
    """How the plan runs, from the job: AC, resharding, overlap, Inductor compilation."""
    ac, par, t = job_config.activation_checkpoint, job_config.parallelism, job_config.training
    return RuntimeOptions(ac_mode=ac.mode, ac_option=ac.selective_ac_option,
                          reshard_after_forward=par.reshard_after_forward,
                          overlap=par.overlap, compile=t.compile, compile_fallback=t.compile_fallback,
                          compile_mode=t.compile_mode)


def plan_digest(plan: Plan) -> str:
    """A short hash of the plan without its timings: equal on ranks that hold the same plan."""
    d = plan.to_json()
    d.pop("timings", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def auto_parallelize_for_training(model: nn.Module, mesh: Optional[DeviceMesh], job_config: JobConfig,
                                  sample_batch: Any, constraints: Optional[Callable[[AutoParallel], None]] = None,
                                  ) -> nn.Module:
    """Plan (or replay a plan for) `model` on `mesh` and return the ParallelModule.

    sample_batch: the per-rank (tokens, labels) of the data loader; the global batch is
    the local one times the data-parallel degree. Without a mesh (single process) the
    model is returned unchanged. Planner errors are raised as ConfigErrors on every rank.
    """
    if mesh is None:
        logger.info("parallelism.mode = auto on a single process: nothing to plan, training the model as is")
        return model
    _check_supported(job_config, mesh)
    par, src = job_config.parallelism, job_config.source
    try:
        return _plan_and_apply(model, mesh, job_config, sample_batch, constraints)
    except PlanMismatchError as e:
        raise ConfigError(f"{src}: 'parallelism.plan_file' = {par.plan_file!r}: {e}") from None
    except PlanningError as e:
        raise _planning_error(job_config, e) from None
    except ProfileError as e:
        raise ConfigError(f"{src}: 'parallelism.hardware' = {par.hardware!r}: {e}") from None


def _check_supported(job_config: JobConfig, mesh: DeviceMesh) -> None:
    """Refuse what the planner's inputs cannot express; warn about ignored keys."""
    if CP in (mesh.mesh_dim_names or ()):
        raise ConfigError(
            f"{job_config.source}: 'parallelism.context_parallel_degree' > 1 with mode = "
            f'"auto": the trainer splits the sequence into load-balanced CP chunks, which the planner\'s '
            "inputs cannot express; use the degree as a data/tensor axis (data_parallel_shard_degree or "
            "tensor_parallel_degree) and let the planner choose, or mode = \"manual\"")


def _planning_error(job_config: JobConfig, e: PlanningError) -> ConfigError:
    """No feasible plan: name the budget keys the user set (or the mode) and the fix."""
    p = job_config.parallelism
    budgets = [f"'parallelism.{k}' = {getattr(p, k)}" for k in ("memory_budget_low", "memory_budget_high")
               if getattr(p, k) is not None]
    if budgets:
        what = " and ".join(budgets)
        fix = "loosen the budget (a fraction of the parameters' bytes per device) or unset it"
    else:
        what, fix = "'parallelism.mode' = 'auto'", 'change the parallelism degrees, or use mode = "manual"'
    return ConfigError(f"{job_config.source}: {what}: the planner finds no plan ({e}); {fix}")


def _plan_and_apply(model: nn.Module, mesh: DeviceMesh, job_config: JobConfig, sample_batch: Any,
                    constraints: Optional[Callable[[AutoParallel], None]] = None) -> nn.Module:
    """Trace, get the plan (replayed, or solved on rank 0 and broadcast), check, log, apply."""
    par = job_config.parallelism
    tokens, labels = sample_batch
    gshape = (tokens.shape[0] * data_degree(mesh), *tokens.shape[1:])
    g_inputs = (torch.zeros(gshape, dtype=tokens.dtype, device="meta"),
                torch.zeros(gshape, dtype=labels.dtype, device="meta"))
    saved = Plan.load(par.plan_file) if par.plan_file else None  # a bad file fails before tracing
    pl = data_placements(mesh)
    declare_moe_dispatch(par.moe_imbalance_factor)
    with AutoParallel(model, g_inputs, mesh, loss_fn=lm_loss, mp_policy=planner_mp_policy(job_config.training),
                      hardware=planning_hardware(par, mesh), solver=par.solver, time_limit=par.time_limit,
                      cluster_layers=par.cluster_layers, seed=par.seed, seed_radius=par.seed_radius,
                      seed_rounds=par.seed_rounds, runtime=runtime_options(job_config),
                      regions=marked_regions(model)) as autop:
        autop.add_input_constraints([pl, pl])
        if par.memory_budget_low is not None or par.memory_budget_high is not None:
            autop.add_parameter_memory_constraint(low=par.memory_budget_low, high=par.memory_budget_high)
        elif _states_fit_replicated(model, autop):
            autop.add_parameter_memory_constraint(high=1.0)  # memory is no object: let speed decide
        if constraints is not None:
            constraints(autop)
        if saved is not None:
            input_shapes = [[list(x.shape), str(x.dtype)] for x in g_inputs]
            saved.check_compatible(model=model, mesh=mesh, input_shapes=input_shapes, source=par.plan_file)
            plan, how = saved, f"replayed from {par.plan_file}"
        else:
            plan = _solve_on_rank0(autop)
            how = f"solved by {plan.solver} ({plan.status})"
        digest = plan_digest(plan)
        _check_agreement(digest)
        if _rank() == 0:
            _log_and_save(plan, how, digest, Path(job_config.job.dump_folder) / job_config.job.name)
        return autop.apply_placement(plan)


STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient and AdamW's two moments
REPLICATED_STATES_SHARE = 0.25  # of a device's memory, at most, for fully replicated model states


def default_memory_high(num_params: int, hw: HardwareProfile) -> float | None:
    """The unset parameter budget: free (1.0: the planner may replicate parameters when that
    is faster) when every rank could hold all model states (parameters, gradients, optimizer)
    in a quarter of its memory; otherwise None, fully sharded, as AutoParallel defaults."""
    states = STATE_BYTES_PER_PARAM * num_params
    return 1.0 if states <= REPLICATED_STATES_SHARE * hw.memory_bytes else None


def _states_fit_replicated(model: nn.Module, autop: AutoParallel) -> bool:
    """Whether the unset budget is free (:func:`default_memory_high`)."""
    return default_memory_high(sum(p.numel() for p in model.parameters()), autop.cost_model().hw) is not None


def _solve_on_rank0(autop: AutoParallel) -> Plan:
    """Rank 0 solves and broadcasts the plan, or its error: then every rank raises that
    error (instead of waiting forever in the broadcast)."""
    payload: list[Any] = [None]
    error: Optional[Exception] = None
    if _rank() == 0:
        try:
            payload = [autop.optimize_placement(verbose=True).to_json()]
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            payload = [_sendable(e)]
    if _world() > 1:
        dist.broadcast_object_list(payload, src=0)
    if error is not None:
        raise error
    if isinstance(payload[0], Exception):
        raise payload[0]
    return Plan.from_json(payload[0])


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
