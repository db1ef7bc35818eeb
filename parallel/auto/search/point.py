"""Plan one sweep point on a fake world and turn the plan into a table row; cache both.

Each point is planned in a fake process group of its world size (no GPU): the model is
built on meta, traced once per (model, global batch, sequence) in a process (the joint
graph does not depend on the mesh, the hardware or the budget, so points differing only
in those reuse it), and solved by the planner. The plan and its row are stored under a
hash of everything that decides the plan (:func:`point_key`), written then renamed, so a
re-run plans only new points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from models import build_model, model_args, transformer_blocks
from parallel.auto.api import fake_world
from parallel.auto.cost import load_hardware
from parallel.auto.plan import Plan, linear_roles
from parallel.auto.plan.pipeline import PipelinePlan
from parallel.auto.problem.placement_problem import MemoryLimitError, PlanningError
from parallel.auto.request import planning, request_key
from parallel.auto.search import depth_scaling, pipeline_points, presets
from parallel.auto.search.mesh_space import uses_context_parallel
from parallel.auto.stage_plans import PipelineStages
from parallel.cache_dir import cache_root
from parallel.mesh import DATA_AXES, PP, TP

from .spec import Point

DEFAULT_CACHE = cache_root() / "plans"

_TRACES: dict[tuple, Any] = {}  # this process's last joint graph (two for shallow copies), by trace key
_STATS = {"traced": 0, "reused": 0}
_NEIGHBOURS: dict[tuple, Plan] = {}  # this process's last plan per model and mesh: the next one's warm start
NEIGHBOURS_KEPT = 16
PRESETS: dict[str, Any] = {
    # FSDP-shaped: parameters fully sharded, gathered for every matmul; activations batch-sharded on the data axes
    "fsdp": lambda autop: presets.fsdp(autop, _axes_of(autop, DATA_AXES)),
    # FSDP + TP (TorchTitan's 70B / 405B shape): Megatron projections on tp, sharded on the data axes too
    "fsdp_tp": lambda autop: presets.megatron(autop, _axes_of(autop, (TP,))[0], fsdp_other_axes=True,
                                              data_axes=_axes_of(autop, DATA_AXES)),
}
"""A point's `preset` -> how it constrains the planner (parallel/auto/search/presets.py); it
is applied to the planner of the point's mesh (a pipelined point: of each stage's mesh)."""


def _axes_of(autop: Any, names: tuple[str, ...]) -> list[int]:
    return [i for i, n in enumerate(autop.mesh.mesh_dim_names or ()) if n in names]


def point_key(point: Point) -> str:
    """Hash of what decides the point's plan: the model, the mesh, the whole planning request
    (its "sharded" budget included), torch's version and the planner's source files."""
    model = {"name": point.model, "flavor": point.flavor, "args": list(point.model_args), "vocab": point.vocab_size,
             "sharded": point.memory_high is None}
    if point.micro_batches > 1:  # the plan is the micro-batch's; the row's step is all of them
        model["micro_batches"] = point.micro_batches
    if point.preset:  # constrained to a preset's shape (the keys of free points are unchanged)
        model["preset"] = point.preset
    if point.pipeline is not None:  # the schedule and microbatches of a pipelined point
        model["pipeline"] = [point.pipeline.schedule, point.pipeline.n_microbatches]
    if point.depth_scaled:  # priced on shallow copies (no plan of its own)
        model["depth_scaled"] = list(depth_scaling.SCREEN_DEPTHS)
    return request_key(model, (point.mesh.shape, point.mesh.names), point.request)


def trace_key(point: Point) -> tuple:
    """What the joint graph depends on (not the mesh, hardware, budget or AC mode; only
    whether the mesh has a cp axis: then the graph takes positions and attention is a region)."""
    return (point.model, point.flavor, point.model_args, point.vocab_size, point.micro_global_batch, point.seq_len,
            uses_context_parallel(point.mesh))


def neighbour_key(point: Point) -> tuple:
    """Points whose plans warm-start each other: one model on one mesh (any budget, hardware,
    sequence or batch: placements are by node name, and the solver checks each start), free
    or shaped by one preset (a preset's plan would start a free solve far from its optimum)."""
    return (point.model, point.flavor, point.model_args, point.vocab_size, tuple(point.mesh.shape),
            tuple(point.mesh.names), uses_context_parallel(point.mesh), point.preset)


def _keep_neighbour(key: tuple, plan: Plan) -> None:
    """Keep `plan` (without its solved problem, which holds the graph) as the key's warm start."""
    plan = dataclasses.replace(plan, costs=None, memory=None)
    _NEIGHBOURS.pop(key, None)
    while len(_NEIGHBOURS) >= NEIGHBOURS_KEPT:
        _NEIGHBOURS.pop(next(iter(_NEIGHBOURS)))
    _NEIGHBOURS[key] = plan


class PlanCache:
    """Rows and plans on disk, one pair of files per point key (written, then renamed)."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else DEFAULT_CACHE

    def get(self, key: str) -> dict | None:
        try:
            return json.loads((self.folder / f"{key}.row.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def plan(self, key: str) -> Plan | None:
        return self._read(key, Plan)

    def pipeline_plan(self, key: str) -> PipelinePlan | None:
        """A pipelined point's plan (its stages' plans, the schedule)."""
        return self._read(key, PipelinePlan)

    def _read(self, key: str, kind: Any) -> Any:
        try:
            with gzip.open(self.folder / f"{key}.plan.json.gz", "rt") as f:
                return kind.from_json(json.load(f), source=f"cached plan {key}")
        except (OSError, json.JSONDecodeError, ValueError):
            return None

    def put(self, key: str, row: dict, plan: Plan | PipelinePlan | None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if plan is not None:
            tmp = self.folder / f"{key}.plan.json.gz.tmp{os.getpid()}"
            with gzip.open(tmp, "wt") as f:
                json.dump(plan.to_json(), f)
            os.replace(tmp, self.folder / f"{key}.plan.json.gz")
        tmp = self.folder / f"{key}.row.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(row, default=str))
        os.replace(tmp, self.folder / f"{key}.row.json")


def plan_point(point: Point, cache: PlanCache | None) -> dict:
    """The row of one point: from the cache, else planned (and cached). A failure is a row
    whose status says why; planning errors (no plan within the budget) are cached too."""
    if point.reject:  # a fixed global batch this mesh cannot divide: a row, not a plan
        return failure_row(point, point.reject)
    key = point_key(point)
    hit = cache.get(key) if cache is not None else None
    if hit is not None:
        return {**hit, "index": point.index, "cached": True, "key": key}
    t0, c0 = time.perf_counter(), time.process_time()
    plan = None
    try:
        plan, row = _plan_and_row(point)
    except MemoryLimitError as e:  # the planner found no layout that fits: the point's answer is "OOM"
        row = failure_row(point, "OOM")
        row["oom"], row["detail"] = True, str(e)
        if e.estimate is not None:
            row["mem_gib"], row["mem_kind"] = e.estimate.peak_bytes / 2**30, "peak"
    except PlanningError as e:
        row = failure_row(point, f"no plan: {e}")
    except Exception as e:  # noqa: BLE001 - a failing point is a row, never the end of the sweep
        row = failure_row(point, f"error: {type(e).__name__}: {e}")
        row["traceback"] = traceback.format_exc(limit=8)
        row["plan_s"] = time.perf_counter() - t0
        return row  # not cached: it may not fail next time
    row["plan_s"] = time.perf_counter() - t0
    row["cpu_s"] = time.process_time() - c0  # this process's CPU: what the point costs on an idle core
    row["key"] = key
    if cache is not None:
        cache.put(key, row, plan)
    return row


def base_row(point: Point) -> dict:
    hw = load_hardware(point.hardware)
    dims = ",".join(f"{k}={v}" for k, v in point.model_args)
    return {"index": point.index, "model": f"{point.model}/{point.flavor}" + (f"[{dims}]" if dims else ""),
            "hardware": hw.name, "world": point.mesh.world, "mesh": point.mesh.label,
            "global_batch": point.global_batch, "local_batch": point.local_batch_size,
            "micro_batches": point.micro_batches, "seq_len": point.seq_len,
            "ac_mode": point.ac_mode, "budget": point.memory_high, "cached": False, "mesh_auto": point.mesh_auto,
            **dict(point.model_args), **({"preset": point.preset} if point.preset else {}),
            **(_pipeline_columns(point) if point.pipeline is not None else {})}


def _pipeline_columns(point: Point) -> dict:
    """A pipelined row's columns: its schedule; "micro" counts the pipeline's microbatches."""
    choice = point.pipeline
    assert choice is not None
    return {"pipeline": choice.label, "pp": point.mesh.degree(PP), "schedule": choice.schedule,
            "micro_batches": choice.n_microbatches}


def failure_row(point: Point, reason: str) -> dict:
    return {**base_row(point), "status": reason, "step_ms": None, "tokens_per_s": None, "mfu": None,
            "mem_gib": None, "mem_kind": "", "oom": None, "summary": ""}


def _plan_and_row(point: Point) -> tuple[Plan | PipelinePlan | None, dict]:
    if point.depth_scaled:
        return None, _depth_scaled_row(point)
    if point.pipeline is not None:
        return _pipeline_and_row(point)
    hw = load_hardware(point.hardware)
    plan, n_params, param_bytes, budget = _plan(point, hw)
    step_s = plan.step_time_us(point.micro_batches) * 1e-6  # each micro-batch's graph, the reductions once
    tps, mfu = _rates(point, step_s, hw)
    mem, kind = memory_estimate(plan, param_bytes)
    limit = memory_limit(hw)
    row = {**base_row(point), "budget": budget, "step_ms": step_s * 1e3, "tokens_per_s": tps,
           "mfu": mfu, "mem_gib": mem / 2**30, "mem_kind": kind, "oom": mem > limit,
           "summary": one_line_summary(plan), "objective_us": plan.objective_us, "compute_us": plan.compute_us,
           "comm_us": sum(plan.comm_us.values()), "grad_reduction_us": plan.grad_reduction_us,
           "solver": plan.solver, "plan_status": plan.status,
           "timings": {k: round(v, 2) for k, v in plan.timings.items()},
           "trace_reused": plan.timings.get("trace", 0.0) == 0.0}
    row["status"] = "OOM" if row["oom"] else "ok"
    return plan, row


def _pipeline_and_row(point: Point, shallower: PipelinePlan | None = None) -> tuple[PipelinePlan, dict]:
    """A pipelined point: its pipeline's plan (every kind of stage planned, the recipe's cut) and row;
    `shallower`: the shallower screen copy's plan, whose end stages this deeper copy takes
    (PipelineStages.plan_deeper)."""
    hw = load_hardware(point.hardware)
    model, traces = _stage_traces(point)
    choice, n_layers = point.pipeline, len(transformer_blocks(model))
    assert choice is not None
    pp = point.mesh.degree(PP)
    layout = pipeline_points.layout(choice.schedule, pp, n_layers, choice.n_microbatches,
                                    point.local_batch_size * choice.n_microbatches)
    if layout is None:
        raise PlanningError(f"{choice.label} cannot run {pp} pipeline ranks")
    constrain = PRESETS[point.preset] if point.preset else None
    spec = point.mesh
    with _open_mesh(spec.world, tuple(spec.shape), tuple(spec.names)) as mesh:
        stages = PipelineStages(model, mesh, point.request, _compute_dtype(point), constrain, traces)
        pplan = stages.plan(layout, recut=False) if shallower is None else stages.plan_deeper(layout, shallower)
    step_s = pplan.step_us * 1e-6
    tps, mfu = _rates(point, step_s, hw)
    peaks = [s.peak_bytes(pplan.in_flight(s.index)) for s in pplan.stages]
    mem = max(p for p in peaks if p is not None) if any(p is not None for p in peaks) else None
    middle = pplan.stages[len(pplan.stages) // 2].plan
    row = {**base_row(point), "step_ms": step_s * 1e3, "tokens_per_s": tps, "mfu": mfu,
           "mem_gib": mem / 2**30 if mem is not None else None, "mem_kind": "peak" if mem is not None else "",
           "oom": mem is not None and mem > memory_limit(hw), "bubble_ms": pplan.bubble_us / 1e3,
           "summary": f"{choice.label} microbatches, {len(pplan.stages)} stages; a middle stage: "
                      f"{one_line_summary(middle)}",
           "objective_us": pplan.step_us, "solver": middle.solver, "plan_status": middle.status}
    row["status"] = "OOM" if row["oom"] else "ok"
    return pplan, row


def _depth_scaled_row(point: Point) -> dict:
    """A point priced on two shallow copies of its model, extrapolated to its depth
    (search/depth_scaling.py); a copy's planning error is the point's."""
    shallow, deeper = depth_scaling.shallow_copies(point)
    shallow_plan, shallow_row = _plan_and_row(shallow)
    deeper_row = (_pipeline_and_row(deeper, shallow_plan) if point.pipeline is not None else _plan_and_row(deeper))[1]
    copies = [shallow_row, deeper_row]
    hw = load_hardware(point.hardware)
    row = {**base_row(point), **depth_scaling.extrapolate(point, copies)}
    row["tokens_per_s"], row["mfu"] = _rates(point, row["step_ms"] * 1e-3, hw)
    kept = ("mem_kind", "summary", "solver", "plan_status", "budget")
    row.update({k: deeper_row[k] for k in kept if k in deeper_row})
    row["oom"] = row.get("mem_gib") is not None and row["mem_gib"] * 2**30 > memory_limit(hw)
    row["status"] = "OOM" if row["oom"] else "ok"
    row["depth_scaled"] = depth_scaling.SCREEN_DEPTHS
    row["timings"] = {k: round(sum(c.get("timings", {}).get(k, 0.0) for c in copies), 2)
                      for k in {k for c in copies for k in c.get("timings", {})}}
    return row


def _compute_dtype(point: Point) -> torch.dtype:
    mp = point.request.mp_policy
    return mp.param_dtype if mp is not None and mp.param_dtype is not None else torch.float32


def _rates(point: Point, step_s: float, hw: Any) -> tuple[float, float]:
    """(tokens per second, MFU) of a step of the point's global batch taking `step_s`."""
    tps = point.global_batch * point.seq_len / step_s if step_s > 0 else float("inf")
    args = model_args(point.model, point.flavor, **dict(point.model_args))
    try:
        fpt = float(args.flops_per_token(point.seq_len))
    except (AttributeError, TypeError):
        fpt = 6.0 * args.num_params()
    return tps, fpt * tps / (hw.peak_flops(_compute_dtype(point)) * point.mesh.world)


