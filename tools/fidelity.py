"""Ranking fidelity of the cost model: does it order plans the way this machine does?

    python scripts/fidelity.py                         # debug LLaMA, 4 gloo ranks, 1-D mesh of 4
    python scripts/fidelity.py --mesh 2x2              # the same on a 2 x 2 mesh (dp_shard x tp)
    python scripts/fidelity.py --model wide            # 6 layers, dim 512, seq 512
    python scripts/fidelity.py --config qwen3_debug --mesh 2x2
    python scripts/fidelity.py --config llama3_debug --model none --training.seq_len 1024 --model.n_layers 2
    python scripts/fidelity.py --repeats 3 --goal         # medians of 3 interleaved runs; exit 1 on a miss
    python scripts/fidelity.py --suite issue49 --repeats 3  # the issue-49 goal: 5 jobs, one row each

For one job (`--config`, a `--model` preset of shape flags, then any `--section.key value`
override, e.g. `--model.dim 512`) and mesh (`N`: dp_shard N; `AxB`: dp_shard A x tp B) it
plans every variant (the planner's free choice, and plans shaped like FSDP, DDP, Megatron
TP, mixtures, a memory budget, pinned embeddings, a plan made for H100s), keeps the
*distinct* ones (by `Plan.placement_digest`; duplicates are listed, and fewer distinct
plans than requested is exit 2, not statistics over copies), runs each for real through
the trainer (warm-up, then the median of the timed steps, round-robin across plans so
machine noise hits all alike) and scores two predictors against the measured medians:

* the ILP objective (`plan.objective_us`: what the planner and the mesh search minimise;
  a plan solved on another profile is re-priced on the free plan's problem);
* the step simulation (the runtime's step graph simulated on the calibrated profile).

For each: Spearman's rho (average ranks for ties) with a bootstrap 95% interval, Kendall's tau-b, mean and median
absolute percentage error, selection regret (measured time of the predicted-best plan /
the measured best - 1); and the planner's own regret (the free plan's measured time /
the measured best - 1). Statistics: tools/rank_stats.py. The step simulation against the
measured medians is also drawn, one point per plan over the y = x line, as an SVG
(`--scatter`; default fidelity_scatter.svg in --plan-dir, else in outputs/fidelity/).

Repeats (`--repeats N`, default 1): every plan is timed N times, interleaved (round r of
every plan before round r + 1 of any, and inside a round step i of every plan before step
i + 1 of any; the warm-up only in the first round); a plan's measured step is the median of
its N figures (each the median of a round's timed steps), and the table adds their min–max.
With N >= 2 the 95% intervals of rho and of the planner's regret are bootstrapped over the
repeats (each plan's N figures resampled on their own, the predictions fixed: the run-to-run
noise of these plans, which is what the goal is about; see `rank_stats.repeats_interval`);
with N = 1 rho's interval resamples the plans instead (all one run can give). The repeats
share the trainers of one launch: they draw the machine's drift over the job's time, not
what a fresh launch would change.

The goal (issue 49): the ILP objective's rho >= 0.9 (`--goal-rho`) and the planner regret
<= 2 % (`--goal-regret`), judged on the medians; `--goal` makes a miss exit 1 with one line
naming the figure that missed (exit 2 stays bad input or too few distinct plans).
`--suite issue49` runs five jobs (LLaMA 3, Qwen3 and DeepSeek-V3 debug; meshes 4 and 2x2;
seq 128 and 1024) one after another, each reported in full, then one row a job (rho, its
interval, regret, met or not); the goal is always checked and any job that misses it makes
the exit 1 (2 when a job had too few distinct plans).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel.auto.search.mesh_space import MeshSearchError, MeshSpec, parse_mesh
from parallel.mesh import DP_SHARD, TP
from tools import rank_stats as st
from tools.bench_common import run_on_ranks, temp_folder, time_round_robin
from tools.fidelity_report import Goal, Verdict, report, report_job, suite_table, write_scatter

__all__ = ["Goal", "Verdict", "main", "report", "report_job", "suite_table", "write_scatter"]

MODELS = {  # shape presets; later --section.key flags override them
    "debug": ["--training.seq_len", "128", "--training.local_batch_size", "4"],
    "wide": ["--model.n_layers", "6", "--model.dim", "512", "--model.n_heads", "8", "--model.n_kv_heads", "8",
             "--model.ffn_hidden_dim", "1536", "--training.seq_len", "512", "--training.local_batch_size", "2"],
    "none": [],
}
COMMON = ["--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "100000",
          "--parallelism.mode", "auto", "--validation.enable", "false"]
MIN_PLANS = 10


@dataclass(frozen=True)
class SuiteJob:
    """One job of a suite: a config, a --model preset, a mesh and its own flags."""

    name: str
    config: str
    mesh: str
    model: str = "debug"
    flags: tuple[str, ...] = ()


SUITES = {  # issue 49: 3 families, 1-D and 2-D meshes, seq 128 and 1024 (docs/measurements.md#fidelity)
    "issue49": (
        SuiteJob("llama3_mesh4_seq128", "llama3_debug", "4"),
        SuiteJob("llama3_2x2_seq128", "llama3_debug", "2x2"),
        SuiteJob("qwen3_2x2_seq128", "qwen3_debug", "2x2"),
        SuiteJob("deepseek_v3_mesh4_seq128", "deepseek_v3_debug", "4"),
        SuiteJob("llama3_mesh4_seq1024", "llama3_debug", "4", "none",
                 ("--training.seq_len", "1024", "--model.n_layers", "2", "--training.local_batch_size", "1")),
    ),
}


def fidelity_mesh(text: str) -> MeshSpec:
    """'4' -> dp_shard 4, '2x2' -> dp_shard 2 x tp 2 (size-1 axes left out); ValueError naming the
    flag for anything else (a tp axis alone included: the variants need a data axis)."""
    try:
        spec = parse_mesh(text)
    except MeshSearchError:
        spec = None
    if spec is None or spec.names not in ((DP_SHARD,), (DP_SHARD, TP)):
        raise ValueError(f"--mesh {text!r}: not a mesh; give N (dp_shard N) or AxB (dp_shard A x tp B), e.g. 4 or 2x2")
    return spec


def mesh_flags(spec: MeshSpec) -> list[str]:
    return ["--parallelism.data_parallel_shard_degree", str(spec.degree(DP_SHARD)),
            *(["--parallelism.tensor_parallel_degree", str(spec.degree(TP))] if TP in spec.names else [])]


def _fsdp_only(autop: Any, sharded: str, replicated: str) -> None:
    """FSDP for the parameters whose FQN contains `sharded` (stored as shards of dim 0 on the
    data axis, gathered for data-parallel compute), DDP for those containing `replicated`:
    a recipe that shards only the big half. Left free, the other half would be sharded too
    and the plan would be `fsdp`'s."""
    from torch.distributed.tensor import Replicate, Shard

    from parallel.auto.search import presets

    presets.fsdp(autop, data_axes=(0,), fragments=[sharded])
    presets.replicated(autop, [replicated])  # its budget (all may be replicated) replaces fsdp's
    storage = (Shard(0),) + (Replicate(),) * (autop.mesh.ndim - 1)
    for fqn in autop.graph.params:
        if sharded in fqn:
            autop.add_node_constraint(fqn, storage)


