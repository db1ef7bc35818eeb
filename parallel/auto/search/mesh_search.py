"""Mesh search: plan every mesh of a world size that the layout rules allow and rank them.

The meshes (parallel/auto/search/mesh_space.py: dp_replicate, dp_shard, cp, tp; a cp degree only
where the sequence splits load-balanced) are each planned as a sweep point with the job's
whole planning request (model, shapes, planner settings, runtime; cached, seeded as the
planner seeds) at the job's *global* batch, the same for every mesh (TorchTitan users fix
it; a mesh with more data ranks must not win by training a larger one): each mesh's local
batch is global / its data degree; a mesh whose data degree does not divide it is a row
saying so; a plan that does not fit is planned again with more micro-batches (gradient
accumulation; the step time counts every micro-batch's step graph and the gradient
reductions once, as the runtime runs them). Meshes are ranked by
the predicted time of that same step; those that do not fit are listed after. Used by
``scripts/plan.py --mesh auto`` and the trainer's ``[parallelism] mesh = "auto"``
(trainer/mesh_auto.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from models import model_args
from parallel.auto.cost import HardwareProfile, load_hardware
from parallel.auto.search.mesh_space import MeshOption, MeshSpec, enumerate_meshes, rank_mesh_options
from parallel.mesh import CP, DP_REPLICATE, DP_SHARD, PP, TP

from .pipeline_points import PP_SCHEDULES, choices, pipeline_meshes
from .point import PlanCache
from .recipe_shapes import RecipeShape, recipe_points, recipe_shapes
from .report import markdown_table, memory_note
from .run import Progress, run_points
from .screen import SCREEN_FROM_WORLD, VERIFY, fsdp_parent, leaders, refinements, screened, unrefined_row
from .spec import BaseJob, Point, point_request, with_choice, with_global_batch

RANK_COLUMNS = ("rank", "mesh", "pipeline", "batch x seq", "local", "micro", "step ms", "tokens/s", "MFU", "mem GiB",
                "OOM", "plan s", "status", "plan")


def search_global_batch(job: BaseJob, world: int) -> int:
    """The global batch every mesh trains: the job's ``global_batch_size``, else its local
    batch on every device as data rank (local batch x world: what the fully data-parallel
    mesh trains without accumulation)."""
    return job.global_batch_size or job.request.local_batch_size * world


def search_points(job: BaseJob, world: int, hardware: str | HardwareProfile,
                  vocab_size: int | None = None, pipelines: bool | None = None) -> list[Point]:
    """One point per candidate mesh of ``world`` devices for the job: its whole planning
    request (planner settings, runtime, mixed precision) on ``hardware``, at the job's global
    batch (:func:`search_global_batch`; local batch = global / the mesh's data degree); with
    `pipelines` (default: when the world spans nodes), one per pipelined mesh, schedule and
    microbatch count too (search/pipeline_points.py)."""
    hw = load_hardware(hardware)
    meshes = searched_meshes(world, hw.gpus_per_node, job.request.seq_len)
    points = [with_global_batch(job_point(job, i, spec, hardware), search_global_batch(job, world))
              for i, spec in enumerate(meshes)]
    if pipelines if pipelines is not None else world > hw.gpus_per_node:
        points += pipelined_points(job, world, hardware, start=len(points))
    return [dataclasses.replace(p, vocab_size=vocab_size) for p in points]


def job_point(job: BaseJob, index: int, spec: MeshSpec, hardware: str | HardwareProfile, preset: str = "") -> Point:
    """The job on mesh `spec` (its whole request on `hardware`), before its batch is fixed."""
    req = job.request
    budget = req.planner.memory_budget_high if req.planner.memory_budget_high is not None else "auto"
    request = point_request(req, req.local_batch_size, req.seq_len, req.runtime.ac_mode, hardware, budget)
    return Point(index=index, model=job.model, flavor=job.flavor, model_args=job.model_args, mesh=spec,
                 request=request, memory_high=budget, mesh_auto=True, preset=preset)


def pipelined_points(job: BaseJob, world: int, hardware: str | HardwareProfile, start: int = 0) -> list[Point]:
    """A point per pipelined mesh (pipeline_points.pipeline_meshes), schedule and microbatch
    count its data ranks' share of the global batch allows; a mesh allowing none is a row saying why."""
    hw = load_hardware(hardware)
    n_layers = model_args(job.model, job.flavor, **dict(job.model_args)).n_layers
    gb = search_global_batch(job, world)
    out: list[Point] = []
    for spec in pipeline_meshes(world, hw.gpus_per_node, n_layers):
        point = with_global_batch(job_point(job, start + len(out), spec, hardware), gb)
        out += pipelined(point, spec.degree(PP), n_layers, start + len(out))
    return out


def pipelined(point: Point, pp: int, n_layers: int, start: int) -> list[Point]:
    """`point` (at its global batch) under every schedule and microbatch count it allows, or
    itself rejected (its row says why)."""
    if point.reject:
        return [point]
    per_rank = point.global_batch // point.data_degree
    found = choices(pp, n_layers, per_rank)
    if not found:
        why = (f"not run: {per_rank} samples per data rank make no microbatch count of "
               f"{', '.join(PP_SCHEDULES)} on {pp} pipeline ranks")
        return [dataclasses.replace(point, reject=why)]
    return [dataclasses.replace(with_choice(point, c, per_rank), index=start + i) for i, c in enumerate(found)]


def searched_meshes(world: int, gpus_per_node: int, seq_len: int) -> list[MeshSpec]:
    """The meshes the search plans: dp_replicate, dp_shard, cp, tp laid out on nodes, a cp
    degree only where the load-balanced split works (seq_len a multiple of 2 x cp)."""
    specs = enumerate_meshes(world, gpus_per_node, axes=(DP_REPLICATE, DP_SHARD, CP, TP))
    return [s for s in specs if seq_len % (2 * s.degree(CP)) == 0]


def rank_rows(points: list[Point], rows: list[dict]) -> list[dict]:
    """Rows ranked: fitting meshes by predicted step time per token (``rank`` 1, 2, ...; see
    :func:`rank_mesh_options`; at one global batch for every mesh, the order of the step times
    of all micro-batches), then the dropped ones (OOM, a global batch the mesh cannot divide,
    planning failures) with ``rank`` "-" and their reason."""
    options = [MeshOption(p.mesh, r["step_ms"] * 1e3 if r.get("step_ms") is not None else None,
                          r.get("status") == "ok", r.get("status", ""), tokens=p.global_batch * p.seq_len)
               for p, r in zip(points, rows)]
    row_of = {id(o): r for o, r in zip(options, rows)}  # one mesh may be several pipelined points
    out = []
    for i, c in enumerate(rank_mesh_options(options)):
        r = dict(row_of[id(c)])
        r["rank"] = i + 1 if c.fits and c.step_us is not None else "-"
        out.append(r)
    return out


def search_meshes(job: BaseJob, world: int, hardware: str | HardwareProfile, *, workers: int = 2,
                  cache: PlanCache | None = None, vocab_size: int | None = None,
                  out: Callable[[str], None] | None = None, pipelines: bool | None = None) -> list[dict]:
    """Plan every candidate mesh (cached) and return the ranked rows (see :func:`rank_rows`);
    ``out`` prints the progress lines (default: stderr); `pipelines`: see :func:`search_points`.
    A world of SCREEN_FROM_WORLD devices or more is ranked by the screen (search/screen.py)."""
    return search_with_recipes(job, world, hardware, workers=workers, cache=cache, vocab_size=vocab_size,
                               out=out, pipelines=pipelines, recipes=False, verify=0).rows


@dataclass
class SearchResult:
    """The ranked candidates (screened, or planned in full), TorchTitan's recipe shapes priced the
    same way, and where the search screened: its leaders and the recipe shapes planned in full."""

    rows: list[dict]
    recipes: list[tuple[RecipeShape, dict]]
    screened: bool = False
    verified: list[dict] = field(default_factory=list)  # ranked by their full plans' step
    verified_recipes: list[tuple[RecipeShape, dict]] = field(default_factory=list)

    @property
    def best(self) -> dict | None:
        """The pick: the fastest fitting full plan (the verified leaders' where screened and
        verified; the screen's first where it screened alone)."""
        rows = self.verified if self.verified else self.rows
        return next((r for r in rows if r["rank"] == 1), None)


def search_with_recipes(job: BaseJob, world: int, hardware: str | HardwareProfile, *, workers: int = 2,
                        cache: PlanCache | None = None, vocab_size: int | None = None,
                        out: Callable[[str], None] | None = None, pipelines: bool | None = None,
                        recipes: bool = True, screen: bool | None = None, verify: int = VERIFY) -> SearchResult:
    """:func:`search_meshes`, and TorchTitan's recipe shapes for the job (recipe_shapes.py)
    planned in the same run (not ranked with the search's own candidates). `screen` (default:
    from SCREEN_FROM_WORLD devices) screens every candidate, then plans the `verify` best and
    the recipe shapes with the job's whole request (search/screen.py; `verify` 0: the screen alone)."""
    cache = cache if cache is not None else PlanCache()
    points = search_points(job, world, hardware, vocab_size, pipelines)
    shapes = recipe_shapes(job.model, job.flavor, world) if recipes else []
    base = dataclasses.replace(job_point(job, 0, points[0].mesh, hardware), vocab_size=vocab_size)
    extra = recipe_points(job, world, shapes, base, search_global_batch(job, world), start=len(points))
    screen = screen if screen is not None else world >= SCREEN_FROM_WORLD
    full_points, full_extra = points, extra
    if screen:
        points = [screened(p) for p in points]
        extra = [screened(p) for p in extra]
    rows, recipe_rows = _plan_candidates(points, extra, screen, workers, cache, out)
    result = SearchResult(rank_rows(points, rows), list(zip(shapes, recipe_rows)), screen)
    if screen and verify:
        by_index = {p.index: p for p in full_points}
        top = [by_index[p.index] for p in leaders(points, result.rows, verify)]
        full = run_points(top + full_extra, workers=workers, cache=cache,
                          progress=Progress(len(top) + len(full_extra), out))
        result.verified = rank_rows(top, full[:len(top)])
        result.verified_recipes = list(zip(shapes, full[len(top):]))
    return result


def _plan_candidates(points: list[Point], extra: list[Point], screen: bool, workers: int, cache: PlanCache,
                     out: Callable[[str], None] | None) -> tuple[list[dict], list[dict]]:
    """The rows of `points` and of `extra` (the recipe shapes). Screened: the HSDP meshes only
    as refinements of the leaders of the others (screen.refinements)."""
    later = [p for p in points if screen and fsdp_parent(p.mesh) is not None]
    first = [p for p in points if p not in later]
    progress = Progress(len(first) + len(extra), out)
    rows = run_points(first + extra, workers=workers, cache=cache, progress=progress)
    by_index = {p.index: r for p, r in zip(first, rows)}
    if later:
        node = load_hardware(later[0].hardware).gpus_per_node
        chosen, skipped = refinements(later, rank_rows(first, rows[:len(first)]), node)
        progress.total += len(chosen)
        by_index.update(zip((p.index for p in chosen), run_points(chosen, workers=workers, cache=cache,
                                                                   progress=progress)))
        by_index.update((p.index, unrefined_row(p, chosen)) for p in skipped)
    return [by_index[p.index] for p in points], rows[len(first):]


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
            "context_parallel_degree": sizes.get(CP, 1), "pipeline_parallel_degree": sizes.get(PP, 1)}