_STAGES: dict[tuple, Any] = {}  # this process's model(s) of pipelined points and its stages' traces


def _remember(cache: dict, key: tuple, value: Any, shallow: bool) -> None:
    """Keep `value` as this process's last entry (the last two for shallow copies, planned in pairs)."""
    while len(cache) >= (2 if shallow else 1):
        cache.pop(next(iter(cache)))
    cache[key] = value


def _stage_traces(point: Point) -> tuple[Any, dict]:
    """The model of a pipelined point (on meta) and the stage traces made for it in this process
    (a stage's trace does not depend on the inner mesh: the points of one pp degree share them)."""
    key = (point.model, point.flavor, point.model_args, point.vocab_size)
    if key not in _STAGES:
        kw = {"vocab_size": point.vocab_size} if point.vocab_size else {}
        model = build_model(point.model, point.flavor, device="meta", **dict(point.model_args), **kw)
        _remember(_STAGES, key, (model, {}), point.shallow)
    return _STAGES[key]


def _plan(point: Point, hw: Any) -> tuple[Plan, int, int, float | None]:
    """Plan the point on a fake world: (plan, parameters, parameter bytes, the budget used).
    ``plan.timings["trace"]`` is 0 when this process's last trace was reused."""
    tkey = trace_key(point)
    cached = _TRACES.get(tkey)
    kw = {"vocab_size": point.vocab_size} if point.vocab_size else {}
    model = cached[0] if cached else build_model(point.model, point.flavor, device="meta",
                                                 **dict(point.model_args), **kw)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    spec = point.mesh
    with _open_mesh(spec.world, tuple(spec.shape), tuple(spec.names)) as mesh:
        with planning(model, mesh, point.request, graph=cached[1] if cached else None) as autop:
            _STATS["reused" if cached else "traced"] += 1
            _remember(_TRACES, tkey, (model, autop.graph), point.shallow)  # an 8B trace holds ~0.5 GB
            if point.memory_high is None:  # "sharded": fully sharded, whatever the rule would free
                autop.add_parameter_memory_constraint(low=point.request.planner.memory_budget_low, high=None)
            if point.preset:
                PRESETS[point.preset](autop)
            high = autop.memory_high
            nkey = neighbour_key(point)
            warm = _NEIGHBOURS.get(nkey) if _MESHES.active else None  # within one run of points only
            plan = autop.optimize_placement(verbose=False, warm_start=warm)
            if _MESHES.active:
                _keep_neighbour(nkey, plan)
    used = high if high is not None else max(1.0 / spec.world, 0.0)
    return plan, n_params, param_bytes, used