def _variants(ndim: int) -> dict[str, object]:
    """name -> a function adding constraints to an open AutoParallel (None: the free plan;
    "h100": solved on the h100 profile). The free plan comes first: a duplicate is named
    after the first plan it equals."""
    from parallel.auto.search import presets

    last = ndim - 1
    data = (0,) if ndim > 1 else ()  # the 2x2 mesh's first axis is the data axis; 1-D: TP takes the batch whole
    out = {
        "auto": None,
        "fsdp": lambda a: presets.fsdp(a),
        "ddp": lambda a: presets.ddp(a),
        "tp": lambda a: presets.megatron(a, last, fsdp_other_axes=ndim > 1, data_axes=data),
        "tp_attention_fsdp_mlp": lambda a: (presets.megatron(a, last, fragments=["attention"], data_axes=data,
                                                             fsdp_other_axes=ndim > 1),
                                            presets.fsdp(a, data_axes=(0,), fragments=["feed_forward"])),
        "tp_mlp_only": lambda a: presets.megatron(a, last, fragments=["feed_forward"], data_axes=data),
        "budget_0.5": lambda a: a.add_parameter_memory_constraint(high=0.5),
        "budget_1.0": lambda a: a.add_parameter_memory_constraint(high=1.0),
        "replicated_embeddings": lambda a: presets.replicated(a, ["tok_embeddings", "output"]),
        "budget_0.75": lambda a: a.add_parameter_memory_constraint(high=0.75),
        "fsdp_attention_only": lambda a: _fsdp_only(a, "attention", "feed_forward"),
        "fsdp_mlp_only": lambda a: _fsdp_only(a, "feed_forward", "attention"),
        "fsdp_output_only": lambda a: _fsdp_only(a, "output", "layers"),
        "tp_attention_only": lambda a: presets.megatron(a, last, fragments=["attention"], data_axes=data,
                                                        fsdp_other_axes=ndim > 1),
        "planned_for_h100": "h100",
    }
    if ndim > 1:
        out["tp_on_dp_axis"] = lambda a: presets.megatron(a, 0, fsdp_other_axes=True)
        out["fsdp_on_both_axes"] = lambda a: presets.fsdp(a, data_axes=(0, 1))
    else:
        out["tp_attention_ddp_mlp"] = lambda a: (presets.megatron(a, 0, fragments=["attention"]),
                                                presets.replicated(a, ["feed_forward"]))
    return out


