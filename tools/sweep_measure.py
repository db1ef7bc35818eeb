"""`scripts/sweep.py --measure`: run the sweep's points this machine can run, for real, and
put each one's measured step next to its prediction.

A point is run when its plan was made for this machine's profile (a `cpu*` hardware profile:
a point planned for H100s says nothing about gloo ranks on a CPU), on at most MAX_WORLD ranks,
and planned fine (status ok). Its cached plan is handed to the trainer as
`parallelism.plan_file` (the trainer refuses a plan that does not fit the job), with the
point's model, shapes, mesh degrees and AC mode as flags over the spec's base config. Points
are grouped by world size: one set of spawned gloo ranks per world size builds a Trainer per
point and times them round-robin (tools/bench_common.py: warm-up steps, then the median of
the timed steps; step i of every point before step i+1 of any, so machine noise hits all
alike). Points of one job whose plans have the same placements (`Plan.placement_digest`) run
alike: the first is run, the others are listed as its duplicates and take its measurement.

Predicted, for the ratio and the scatter: the plan's step simulation (`Plan.timeline.step_us`,
what scripts/fidelity.py draws) when the plan has one and the point runs one micro-batch a
step; else the ILP objective's step (the table's `step ms`). Each row says which (`predictor`).
"""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parallel.auto.cost import load_hardware
from parallel.auto.search.compare import row_point
from parallel.auto.search.point import PlanCache
from parallel.auto.search.spec import Point
from parallel.mesh import CP, DP_REPLICATE, DP_SHARD, TP
from tools.bench_common import run_on_ranks, temp_folder, time_round_robin

MAX_WORLD = 8
"""More gloo ranks than this on a few shared cores time the scheduler, not the plan."""
COMMON = ["--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "100000",
          "--parallelism.mode", "auto", "--validation.enable", "false"]
DEGREE_FLAGS = {DP_REPLICATE: "data_parallel_replicate_degree", DP_SHARD: "data_parallel_shard_degree",
                CP: "context_parallel_degree", TP: "tensor_parallel_degree"}
SIMULATION, OBJECTIVE = "step simulation", "ILP objective"


def runs_here(point: Point) -> str:
    """'' when this machine can run the point's plan, else why not (before planning)."""
    name = load_hardware(point.hardware).name
    if not name.startswith("cpu"):
        return f"planned for {name}, not this machine (cpu)"
    if point.mesh.world > MAX_WORLD:
        return f"world {point.mesh.world} > {MAX_WORLD} gloo ranks"
    unknown = [n for n in point.mesh.names if n not in DEGREE_FLAGS]
    if unknown:
        return f"mesh axes {unknown} have no trainer degree"
    return point.reject


def trainer_flags(point: Point, plan_file: str) -> list[str]:
    """The base config's overrides that make the trainer's job the point's, its plan loaded."""
    flags = ["--model.name", point.model, "--model.flavor", point.flavor]
    for k, v in point.model_args:
        flags += [f"--model.{k}", str(v)]
    if point.vocab_size:
        flags += ["--model.vocab_size", str(point.vocab_size)]
    degrees = dict(zip(point.mesh.names, point.mesh.shape))
    for axis, key in DEGREE_FLAGS.items():
        flags += [f"--parallelism.{key}", str(degrees.get(axis, 1))]
    return [*flags, "--training.seq_len", str(point.seq_len), "--training.local_batch_size",
            str(point.local_batch_size), "--training.global_batch_size", str(point.global_batch),
            "--activation_checkpoint.mode", point.ac_mode, "--parallelism.hardware", load_hardware(point.hardware).name,
            "--parallelism.plan_file", plan_file, *COMMON]


def _job_key(row: dict) -> tuple:
    """What, besides the placements, decides how a point runs (not its budget or profile)."""
    return tuple(row.get(k) for k in ("model", "world", "mesh", "global_batch", "local_batch", "micro_batches",
                                      "seq_len", "ac_mode"))


def predicted(plan: Any, row: dict) -> tuple[float, str]:
    """(predicted step ms, which predictor): the step simulation where it is the whole step."""
    timeline = getattr(plan, "timeline", None)
    if timeline is not None and timeline.step_us > 0 and int(row.get("micro_batches") or 1) == 1:
        return timeline.step_us / 1e3, SIMULATION
    return float(row["step_ms"]), OBJECTIVE


class _Ranks:
    """Every rank of one world size: build a Trainer per point, time them round-robin."""

    def __init__(self, config: str | None, entries: list[tuple[str, list[str]]], warmup: int, steps: int,
                 folder: str) -> None:
        self.config, self.entries, self.warmup, self.steps, self.folder = config, entries, warmup, steps, folder

    def __call__(self) -> dict:
        from trainer.config import load_config
        from trainer.trainer import Trainer

        built, failed = {}, {}
        for name, flags in self.entries:
            run = ["--training.steps", str(self.warmup + self.steps + 1), "--job.dump_folder", self.folder,
                   "--job.name", name]
            try:
                cfg = load_config(self.config, [*flags, *run], world_size=self._world())
                built[name] = Trainer(cfg)
            except Exception as e:  # noqa: BLE001 - a plan the trainer refuses fails alike on every rank
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows = time_round_robin(built, self.warmup, self.steps) if built else {}
        return {"rows": {n: {"step_s": r["step_s"]} for n, r in rows.items()}, "failed": failed}

    @staticmethod
    def _world() -> int:
        import torch.distributed as dist

        return dist.get_world_size()