class _OpenMeshes:
    """A fake world and mesh left open between points that share them (`points_share_meshes`):
    a mesh object that outlives a point lets the next point on that trace and mesh reuse its
    candidates and priced problem (strategies.mesh_candidates)."""

    def __init__(self) -> None:
        self.active = False
        self.key: tuple | None = None
        self.mesh: Any = None
        self.stack: contextlib.ExitStack | None = None

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.key, self.mesh, self.stack = None, None, None


_MESHES = _OpenMeshes()


@contextlib.contextmanager
def points_share_meshes() -> Iterator[None]:
    """Inside, consecutive points on one mesh plan in one fake world and on one mesh object,
    and each solve is warm-started from the last plan on that mesh shape (`neighbour_key`);
    the world is closed on exit (or when a point needs another mesh). Nested: the outer one rules."""
    if _MESHES.active:
        yield
        return
    _MESHES.active = True
    _NEIGHBOURS.clear()  # warm starts come from this run's points only
    try:
        yield
    finally:
        _MESHES.active = False
        _MESHES.close()
        _NEIGHBOURS.clear()


@contextlib.contextmanager
def _open_mesh(world: int, shape: tuple[int, ...], names: tuple[str, ...]) -> Iterator[Any]:
    """The point's mesh in a fake world: the open one when the same mesh is open
    (`points_share_meshes`), else a new one (closed after the point unless shared)."""
    key = (world, shape, names)
    if not _MESHES.active:
        with fake_world(world):
            yield init_device_mesh("cpu", shape, mesh_dim_names=names)
        return
    if _MESHES.key != key:
        _MESHES.close()
        stack = contextlib.ExitStack()
        stack.enter_context(fake_world(world))
        _MESHES.key, _MESHES.stack = key, stack
        _MESHES.mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    yield _MESHES.mesh