def _repriced(auto: Any, plans: dict[str, Any]) -> dict[str, float]:
    """Each plan's placements priced on the free plan's job and calibrated profile (rank 0
    alone: a fresh trace of the model on meta, the profile passed as an object)."""
    import dataclasses

    from parallel.auto.request import planning
    from trainer.auto_mode import plan_request

    req = plan_request(auto.cfg)
    req = dataclasses.replace(req, planner=dataclasses.replace(req.planner, hardware=auto.model.plan_cost_model.hw))
    with planning(auto.model.meta_template, auto.mesh, req) as autop:
        return {n: autop.replay_placement(p).objective_us for n, p in plans.items()}


def time_repeats(built: dict[str, Any], warmup: int, steps: int, repeats: int) -> dict[str, dict]:
    """`repeats` rounds of `time_round_robin` over the same trainers, the warm-up in the first
    only: round r of every plan before round r + 1 of any. A plan's row: `runs_s` its rounds'
    step figures (each a median over the round's timed steps), `step_s` their median, the
    losses of every round."""
    rounds = [time_round_robin(built, warmup if r == 0 else 0, steps) for r in range(repeats)]
    rows = {}
    for name in built:
        runs = [rd[name]["step_s"] for rd in rounds]
        row = dict(rounds[0][name])
        row.update(step_s=statistics.median(runs), runs_s=runs, tokens_per_s=row["tokens"] / statistics.median(runs),
                   losses=[x for rd in rounds for x in rd[name]["losses"]])
        rows[name] = row
    return rows


