"""Sweep specs: a TOML file of axes whose cartesian product is a list of planning points.

    [sweep]
    name = "llama3_8b_ladder"        # output folder outputs/sweeps/<name>/
    config = "llama3_8b"             # base job: model, shapes, dtypes, planner settings (its planning request)
    x = "world_size"                 # the picture's x axis (default: the first axis that varies)

    [axes]                           # every key a list (or one value); the product is swept
    world_size = [8, 16]
    mesh = ["auto", "2x4"]           # "auto": every mesh of each world size; or explicit meshes
    seq_len = [8192]

Every problem -- unknown section or key, a wrong type, a world size no mesh lays out, a
sequence longer than the model takes, a mesh of another world size -- is one
:class:`SweepSpecError` naming the file, the key, the value and the fix, raised before any
planning starts. The base job is read by the caller's `base_job(name)` (the trainer's
`trainer.auto_mode.load_base_job`: this package does not read job configs).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models import ARG_KEYS, get_model_spec, model_args
from parallel.auto.cost import ProfileError, load_hardware
from parallel.auto.request import BaseJob, PlanRequest
from parallel.auto.search.mesh_space import MeshSearchError, MeshSpec, check_world, enumerate_meshes, parse_mesh
from parallel.mesh import DATA_AXES

from .pipeline_points import PipelineChoice

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SWEEPS_DIR = Path(__file__).resolve().parents[3] / "configs" / "sweeps"
SWEEP_KEYS = {"name": str, "description": str, "config": str, "x": str, "workers": int}
MODEL_DIMS = ARG_KEYS
AXIS_KEYS = ("model", "flavor", *MODEL_DIMS, "hardware", "world_size", "mesh", "local_batch_size",
             "global_batch_size", "seq_len", "ac_mode", "memory_budget_high")
AC_MODES = ("none", "full", "selective", "auto")
BUDGET_WORDS = ("auto", "sharded")


class SweepSpecError(ValueError):
    """A sweep spec that cannot be run; the message names file, key, value and fix."""


@dataclass(frozen=True)
class Point:
    """One planning job: a model on a mesh with shapes, hardware and a budget."""

    index: int
    model: str
    flavor: str
    model_args: tuple[tuple[str, int], ...]
    mesh: MeshSpec
    request: PlanRequest  # its planner's memory_budget_high: a fraction, or None (the rule of `memory_high`)
    memory_high: float | str | None  # fraction; "auto": the trainer's rule; None: fully sharded
    vocab_size: int | None = None  # None: the flavor's
    mesh_auto: bool = False  # enumerated by the mesh search
    # a fixed global batch (mesh search, a sweep's global_batch_size axis): the request's local batch
    # is the micro-batch, `micro_batches` of them a step; a mesh whose data degree does not divide
    # it is not planned: `reject` says why (its row's status)
    global_batch_size: int | None = None
    micro_batches: int = 1
    reject: str = ""
    # "": the planner's free choice; a preset's name (point.PRESETS, e.g. "fsdp"): its plan constraints
    # applied, what the sweep compares its best point with
    preset: str = ""
    # a pipelined point (mesh with a pp axis): its schedule and microbatches; the request's local
    # batch is one microbatch of a data rank (search/pipeline_points.py)
    pipeline: PipelineChoice | None = None
    # screened on two shallow copies of the model, its figures extrapolated to its depth
    # (search/depth_scaling.py); `shallow`: one of those copies
    depth_scaled: bool = False
    shallow: bool = False

    @property
    def local_batch_size(self) -> int:
        return self.request.local_batch_size

    @property
    def data_degree(self) -> int:
        return math.prod(self.mesh.shape[i] for i in self.mesh.data_axes())

    @property
    def micro_global_batch(self) -> int:
        """The samples of one planned step graph over all data ranks (what is traced)."""
        return self.local_batch_size * self.data_degree

    @property
    def seq_len(self) -> int:
        return self.request.seq_len

    @property
    def ac_mode(self) -> str:
        return self.request.runtime.ac_mode

    @property
    def hardware(self) -> Any:
        """A profile name, a path, or a HardwareProfile."""
        return self.request.planner.hardware

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: the fixed global batch, else local x data degree x micro-batches."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.micro_global_batch * self.micro_batches


@dataclass
class SweepSpec:
    name: str
    source: str
    axes: dict[str, list]
    points: list[Point]
    x: str
    workers: int = 2
    description: str = ""
    config: str | None = None  # the base job config the spec names (None: the trainer's default)


def resolve_sweep_path(spec: str) -> Path:
    """A path, or a bare name under configs/sweeps/ (with or without .toml)."""
    for p in (Path(spec), Path(spec + ".toml"), SWEEPS_DIR / spec, SWEEPS_DIR / (spec + ".toml")):
        if p.is_file():
            return p
    known = sorted(p.stem for p in SWEEPS_DIR.glob("*.toml")) if SWEEPS_DIR.is_dir() else []
    raise SweepSpecError(f"sweep spec {spec!r} not found (a path, or a name under configs/sweeps/); known: "
                         f"{', '.join(known) or 'none'}")


def load_sweep(spec: str, base_job: Callable[[str | None], BaseJob]) -> SweepSpec:
    """Read, validate and expand a sweep spec (SweepSpecError on any problem); `base_job(name)`
    reads the job config the spec names (raising ValueError, e.g. a ConfigError, when it cannot)."""
    path = resolve_sweep_path(spec)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SweepSpecError(f"{path}: not valid TOML: {e}") from None
    return sweep_from_dict(data, str(path), base_job)


def sweep_from_dict(data: dict, source: str, base_job: Callable[[str | None], BaseJob]) -> SweepSpec:
    """Validate the parsed TOML of a spec and expand its points."""
    for section, table in data.items():
        if section not in ("sweep", "axes") or not isinstance(table, dict):
            raise SweepSpecError(f"{source}: unknown section or top-level key {section!r}; a sweep spec has the "
                                 "sections [sweep] and [axes]")
    head = _check_head(data.get("sweep", {}), source)
    axes = _check_axes(data.get("axes", {}), source)
    try:
        base = base_job(head.get("config"))
    except ValueError as e:
        raise SweepSpecError(f"{source}: 'sweep.config' = {head.get('config')!r}: {e}") from None
    points = expand_points(axes, base, source)
    varying = [k for k in AXIS_KEYS if len(axes.get(k, [])) > 1]
    x = head.get("x") or (varying[0] if varying else "mesh")
    if x not in AXIS_KEYS:
        raise SweepSpecError(f"{source}: 'sweep.x' = {x!r} is not an axis; axes: {', '.join(AXIS_KEYS)}")
    name = head.get("name") or Path(source).stem
    return SweepSpec(name=name, source=source, axes=axes, points=points, x=x, workers=head.get("workers", 2),
                     description=head.get("description", ""), config=head.get("config"))


def _check_head(head: dict, source: str) -> dict:
    for key, value in head.items():
        if key not in SWEEP_KEYS:
            raise SweepSpecError(f"{source}: unknown key 'sweep.{key}' = {value!r}; keys of [sweep]: "
                                 f"{', '.join(SWEEP_KEYS)}")
        if not isinstance(value, SWEEP_KEYS[key]) or isinstance(value, bool):
            raise SweepSpecError(f"{source}: 'sweep.{key}' = {value!r} must be a {SWEEP_KEYS[key].__name__}")
    if head.get("workers", 1) < 1:
        raise SweepSpecError(f"{source}: 'sweep.workers' = {head['workers']!r} must be >= 1")
    return head


def _check_axes(axes: dict, source: str) -> dict[str, list]:
    out = {}
    for key, value in axes.items():
        if key not in AXIS_KEYS:
            raise SweepSpecError(f"{source}: unknown key 'axes.{key}' = {value!r}; keys of [axes]: "
                                 f"{', '.join(AXIS_KEYS)}")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise SweepSpecError(f"{source}: 'axes.{key}' = [] is empty; give at least one value or remove the key")
        for v in values:
            _check_axis_value(key, v, source)
        out[key] = values
    return out


def _check_axis_value(key: str, v: Any, source: str) -> None:
    where = f"{source}: 'axes.{key}' has the value {v!r}"
    if key in ("model", "flavor", "hardware", "mesh", "ac_mode"):
        if not isinstance(v, str):
            raise SweepSpecError(f"{where}: must be a string")
        if key == "ac_mode" and v not in AC_MODES:
            raise SweepSpecError(f"{where}: must be one of {', '.join(AC_MODES)}")
    elif key == "memory_budget_high":
        if parse_budget(v) is _BAD:
            raise SweepSpecError(f"{where}: must be a fraction > 0 (0.5, \"1/32\"), \"auto\" (the trainer's rule) "
                                 "or \"sharded\" (fully sharded)")
    elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise SweepSpecError(f"{where}: must be an integer >= 1")


_BAD = object()


def parse_budget(v: Any) -> Any:
    """0.5, "1/32" -> float; "auto" -> "auto"; "sharded" -> None; anything else -> _BAD."""
    if isinstance(v, str):
        if v in BUDGET_WORDS:
            return None if v == "sharded" else v
        num, _, den = v.partition("/")
        try:
            v = float(num) / float(den or 1)
        except (ValueError, ZeroDivisionError):
            return _BAD
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        return _BAD
    return float(v)


def expand_points(axes: dict[str, list], base: BaseJob, source: str) -> list[Point]:
    """The cartesian product of the axes (missing ones take the base job's value), each
    combination checked: model arguments, sequence length, hardware, meshes."""
    req = base.request
    models = _model_combos(axes, base, source)
    hardware = [_load_profile(h, source) for h in axes.get("hardware", [req.planner.hardware])]
    if "global_batch_size" in axes and "local_batch_size" in axes:
        raise SweepSpecError(f"{source}: [axes] has both local_batch_size and global_batch_size; give one: a fixed "
                             "global batch sets each mesh's local batch (global / its data degree)")
    globals_ = axes.get("global_batch_size", [None])
    lbs = axes.get("local_batch_size", [req.local_batch_size])
    seqs = axes.get("seq_len", [req.seq_len])
    acs = axes.get("ac_mode", [req.runtime.ac_mode])
    default_budget = req.planner.memory_budget_high if req.planner.memory_budget_high else "auto"
    budgets = [parse_budget(b) for b in axes.get("memory_budget_high", [default_budget])]
    for (name, flavor, dims), seq in itertools.product(models, seqs):
        _check_seq(name, flavor, dims, seq, source)
    points: list[Point] = []
    for (name, flavor, dims), (hw_name, hw) in itertools.product(models, hardware):
        for (mesh, auto), lb, gb, seq, ac, budget in itertools.product(_meshes(axes, hw, source), lbs, globals_,
                                                                       seqs, acs, budgets):
            point = Point(index=len(points), model=name, flavor=flavor, model_args=dims, mesh=mesh,
                          request=point_request(req, lb, seq, ac, hw_name, budget), memory_high=budget,
                          mesh_auto=auto)
            points.append(point if gb is None else with_global_batch(point, gb))
    return points


def with_global_batch(point: Point, global_batch: int, micro_batches: int = 1) -> Point:
    """The point at a fixed global batch: local batch = global / (its data degree x
    ``micro_batches``); a mesh whose data degree does not divide the global batch is a point
    that is not planned (``reject`` says why: its row's status)."""
    d = point.data_degree
    if global_batch % (d * micro_batches):
        data = ",".join(f"{n}={s}" for n, s in zip(point.mesh.names, point.mesh.shape) if n in DATA_AXES) or "none"
        why = (f"not run: global batch {global_batch} is not divisible by the data degree {d} ({data})" if
               global_batch % d else f"not run: {global_batch // d} samples per data rank are not "
               f"{micro_batches} micro-batches")
        return dataclasses.replace(point, global_batch_size=global_batch, micro_batches=micro_batches, reject=why)
    local = global_batch // (d * micro_batches)
    runtime = dataclasses.replace(point.request.runtime, micro_batches=micro_batches)  # the estimate holds the sum
    return dataclasses.replace(point, request=dataclasses.replace(point.request, local_batch_size=local,
                                                                  runtime=runtime),
                               global_batch_size=global_batch, micro_batches=micro_batches, reject="")


def with_choice(point: Point, choice: PipelineChoice, per_rank: int) -> Point:
    """`point` (at its global batch) as a pipelined point: its planned batch is one microbatch
    of each data rank."""
    req = point.request
    rows = per_rank // choice.n_microbatches
    return dataclasses.replace(point, pipeline=choice, request=dataclasses.replace(req, local_batch_size=rows))


def more_micro_batches(point: Point) -> Point | None:
    """The point with the next larger number of micro-batches that divides its per-rank batch
    (a smaller local batch: less activation memory), or None when it is at one sample each."""
    if point.global_batch_size is None or point.reject or point.pipeline is not None:
        return None  # a pipelined point's other microbatch counts are points of their own
    per_rank = point.global_batch_size // point.data_degree
    m = next((m for m in range(point.micro_batches + 1, per_rank + 1) if per_rank % m == 0), None)
    return None if m is None else with_global_batch(point, point.global_batch_size, m)


def point_request(base: PlanRequest, local_batch_size: int, seq_len: int, ac_mode: str, hardware: Any,
                  memory_high: float | str | None) -> PlanRequest:
    """The base job's request at a point's shapes, AC mode, hardware and budget ("auto" and
    None, fully sharded, leave the planner's budget unset: the point applies its rule)."""
    planner = base.planner.replace(hardware=hardware,
                                   memory_budget_high=memory_high if isinstance(memory_high, float) else None)
    return dataclasses.replace(base, local_batch_size=local_batch_size, seq_len=seq_len, planner=planner,
                               runtime=dataclasses.replace(base.runtime, ac_mode=ac_mode))


def _model_combos(axes: dict[str, list], base: BaseJob, source: str) -> list[tuple[str, str, tuple]]:
    combos = []
    dims = [k for k in MODEL_DIMS if k in axes]
    fixed = {k: v for k, v in base.model_args if k not in dims}
    for name, flavor, *values in itertools.product(axes.get("model", [base.model]),
                                                   axes.get("flavor", [base.flavor]),
                                                   *(axes[k] for k in dims)):
        args = {**fixed, **dict(zip(dims, values))}
        try:
            spec = get_model_spec(name)
        except ValueError as e:
            raise SweepSpecError(f"{source}: 'axes.model' has the value {name!r}: {e}") from None
        if flavor not in spec.flavors:
            raise SweepSpecError(f"{source}: 'axes.flavor' has the value {flavor!r}: no such flavor of {name}; "
                                 f"flavors: {', '.join(spec.flavors)}")
        try:
            model_args(name, flavor, **args)
        except (ValueError, TypeError, AssertionError) as e:
            key = next((k for k in args if k in str(e)), next(iter(args), "flavor"))
            raise SweepSpecError(f"{source}: 'axes.{key}' = {args.get(key, flavor)!r}: not an argument "
                                 f"{name}/{flavor} can take ({e})") from None
        combos.append((name, flavor, tuple(sorted(args.items()))))
    return combos


def _check_seq(name: str, flavor: str, dims: tuple, seq: int, source: str) -> None:
    max_seq = getattr(model_args(name, flavor, **dict(dims)), "max_seq_len", None)
    if max_seq is not None and seq > max_seq:
        raise SweepSpecError(f"{source}: 'axes.seq_len' has the value {seq}: {name}/{flavor} takes at most "
                             f"max_seq_len = {max_seq} tokens; drop the value or add max_seq_len to the axes")


def _load_profile(name: str, source: str) -> tuple[str, Any]:
    if name == "auto":
        raise SweepSpecError(f"{source}: 'axes.hardware' has the value 'auto' (this machine, measured with the job's "
                             "ranks): a sweep plans for named profiles; use one of configs/hardware/ or a path")
    try:
        return name, load_hardware(name)
    except ProfileError as e:
        raise SweepSpecError(f"{source}: 'axes.hardware' has the value {name!r}: {e}") from None


def _meshes(axes: dict[str, list], hw: Any, source: str) -> list[tuple[MeshSpec, bool]]:
    """The meshes of one hardware profile: explicit ones, and "auto" per world size."""
    worlds = axes.get("world_size", [])
    meshes = axes.get("mesh", ["auto"] if worlds else [])
    if not meshes:
        raise SweepSpecError(f"{source}: [axes] names neither world_size nor mesh; give world_size = [...] "
                             "(every mesh of it is planned) or mesh = [\"4x8\", ...]")
    out: list[tuple[MeshSpec, bool]] = []
    for m in meshes:
        if m == "auto":
            if not worlds:
                raise SweepSpecError(f"{source}: 'axes.mesh' has the value 'auto' but no axes.world_size; "
                                     "give the world sizes to search")
            for w in worlds:
                try:
                    out += [(s, True) for s in enumerate_meshes(w, hw.gpus_per_node)]
                except MeshSearchError as e:
                    raise SweepSpecError(f"{source}: 'axes.world_size' has the value {w} ({hw.name}): {e}") from None
            continue
        try:
            spec = parse_mesh(m)
            check_world(spec.world, hw.gpus_per_node)
        except MeshSearchError as e:
            raise SweepSpecError(f"{source}: 'axes.mesh' has the value {m!r} ({hw.name}): {e}") from None
        if worlds and spec.world not in worlds:
            raise SweepSpecError(f"{source}: 'axes.mesh' has the value {m!r} ({spec.world} devices), not one of "
                                 f"axes.world_size {worlds}; add {spec.world} or drop the mesh")
        out.append((spec, False))
    missing = [w for w in worlds if all(s.world != w for s, _ in out)]
    if missing:
        raise SweepSpecError(f"{source}: 'axes.world_size' has {missing} with no mesh in axes.mesh; add \"auto\" "
                             "or a mesh of that many devices")
    return out
