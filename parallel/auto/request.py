"""One planning request, built one way for every entry point.

    request = PlanRequest(local_batch_size=2, seq_len=8192, planner=PlannerConfig(hardware="h100"),
                          runtime=RuntimeOptions(ac_mode="full"), mp_policy=bf16_policy)
    with planning(model, mesh, request) as autop:
        plan = autop.optimize_placement()

The trainer, `scripts/plan.py`, sweeps, the mesh search and the bench scripts all ask the
planner through :func:`planning`, so they plan the same problem for the same job: the global
inputs (the local batch times the data-parallel degree; with a `cp` axis the sequence in
load-balanced order and its RoPE positions), the inputs' placements (batch-sharded on the
data axes, as the data loader feeds them), the loss, the local_map regions, the parameter
budget (the planner's, else free when every rank could hold all model states), and how the
plan will run. :func:`request_key` hashes all of it, with the planner's own source files, for
plan caches.

Every "choose for me" setting is made concrete here, once (:func:`resolve_planner`): the
trainer, the dry run, `scripts/plan.py` and :func:`planning` itself call it, and the planner
below records the value it returns.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from parallel._torch import quiet_sequential_redistribute_warnings
from parallel.auto.api import AutoParallel, lm_loss, lm_loss_positions
from parallel.auto.config import SIMULATED_GPU_PROFILE, PlannerConfig, resolve_planner  # noqa: F401 (re-exported)
from parallel.auto.cost import HardwareProfile
from parallel.auto.regions import CP_ATTENTION, marked_regions
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.trace.gc_pause import collector_paused
from parallel.mesh import CP, DATA_AXES

DATA_AXIS_NAMES = (*DATA_AXES, "dp")
"""Mesh axes the data loader splits the batch over ("dp": the one-word name scripts use)."""
STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient and AdamW's two moments
REPLICATED_STATES_SHARE = 0.25  # of a device's memory, at most, for fully replicated model states
SOURCE_ROOTS = ("parallel", "models")
"""Packages whose source decides a plan: a plan cache key includes their files' hash."""


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for, besides the model and the mesh: the per-rank batch and
    sequence, the planner's settings, how the plan will run, and the mixed precision."""

    local_batch_size: int
    seq_len: int
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    mp_policy: MixedPrecisionPolicy | None = None


@dataclass(frozen=True)
class BaseJob:
    """A training job as the planner sees it: the model and its planning request (shapes,
    planner settings, runtime, mixed precision); what sweeps and the mesh search vary."""

    model: str
    flavor: str
    model_args: tuple[tuple[str, int], ...]
    request: PlanRequest
    global_batch_size: int | None = None  # the job's [training] global_batch_size (None: not set)


@dataclass(frozen=True)
class PlannerInputs:
    """What the planner is handed for a request on a mesh."""

    inputs: tuple[torch.Tensor, ...]  # global-shaped meta tensors: tokens, labels (, positions)
    placements: list[tuple]  # one per input
    loss_fn: Callable[..., torch.Tensor]
    regions: tuple[str, ...]
    runtime: RuntimeOptions  # the request's, with the load-balanced order of a cp axis


def data_axes(mesh: DeviceMesh) -> list[int]:
    """The mesh axes the batch is split over."""
    return [i for i, n in enumerate(mesh.mesh_dim_names or ()) if n in DATA_AXIS_NAMES]


def data_degree(mesh: DeviceMesh) -> int:
    """Data-parallel ranks: the product of the data axes' sizes."""
    d = 1
    for i in data_axes(mesh):
        d *= mesh.shape[i]
    return d


