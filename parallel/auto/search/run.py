"""Run a sweep: plan every point (cached ones are read back), in worker processes.

    spec = load_sweep("llama3_8b_ladder")
    rows = run_points(spec.points, workers=2, cache=PlanCache())

Workers are spawned processes, each with its own fake process group per point; points
are handed out grouped by trace key (model, global batch, sequence) so that a worker
reuses its joint graph for the next mesh. A progress line (done / total, ETA) is printed
as points finish. A point that fails is a row with the reason; a worker that dies (out of
memory) has its points retried once in fresh workers, then they are failure rows.
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .point import PlanCache, failure_row, plan_point, point_key, points_share_meshes, trace_key
from .spec import Point, more_micro_batches


class Progress:
    """`done/total` with cached and failed counts, elapsed time and an ETA from the
    points planned so far (cached points take no time)."""

    def __init__(self, total: int, out: Callable[[str], None] | None = None) -> None:
        self.total, self.done, self.cached, self.failed, self.planned = total, 0, 0, 0, 0
        self.t0 = time.perf_counter()
        self.out = out if out is not None else (lambda s: print(s, file=sys.stderr, flush=True))

    def update(self, row: dict) -> None:
        self.done += 1
        self.cached += bool(row.get("cached"))
        self.planned += not row.get("cached")
        self.failed += row.get("status") not in ("ok", "OOM")
        elapsed = time.perf_counter() - self.t0
        left = self.total - self.done
        eta = elapsed / self.planned * left if self.planned else 0.0
        took = "" if row.get("cached") else f" {row.get('plan_s') or 0:.1f}s"
        self.out(f"[sweep] {self.done}/{self.total} done ({self.cached} cached, {self.failed} failed), "
                 f"elapsed {_hms(elapsed)}, ETA {_hms(eta)} | {row['mesh']} seq {row['seq_len']} "
                 f"lb {row['local_batch']}: {row['status']}{took}")


def _hms(s: float) -> str:
    m, s = divmod(int(round(s)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def run_points(points: Sequence[Point], *, workers: int = 2, cache: PlanCache | None = None,
               progress: Progress | None = None) -> list[dict]:
    """One row per point, in the points' order (see the module docstring). A point at a fixed
    global batch whose plan does not fit (OOM) is planned again with more micro-batches (a
    smaller local batch; its step time counts all of them) until one fits or each micro-batch
    is one sample; its row is the last try's."""
    progress = progress or Progress(len(points))
    rows: dict[int, dict] = {}
    todo = []
    for p in points:
        if p.reject:  # not planned: the row says why
            rows[p.index] = failure_row(p, p.reject)
            progress.update(rows[p.index])
            continue
        key = point_key(p)
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            rows[p.index] = {**hit, "index": p.index, "cached": True, "key": key}
            progress.update(rows[p.index])
        else:
            todo.append(p)
    # same trace -> same worker, one after another; one mesh's points together (they share candidates)
    todo.sort(key=lambda p: (str(trace_key(p)), p.mesh.label, p.index))
    if todo and workers <= 1 and not dist.is_initialized():
        with points_share_meshes():
            for p in todo:
                rows[p.index] = plan_point(p, cache)
                progress.update(rows[p.index])
    elif todo:
        rows.update(_run_pool(todo, workers, cache, progress))
    retries = [q for p in points if rows[p.index].get("status") == "OOM" and (q := more_micro_batches(p)) is not None]
    if retries:
        progress.total += len(retries)
        for q, row in zip(retries, run_points(retries, workers=workers, cache=cache, progress=progress)):
            rows[q.index] = row
    return [rows[p.index] for p in points]


MESH_NDIM_WEIGHT = {1: 1.0, 2: 1.5, 3: 3.0, 4: 5.0}
"""Relative planning time of a point by its mesh's dimensions (8B, h100, 2 workers: about
4-6 s on a 1-D mesh, 6-9 s 2-D, 13-18 s 3-D and 25 s 4-D, where seeding and the MRF join)."""


def point_weight(p: Point) -> float:
    """The expected planning time of `p`, relative (for handing out the longest first)."""
    return MESH_NDIM_WEIGHT.get(len(p.mesh.shape), 5.0 * len(p.mesh.shape) / 4)


def _groups(todo: list[Point], workers: int) -> list[list[Point]]:
    """Points sharing a trace key, in chunks small enough to keep every worker busy, the
    longest first (a worker handed a 4-D mesh last would finish long after the other): within
    a trace the heaviest meshes first (one mesh's points together), then the groups by their
    expected time."""
    by_key: dict[str, list[Point]] = {}
    for p in todo:
        by_key.setdefault(str(trace_key(p)), []).append(p)
    size = max(1, min(8, -(-len(todo) // (4 * workers))))
    groups = []
    for g in by_key.values():
        g = sorted(g, key=lambda p: (-point_weight(p), p.mesh.label, p.index))
        groups += [g[i:i + size] for i in range(0, len(g), size)]
    return sorted(groups, key=lambda g: -sum(point_weight(p) for p in g))  # stable: ties keep trace order


def _run_pool(todo: list[Point], workers: int, cache: PlanCache | None, progress: Progress) -> dict[int, dict]:
    """Plan in spawned worker processes that take groups of points sharing a trace (one
    trace a group) and report each point as it is done. Points of a worker that died get
    one retry in fresh workers, then are failure rows."""
    rows: dict[int, dict] = {}
    folder = str(cache.folder) if cache is not None else None
    for attempt in (1, 2):
        pending = _run_workers(_groups(todo, workers), workers, folder, rows, progress)
        if not pending:
            break
        todo = sorted(pending, key=lambda p: p.index)
        if attempt == 2:
            for p in todo:
                rows[p.index] = failure_row(p, "error: the worker process died (killed: out of memory?)")
                progress.update(rows[p.index])
    return rows


def _run_workers(groups: list[list[Point]], workers: int, folder: str | None, rows: dict[int, dict],
                 progress: Progress) -> list[Point]:
    """Run the groups on `workers` processes; fill `rows`; return the points never reported."""
    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    n = max(1, min(workers, len(groups)))
    for g in groups:
        tasks.put(g)
    for _ in range(n):
        tasks.put(None)
    procs = [ctx.Process(target=_worker_loop, args=(tasks, results, folder), daemon=True) for _ in range(n)]
    for pr in procs:
        pr.start()
    pending = {p.index: p for g in groups for p in g}
    while pending:
        try:
            index, row = results.get(timeout=2.0)
        except queue.Empty:
            if not any(pr.is_alive() for pr in procs):
                break
            continue
        if pending.pop(index, None) is not None:
            rows[index] = row
            progress.update(row)
    for pr in procs:
        pr.join(timeout=5)
        if pr.is_alive():
            pr.terminate()
    return list(pending.values())


def _worker_loop(tasks: Any, results: Any, folder: str | None) -> None:
    """A worker: one thread of torch, then groups of points until the None sentinel."""
    torch.set_num_threads(1)
    cache = PlanCache(Path(folder)) if folder is not None else None
    with points_share_meshes():
        for group in iter(tasks.get, None):
            for p in group:
                results.put((p.index, plan_point(p, cache)))