def memory_limit(hw: Any) -> float:
    """Bytes a device may hold: the profile's memory_limit_gib when it has one, else its memory
    (what the planner fits plans into, HardwareProfile.memory_limit)."""
    return float(hw.memory_limit)


def memory_estimate(plan: Plan, param_bytes: int) -> tuple[float, str]:
    """(bytes per device, what they count). The plan's peak estimate when it has one
    (`plan.memory.peak_bytes`); else the model states its parameter placements imply:
    parameters + gradients + AdamW's two moments, in the parameters' dtype ("states")."""
    mem = getattr(plan, "memory", None)
    if mem is not None:
        return float(mem.peak_bytes), "peak"
    return plan.memory_fraction * param_bytes * 4, "states"  # parameter, gradient, 2 moments: each its size


def one_line_summary(plan: Plan) -> str:
    """Per mesh axis, what the first block's weight matrices do there, with counts:
    ``dp_shard: FSDP (all-gather) x7 | tp: column-parallel x4, row-parallel x3``."""
    rows = [(fqn, words) for fqn, words in linear_roles(plan) if ".0." in fqn and "norm" not in fqn]
    rows = rows or linear_roles(plan)
    parts = []
    for i, axis in enumerate(plan.mesh_axis_names):
        roles = Counter(words.split("; ")[i].rsplit(" on ", 1)[0] for _, words in rows)
        parts.append(f"{axis}: " + ", ".join(f"{r} x{n}" for r, n in roles.most_common()))
    return " | ".join(parts)


def trace_stats() -> dict[str, int]:
    """Traces made and reused in this process (for the sweep's progress report)."""
    return dict(_STATS)
