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

from collections.abc import Callable

from parallel.auto.cost import HardwareProfile, load_hardware
from parallel.auto.search.mesh_space import MeshOption, MeshSpec, enumerate_meshes, rank_mesh_options
from parallel.mesh import CP, DP_REPLICATE, DP_SHARD, TP

from .point import PlanCache
from .report import markdown_table, memory_note
from .run import Progress, run_points
from .spec import BaseJob, Point, point_request, with_global_batch

RANK_COLUMNS = ("rank", "mesh", "batch x seq", "local", "micro", "step ms", "tokens/s", "MFU", "mem GiB", "OOM",
                "plan s", "status", "plan")


def search_global_batch(job: BaseJob, world: int) -> int:
    """The global batch every mesh trains: the job's ``global_batch_size``, else its local
    batch on every device as data rank (local batch x world: what the fully data-parallel
    mesh trains without accumulation)."""
    return job.global_batch_size or job.request.local_batch_size * world


def search_points(job: BaseJob, world: int, hardware: str | HardwareProfile,
                  vocab_size: int | None = None) -> list[Point]:
    """One point per candidate mesh of ``world`` devices for the job: its whole planning
    request (planner settings, runtime, mixed precision) on ``hardware``, at the job's global
    batch (:func:`search_global_batch`; local batch = global / the mesh's data degree)."""
    hw = load_hardware(hardware)
    req = job.request
    budget = req.planner.memory_budget_high if req.planner.memory_budget_high is not None else "auto"
    request = point_request(req, req.local_batch_size, req.seq_len, req.runtime.ac_mode, hardware, budget)
    gb = search_global_batch(job, world)
    return [with_global_batch(Point(index=i, model=job.model, flavor=job.flavor, model_args=job.model_args,
                                    mesh=spec, request=request, memory_high=budget, vocab_size=vocab_size,
                                    mesh_auto=True), gb)
            for i, spec in enumerate(searched_meshes(world, hw.gpus_per_node, req.seq_len))]


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
    by_mesh = {p.mesh: r for p, r in zip(points, rows)}
    out = []
    for i, c in enumerate(rank_mesh_options(options)):
        r = dict(by_mesh[c.mesh])
        r["rank"] = i + 1 if c.fits and c.step_us is not None else "-"
        out.append(r)
    return out


def search_meshes(job: BaseJob, world: int, hardware: str | HardwareProfile, *, workers: int = 2,
                  cache: PlanCache | None = None, vocab_size: int | None = None,
                  out: Callable[[str], None] | None = None) -> list[dict]:
    """Plan every candidate mesh (cached) and return the ranked rows (see :func:`rank_rows`);
    ``out`` prints the progress lines (default: stderr)."""
    points = search_points(job, world, hardware, vocab_size)
    rows = run_points(points, workers=workers, cache=cache if cache is not None else PlanCache(),
                      progress=Progress(len(points), out))
    return rank_rows(points, rows)


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
            "context_parallel_degree": sizes.get(CP, 1)}