def plan_file(cache: PlanCache, key: str, folder: Path) -> str | None:
    """The cached plan (gzip) as a plain JSON file the trainer reads, or None when missing."""
    src = cache.folder / f"{key}.plan.json.gz"
    if not src.exists():
        return None
    dst = folder / "plans" / f"{key}.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(src, "rb") as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g)
    return str(dst)


def _entries(points: Sequence[Point], rows: list[dict], cache: PlanCache, folder: Path
             ) -> tuple[dict[int, list[tuple[str, list[str]]]], dict[int, int]]:
    """Mark every row's `measure` (why not, or its duplicate); the points to run by world size,
    and each duplicate row's position -> the position of the row it duplicates."""
    by_world: dict[int, list[tuple[str, list[str]]]] = {}
    first: dict[tuple, int] = {}
    dups: dict[int, int] = {}
    for i, (point, row) in enumerate(zip(points, rows)):
        why = runs_here(point) or ("" if row.get("status") == "ok" else f"status {row.get('status')}")
        p = row_point(point, row) if not why else None
        plan = cache.plan(row["key"]) if p is not None else None
        if plan is None:
            row["measure"] = f"not measured: {why or 'its plan is missing from the cache ' + str(cache.folder)}"
            continue
        row["predicted_ms"], row["predictor"] = predicted(plan, row)
        row["digest"] = plan.placement_digest()
        same = (_job_key(row), row["digest"])
        if same in first:
            dups[i] = first[same]
            row["measure"] = f"duplicate of #{rows[first[same]]['index']} (same job, same placements)"
            continue
        first[same] = i
        path = plan_file(cache, row["key"], folder)
        if path is None:  # never run without the plan: the trainer would solve its own
            row["measure"] = f"not measured: its plan is missing from the cache {cache.folder}"
            continue
        by_world.setdefault(p.mesh.world, []).append((f"p{i}", trainer_flags(p, path)))
    return by_world, dups


def measure_rows(config: str | None, points: Sequence[Point], rows: list[dict], cache: PlanCache, *,
                 warmup: int = 2, steps: int = 5, log: Any = print) -> list[dict]:
    """Run the points this machine can run (module docstring); each row gains `measure` (what
    happened), and the measured ones `measured_ms`, `predicted_ms`, `predictor`, `measured_ratio`
    (measured / predicted) and `digest`. Returns the rows."""
    folder = Path(temp_folder())
    by_world, dups = _entries(points, rows, cache, folder)
    for world, entries in sorted(by_world.items()):
        log(f"[measure] world {world}: {len(entries)} plans on {world} gloo ranks, {warmup} warm-up + {steps} "
            "timed steps each, round-robin", flush=True)
        try:
            result = run_on_ranks(_Ranks(config, entries, warmup, steps, str(folder)), world)
        except RuntimeError as e:
            result = {"rows": {}, "failed": {n: f"the ranks failed: {str(e).splitlines()[-1][:200]}"
                                             for n, _ in entries}}
        for name, _ in entries:
            row = rows[int(name[1:])]
            if name in result["rows"]:
                row["measured_ms"] = result["rows"][name]["step_s"] * 1e3
                row["measure"] = f"measured ({steps} steps after {warmup} warm-up)"
            else:
                row["measure"] = f"not measured: {result['failed'].get(name, 'no result')}"
    for i, j in dups.items():
        if rows[j].get("measured_ms") is not None:
            rows[i]["measured_ms"] = rows[j]["measured_ms"]
        else:
            rows[i]["measure"] = f"not measured: {rows[j]['measure']} (duplicate of #{rows[j]['index']})"
    for r in rows:
        if r.get("measured_ms") is not None and r.get("predicted_ms"):
            r["measured_ratio"] = r["measured_ms"] / r["predicted_ms"]
    return rows


def scatter_points(rows: Sequence[dict]) -> tuple[list[tuple[str, float, float]], dict[int, int]]:
    """One (name, predicted ms, measured ms) per distinct measured plan (the first row of each),
    and each duplicate's index -> the index it duplicates."""
    points, dups = [], {}
    for r in rows:
        if r.get("measured_ms") is None:
            continue
        m = r.get("measure", "")
        if m.startswith("duplicate of #"):
            dups[r["index"]] = int(m.split("#")[1].split()[0])
            continue
        points.append((f"#{r['index']} {r['mesh']} {r['hardware']}", r["predicted_ms"], r["measured_ms"]))
    return points, dups
