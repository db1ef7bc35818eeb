"""Ranking fidelity of the cost model: does it order plans the way this machine does?

    python scripts/fidelity.py                         # debug LLaMA, 4 gloo ranks, 1-D mesh of 4
    python scripts/fidelity.py --mesh 2x2              # the same on a 2 x 2 mesh (dp_shard x tp)
    python scripts/fidelity.py --model wide            # 6 layers, dim 512, seq 512
    python scripts/fidelity.py --config qwen3_debug --mesh 2x2
    python scripts/fidelity.py --config llama3_debug --model none --training.seq_len 1024 --model.n_layers 2

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
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from parallel.auto.plan.html import write_html
from parallel.auto.plan.pictures.scatter import scatter_svg
from parallel.auto.search.mesh_space import MeshSearchError, MeshSpec, parse_mesh
from parallel.mesh import DP_SHARD, TP
from tools import rank_stats as st
from tools.bench_common import run_on_ranks, temp_folder, time_round_robin

MODELS = {  # shape presets; later --section.key flags override them
    "debug": ["--training.seq_len", "128", "--training.local_batch_size", "4"],
    "wide": ["--model.n_layers", "6", "--model.dim", "512", "--model.n_heads", "8", "--model.n_kv_heads", "8",
             "--model.ffn_hidden_dim", "1536", "--training.seq_len", "512", "--training.local_batch_size", "2"],
    "none": [],
}
COMMON = ["--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "100000",
          "--parallelism.mode", "auto", "--validation.enable", "false"]
MIN_PLANS = 10


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
        flags = [*self.flags, "--training.steps", str(a.warmup + a.steps + 1), "--job.dump_folder", self.folder,
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
        rows = time_round_robin(built, a.warmup, a.steps)
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


def _scores(name: str, pred: list[float], meas: list[float], names: list[str]) -> str:
    best = min(pred)
    picked = [n for n, p in zip(names, pred) if p == best]
    rho, tau = st.spearman(pred, meas), st.kendall_tau_b(pred, meas)
    low, high = st.spearman_interval(pred, meas)
    return (f"{name:<16} Spearman rho {rho:6.3f}   Kendall tau-b {tau:6.3f}   "
            f"mean APE {st.mean_ape(pred, meas):6.1f}%   median APE {st.median_ape(pred, meas):6.1f}%   "
            f"selection regret {st.selection_regret(pred, meas) * 100:5.1f}% (predicted best: {', '.join(picked)})   "
            f"rho 95% bootstrap interval [{low:.2f}, {high:.2f}]")


def report(result: dict, min_plans: int, out: Any = sys.stdout) -> int:
    """Print the table and statistics (0), or why there are none: fewer distinct plans than
    requested (2)."""
    dups, failed = result["duplicates"], result["failed"]
    for n, why in failed.items():
        print(f"plan {n}: not planned ({why})", file=out)
    for n, same in dups.items():
        print(f"plan {n}: duplicate of {same} (placement digest {result['digests'][n]})", file=out)
    n_distinct = len(result["digests"]) - len(dups)
    if n_distinct < min_plans:
        print(f"only {n_distinct} distinct plans of {len(result['digests']) + len(failed)} variants "
              f"({len(dups)} duplicates, {len(failed)} not planned); {min_plans} were requested: no statistics "
              "over duplicates. Ask for fewer (--min-plans) or other plans (--plans)", file=out)
        return 2
    rows = result["rows"]
    names = sorted(rows, key=lambda n: rows[n]["step_s"])
    meas = [rows[n]["step_s"] * 1e3 for n in names]
    obj = [rows[n]["objective_us"] / 1e3 for n in names]
    sim = [rows[n]["predicted_s"] * 1e3 for n in names]
    r_meas, r_obj, r_sim = st.average_ranks(meas), st.average_ranks(obj), st.average_ranks(sim)
    print(f"{'plan':<28} {'digest':<16} {'objective ms':>12} {'sim ms':>9} {'measured ms':>11} "
          f"{'rank obj':>8} {'rank sim':>8} {'rank meas':>9} {'meas/sim':>8}", file=out)
    for i, n in enumerate(names):
        mark = "*" if rows[n].get("repriced") else ""
        print(f"{n:<28} {rows[n]['digest']:<16} {obj[i]:>11.1f}{mark:1} {sim[i]:>9.1f} {meas[i]:>11.1f} "
              f"{r_obj[i]:>8.1f} {r_sim[i]:>8.1f} {r_meas[i]:>9.1f} {meas[i] / sim[i]:>8.2f}", file=out)
    if any(r.get("repriced") for r in rows.values()):
        own, again = result.get("reprice_check", (None, None))
        print("* solved on another profile; its placements re-priced on the free plan's job and calibrated profile"
              + (f" (check: auto's objective {own / 1e3:.1f} ms, re-priced {again / 1e3:.1f} ms)" if again else ""),
              file=out)
    if result.get("reprice_error"):
        print(f"re-pricing failed ({result['reprice_error']}): plans of another profile keep its objective",
              file=out)
    planner = st.regret_of(rows["auto"]["step_s"] * 1e3, meas)
    rho_ok = min(st.spearman(obj, meas), st.spearman(sim, meas)) >= 0.9
    print(f"\n{len(names)} distinct plans (measured best: {names[0]})", file=out)
    print(_scores("ILP objective", obj, meas, names), file=out)
    print(_scores("step simulation", sim, meas, names), file=out)
    print(f"planner regret {planner * 100:.1f}% (the free plan 'auto' measured {rows['auto']['step_s'] * 1e3:.1f} ms)",
          file=out)
    print(f"goal (rho >= 0.9 for both predictors, planner regret <= 2%): "
          f"{'met' if rho_ok and planner <= 0.02 else 'NOT met'}", file=out)
    return 0


def write_scatter(result: dict, path: str | Path) -> Path:
    """The step simulation (x) against the measured median (y) of every timed plan, in ms, as
    an SVG with the y = x line (parallel/auto/plan/pictures/scatter.py)."""
    rows = result["rows"]
    points = [(n, r["predicted_s"] * 1e3, r["step_s"] * 1e3) for n, r in sorted(rows.items())]
    write_html(path, scatter_svg(points, title=f"step simulation vs measured ({len(points)} plans)"))
    return Path(path)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other --section.key value flag goes to the job (e.g. --model.dim 512).")
    p.add_argument("--config", default="llama3_debug")
    p.add_argument("--model", choices=list(MODELS), default="debug", help="a preset of shape flags")
    p.add_argument("--mesh", default="4", help="N (dp_shard N) or AxB (dp_shard A x tp B); default 4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--plans", default="", help="comma-separated subset of the plans (default: all)")
    p.add_argument("--min-plans", type=int, default=None,
                   help=f"distinct plans required (default {MIN_PLANS}, or the number named by --plans)")
    p.add_argument("--plan-dir", default="", help="run folders; a plan an earlier run of this same job saved "
                   "there is loaded, not solved again (a run cut short resumes); default: a fresh temp folder")
    p.add_argument("--scatter", default="", help="the predicted-vs-measured SVG (default: fidelity_scatter.svg "
                   "in --plan-dir, else in outputs/fidelity/)")
    p.add_argument("--explain", action="store_true", help="print each plan's objective breakdown and prediction")
    args, extra = p.parse_known_args(argv)
    try:
        args.mesh_spec = fidelity_mesh(args.mesh)
    except ValueError as e:
        p.error(str(e))
    args.nproc = args.mesh_spec.world
    args.plans = [x for x in args.plans.split(",") if x]
    if args.min_plans is None:
        args.min_plans = len(args.plans) if args.plans else MIN_PLANS
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = _parse(argv)
    from trainer.config import load_config
    from trainer.errors import ConfigError

    flags = [*MODELS[args.model], *COMMON, *mesh_flags(args.mesh_spec), *extra]
    try:  # a bad flag or value stops here, before any rank starts
        load_config(args.config, flags, world_size=args.nproc)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    known = _variants(len(args.mesh_spec.shape))
    unknown = sorted(set(args.plans) - set(known))
    if unknown:
        print(f"--plans: unknown plan(s) {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = run_on_ranks(_Job(args, flags), args.nproc)
    took = time.perf_counter() - t0
    print(f"\n{args.config} ({' '.join(flags[:len(MODELS[args.model])] + extra)}) on {args.nproc} gloo ranks, "
          f"mesh {args.mesh}; {args.steps} timed steps after {args.warmup} warm-up, round-robin ({took:.0f}s)")
    rc = report(result, args.min_plans)
    if rc == 0:
        path = write_scatter(result, args.scatter or Path(args.plan_dir or "outputs/fidelity") / "fidelity_scatter.svg")
        print(f"wrote {path} (step simulation vs measured, one point per plan)")
    if args.explain and rc == 0:
        for name, r in result["rows"].items():
            print(f"\n== {name}\n{r['explain']}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