class _Job:
    """Every rank: plan each variant (rank 0 solves, via the trainer), drop duplicate plans,
    time the distinct ones round-robin, predict each step on rank 0."""

    def __init__(self, args: argparse.Namespace, flags: list[str]):
        self.args, self.flags = args, flags
        self.folder = args.plan_dir or temp_folder()

    def _trainer(self, name: str, how: object) -> Any:
        from trainer.config import load_config
        from trainer.trainer import Trainer

        a = self.args
        steps = a.warmup + a.steps * a.repeats + 1
        flags = [*self.flags, "--training.steps", str(steps), "--job.dump_folder", self.folder,
                 "--job.name", name]
        if how == "h100":
            flags += ["--parallelism.hardware", "h100"]
        saved = Path(self.folder) / name / "plan.json"
        if saved.exists():  # planned by an earlier run of this job (--plan-dir): loaded, not solved again
            flags += ["--parallelism.plan_file", str(saved)]
        cfg = load_config(a.config, flags, world_size=a.nproc)
        return Trainer(cfg, plan_constraints=how if callable(how) else None)

    def __call__(self) -> dict:
        import torch.distributed as dist

        a = self.args
        variants = _variants(len(a.mesh_spec.shape))
        if a.plans:
            variants = {k: v for k, v in variants.items() if k in a.plans}
        built, failed = {}, {}
        for name, how in variants.items():
            try:
                built[name] = self._trainer(name, how)
            except Exception as e:  # noqa: BLE001 - a planning error is raised on every rank alike
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        digests = {n: tr.model.plan.placement_digest() for n, tr in built.items()}
        kept, dups = st.distinct(digests)
        out: dict[str, Any] = {"digests": digests, "duplicates": dups, "failed": failed, "rows": {}}
        if len(kept) < a.min_plans:
            return out  # too few distinct plans: nothing is timed
        built = {n: built[n] for n in kept}
        rows = time_repeats(built, a.warmup, a.steps, a.repeats)
        if dist.get_rank() == 0:
            auto = built["auto"].model
            cm, hw = auto.plan_cost_model, auto.plan.hardware
            other = {n: tr.model.plan for n, tr in built.items() if tr.model.plan.hardware != hw}
            # plans of another profile: their objective on the calibrated one (auto's too, as a check)
            try:
                repriced = _repriced(built["auto"], {**other, "auto": auto.plan}) if other else {}
            except Exception as e:  # noqa: BLE001 - reported: those plans keep their own profile's objective
                out["reprice_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                repriced, other = {}, {}
            out["reprice_check"] = (auto.plan.objective_us, repriced.get("auto"))
            for name, tr in built.items():
                plan = tr.model.plan
                objective = repriced[name] if name in other else plan.objective_us
                pred = tr.model.predict_step(cm)
                rows[name].update(
                    predicted_s=pred.step_us / 1e6, objective_us=objective, repriced=name in other,
                    own_objective_us=plan.objective_us, digest=digests[name],
                    explain=f"{plan.breakdown()}\n{pred.summary()}\n"
                            + "\n".join(f"  step graph {k}: {v['count']} x, {v['bytes'] / 2**20:.1f} MiB, "
                                        f"{v['us']:,.0f} µs" for k, v in pred.collectives.items()))
        out["rows"] = rows
        return out


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other --section.key value flag goes to the job (e.g. --model.dim 512).")
    p.add_argument("--config", default="llama3_debug")
    p.add_argument("--model", choices=list(MODELS), default="debug", help="a preset of shape flags")
    p.add_argument("--mesh", default="4", help="N (dp_shard N) or AxB (dp_shard A x tp B); default 4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="time every plan N times, interleaved; its measured "
                   "step is the median of the N (default 1)")
    p.add_argument("--plans", default="", help="comma-separated subset of the plans (default: all)")
    p.add_argument("--min-plans", type=int, default=None,
                   help=f"distinct plans required (default {MIN_PLANS}, or the number named by --plans)")
    p.add_argument("--plan-dir", default="", help="run folders; a plan an earlier run of this same job saved "
                   "there is loaded, not solved again (a run cut short resumes); default: a fresh temp folder")
    p.add_argument("--scatter", default="", help="the predicted-vs-measured SVG (default: fidelity_scatter.svg "
                   "in --plan-dir, else in outputs/fidelity/)")
    p.add_argument("--explain", action="store_true", help="print each plan's objective breakdown and prediction")
    p.add_argument("--goal", action="store_true", help="exit 1 when the goal is not met (always with --suite)")
    p.add_argument("--goal-rho", type=float, default=Goal.rho, help="the ILP objective's rho at least (0.9)")
    p.add_argument("--goal-regret", type=float, default=Goal.regret * 100,
                   help="the planner's regret at most, in percent (2)")
    p.add_argument("--suite", choices=list(SUITES), default="",
                   help="run a suite of jobs (replaces --config, --model and --mesh); the goal is checked")
    args, extra = p.parse_known_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: give 1 or more")
    try:
        args.mesh_spec = fidelity_mesh(args.mesh)
    except ValueError as e:
        p.error(str(e))
    args.nproc = args.mesh_spec.world
    args.plans = [x for x in args.plans.split(",") if x]
    if args.min_plans is None:
        args.min_plans = len(args.plans) if args.plans else MIN_PLANS
    args.goal = Goal(args.goal_rho, args.goal_regret / 100, enforce=args.goal or bool(args.suite))
    return args, extra


def _job_flags(args: argparse.Namespace, extra: list[str]) -> tuple[list[str], str | None]:
    """The job's flags, and why it cannot run (a bad flag or value, an unknown plan) or None:
    checked here, before any rank starts."""
    from trainer.config import load_config
    from trainer.errors import ConfigError

    flags = [*MODELS[args.model], *COMMON, *mesh_flags(args.mesh_spec), *extra]
    try:
        load_config(args.config, flags, world_size=args.nproc)
    except ConfigError as e:
        return flags, f"config error: {e}"
    known = _variants(len(args.mesh_spec.shape))
    unknown = sorted(set(args.plans) - set(known))
    if unknown:
        return flags, f"--plans: unknown plan(s) {unknown}; known: {', '.join(known)}"
    return flags, None


def run_job(args: argparse.Namespace, flags: list[str], extra: list[str]) -> tuple[int, Verdict | None]:
    """Time the job's plans on spawned ranks, print its report, its scatter and (--explain) each
    plan's breakdown: `report_job`'s (exit status, verdict)."""
    t0 = time.perf_counter()
    result = run_on_ranks(_Job(args, flags), args.nproc)
    took = time.perf_counter() - t0
    rounds = f", {args.repeats} rounds interleaved" if args.repeats > 1 else ""
    print(f"\n{args.config} ({' '.join(flags[:len(MODELS[args.model])] + extra)}) on {args.nproc} gloo ranks, "
          f"mesh {args.mesh}; {args.steps} timed steps after {args.warmup} warm-up, round-robin{rounds} ({took:.0f}s)")
    rc, verdict = report_job(result, args.min_plans, goal=args.goal)
    if rc != 2:
        path = write_scatter(result, args.scatter or Path(args.plan_dir or "outputs/fidelity") / "fidelity_scatter.svg")
        print(f"wrote {path} (step simulation vs measured, one point per plan)")
    if args.explain and rc != 2:
        for name, r in result["rows"].items():
            print(f"\n== {name}\n{r['explain']}")
    return rc, verdict


def _suite_args(args: argparse.Namespace, job: SuiteJob) -> argparse.Namespace:
    """The suite's shared flags with the job's config, model preset and mesh; its own
    subfolder of --plan-dir and scatter."""
    out = argparse.Namespace(**vars(args))
    out.config, out.model, out.mesh = job.config, job.model, job.mesh
    out.mesh_spec = fidelity_mesh(job.mesh)
    out.nproc = out.mesh_spec.world
    out.plan_dir = str(Path(args.plan_dir) / job.name) if args.plan_dir else ""
    out.scatter = str(Path(out.plan_dir or f"outputs/fidelity/{job.name}") / "fidelity_scatter.svg")
    return out


def run_suite(args: argparse.Namespace, extra: list[str]) -> int:
    """Every job of `--suite` in turn (bad input in any: exit 2 before the first starts), then
    `suite_table`."""
    jobs = []
    for job in SUITES[args.suite]:
        jargs = _suite_args(args, job)
        flags, err = _job_flags(jargs, [*job.flags, *extra])
        if err:
            print(f"suite {args.suite}, job {job.name}: {err}", file=sys.stderr)
            return 2
        jobs.append((job, jargs, flags))
    rows = []
    for job, jargs, flags in jobs:
        print(f"\n=== {args.suite}: {job.name}", flush=True)
        try:
            rc, verdict = run_job(jargs, flags, [*job.flags, *extra])
            why = "too few distinct plans" if rc == 2 else ""
        except RuntimeError as e:  # a rank failed or timed out: this job missed, the others still run
            print(f"job {job.name} failed: {str(e)[-2000:]}")
            rc, verdict, why = 1, None, f"failed ({str(e).splitlines()[0][:80]})"
        rows.append((job.name, rc, verdict, why))
    return suite_table(rows, args.goal)


def main(argv: list[str] | None = None) -> int:
    args, extra = _parse(argv)
    if args.suite:
        return run_suite(args, extra)
    flags, err = _job_flags(args, extra)
    if err:
        print(err, file=sys.stderr)
        return 2
    return run_job(args, flags, extra)[0]


if __name__ == "__main__":
    raise SystemExit(main())