def cp_degree(mesh: DeviceMesh | None) -> int:
    """Size of the mesh's `cp` axis (1 without one): the sequence is then fed load-balanced."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.shape[names.index(CP)] if CP in names else 1


def data_placements(mesh: DeviceMesh) -> tuple:
    """Shard(0) (batch) on the data axes, Replicate on the others."""
    axes = data_axes(mesh)
    return tuple(Shard(0) if i in axes else Replicate() for i in range(mesh.ndim))


def planner_regions(model: nn.Module, cp: bool) -> tuple[str, ...]:
    """The model's marked local_map regions the planner traces as one node each: MoE dispatch
    always; causal attention only when a cp axis may shard the sequence (otherwise attention
    stays plain ATen ops, sharded on batch and heads by DTensor's own rules)."""
    regions = tuple(r for r in marked_regions(model) if r != CP_ATTENTION)
    return regions + ((CP_ATTENTION,) if cp else ())


def planner_inputs(model: nn.Module, mesh: DeviceMesh, request: PlanRequest) -> PlannerInputs:
    """The global inputs, their placements, the loss and the regions of `request` on `mesh`."""
    gshape = (request.local_batch_size * data_degree(mesh), request.seq_len)
    inputs: tuple = (torch.zeros(gshape, dtype=torch.long, device="meta"),
                     torch.zeros(gshape, dtype=torch.long, device="meta"))
    pl = data_placements(mesh)
    placements, loss_fn, cp = [pl, pl], lm_loss, cp_degree(mesh)
    if cp > 1:  # the sequence in load-balanced order with its RoPE positions; attention a region
        inputs += (torch.zeros(request.seq_len, dtype=torch.long, device="meta"),)
        placements.append(tuple(Replicate() for _ in range(mesh.ndim)))
        loss_fn = lm_loss_positions
    runtime = dataclasses.replace(request.runtime, load_balance=cp)
    return PlannerInputs(inputs, placements, loss_fn, planner_regions(model, cp=cp > 1), runtime)


def default_memory_high(num_params: int, hw: HardwareProfile) -> float | None:
    """The unset parameter budget: free (1.0: the planner may replicate parameters when that
    is faster) when every rank could hold all model states (parameters, gradients, optimizer)
    in a quarter of its memory; otherwise None, fully sharded, as AutoParallel defaults."""
    states = STATE_BYTES_PER_PARAM * num_params
    return 1.0 if states <= REPLICATED_STATES_SHARE * hw.memory_bytes else None


@contextmanager
def planning(model: nn.Module, mesh: DeviceMesh, request: PlanRequest, *, graph: Any = None
             ) -> Iterator[AutoParallel]:
    """The entered AutoParallel of `request`: inputs constrained, the parameter budget set.
    `graph`: a joint graph traced earlier for this model and these global inputs. Python's
    garbage collector is paused inside (gc_pause.py: its walks of the planner's heap)."""
    quiet_sequential_redistribute_warnings()  # torch's per-mesh warning: once per process, in our words
    ins = planner_inputs(model, mesh, request)
    planner = resolve_planner(request.planner, math.prod(mesh.shape), getattr(mesh, "device_type", None))
    with collector_paused(), AutoParallel(model, ins.inputs, mesh, loss_fn=ins.loss_fn, planner=planner,
                                          runtime=ins.runtime, mp_policy=request.mp_policy, regions=ins.regions,
                                          graph=graph) as autop:
        autop.add_input_constraints(ins.placements)
        if planner.memory_budget_low is None and planner.memory_budget_high is None:
            high = default_memory_high(sum(p.numel() for p in model.parameters()), autop.cost_model().hw)
            if high is not None:
                autop.add_parameter_memory_constraint(high=high)  # memory is no object: let speed decide
        yield autop


def request_key(model: dict[str, Any], mesh: tuple[tuple[int, ...], tuple[str, ...]], request: PlanRequest) -> str:
    """Hash of everything that decides a plan: the model (`model`: its name, flavor and
    arguments), the mesh (shape, axis names), the whole request, torch's version and the
    planner's own source files."""
    mp = request.mp_policy
    d = {"model": model, "mesh": [list(mesh[0]), list(mesh[1])], "local_batch_size": request.local_batch_size,
         "seq_len": request.seq_len, "planner": request.planner.key(), "runtime": dataclasses.asdict(request.runtime),
         "mp": None if mp is None else [str(mp.param_dtype), str(mp.reduce_dtype)],
         "torch": torch.__version__, "source": source_hash()}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Hash of the planner's and the models' source files (an edit invalidates cached plans)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in SOURCE_ROOTS:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]
