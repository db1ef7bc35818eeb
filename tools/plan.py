"""Plan a job's model on a fake mesh (no GPU): progress, per-layer summary, objective, JSON plan.

    python scripts/plan.py --config llama3_8b.toml --mesh 4x8 [--hardware h100] [--out plan.json]
        [--html plan.html] [--diff other_plan.json] [--coverage]
    python scripts/plan.py --show saved_plan.json --html plan.html [--diff other_plan.json]
    python scripts/plan.py --config llama3_8b.toml --mesh auto --world-size 32 --hardware h100 [--workers 2]

--mesh auto plans every mesh of --world-size devices (parallel/auto/search/mesh_search.py; cached) at one
global batch ([training] global_batch_size, else local_batch_size x world size; each mesh's local
batch = global / its data degree, more micro-batches where a plan does not fit), prints them
ranked by the predicted time of that step (meshes that cannot divide the batch or do not fit
listed after, with the reason) and goes on with the best. Pipelined meshes (pp x dp_shard x tp,
1F1B and Interleaved1F1B, pp or 2 x pp microbatches) are searched too when the world spans nodes
(--pipelines / --no-pipelines to choose), and TorchTitan's recipe shapes for the model (FSDP;
70B: FSDP·TP8; 405B: FSDP8·TP8·PP8 Interleaved1F1B) are priced beside the pick. From 64 devices
(--screen / --no-screen) every candidate is screened with a cheaper request of the same cost model
and the --verify best, with the recipe shapes, are planned with the job's whole request
(parallel/auto/search/screen.py); the pick is the fastest of those.

The summary gives the predicted peak memory per device (parameters, gradients, AdamW
states, activations, transients, with the config's activation checkpointing) against the
memory limit (--memory-limit, [parallelism] memory_limit_gib, else the profile's); a plan
over it is re-solved more sharded, and when none fits the script says what does not fit.

--html writes the plan as a self-contained page (the step as a timeline, parameters per layer
group and mesh axis, collectives, memory); with --diff OTHER it is the side-by-side diff of
OTHER (a saved plan: its page says which pictures a loaded plan cannot draw) and this one
instead; an OTHER that is damaged or of another version is one line naming it, exit 2.
--show SAVED draws a saved plan (its step simulation saved with it) without planning: no
--config or --mesh; a SAVED that is damaged or of another version is one line, exit 2.
--coverage prints every ATen op of the traced graph and how the planner handles it (DTensor
rule, constant, lifted constant, fallback, folded, unhandled).

The job is planned exactly as the trainer plans it (parallel/auto/request.py): every
[parallelism] planner setting of the config and its overrides (--parallelism.split_seeding_rounds 2)
applies; --hardware, --solver, --time-limit, --memory-high and --memory-limit are shorthands
that override the config's. The global batch is local_batch_size x the product of the data
axes (dp, dp_replicate, dp_shard), and the token/label inputs are batch-sharded on them (what
the trainer's data loader feeds), unless --free-inputs is given; a cp axis takes the sequence
load-balanced with its positions. Axes of size 1 are dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import MemoryLimitError, fake_world
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.plan.html import save_diff_html, save_html
from parallel.auto.plan.pipeline import PipelinePlan
from parallel.auto.plan.pipeline_html import save_pipeline_html
from parallel.auto.request import planning
from parallel.auto.search.mesh_search import ranked_table, search_global_batch, search_with_recipes
from parallel.auto.search.mesh_space import MeshSearchError, MeshSpec, parse_mesh
from parallel.auto.search.point import PlanCache
from parallel.auto.search.recipe_shapes import compare_line
from parallel.process_exit import freezes_at_exit
from trainer.auto_mode import base_job, plan_request
from trainer.config import load_config

PLAN_AXIS_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp"), 4: ("dp_replicate", "dp_shard", "cp", "tp")}
"""Axis names of an unnamed --mesh (4x8) without --axis-names: "dp", the one-word data axis."""


def mesh_of(args: argparse.Namespace) -> MeshSpec:
    """--mesh (4x8, or dp_shard=4,tp=8) with --axis-names, else this program's names by rank."""
    names = tuple(n.strip() for n in args.axis_names.split(",")) if args.axis_names else PLAN_AXIS_NAMES
    try:
        return parse_mesh(args.mesh, names)
    except MeshSearchError as e:
        raise SystemExit(f"--mesh: {e}") from None


def job_config(args: argparse.Namespace):
    """The config with its overrides and this script's shorthands for them."""
    cfg = load_config(args.config, args.overrides, validate=False)
    t = cfg.training
    shorthands = {key: value for key, value in (
        ("hardware", args.hardware), ("solver", args.solver), ("time_limit", args.time_limit),
        ("memory_budget_high", args.memory_high), ("memory_limit_gib", args.memory_limit)) if value is not None}
    try:
        cfg.parallelism = dataclasses.replace(cfg.parallelism, planner=cfg.parallelism.planner.replace(**shorthands))
    except ValueError as e:
        raise SystemExit(f"{cfg.source}: [parallelism] {e}") from None
    t.local_batch_size = args.local_batch_size or t.local_batch_size
    t.seq_len = args.seq_len or t.seq_len
    return cfg


def plan_job(args: argparse.Namespace) -> tuple:
    cfg = job_config(args)
    spec = mesh_of(args)
    sizes, names, world = spec.shape, spec.names, spec.world
    model = build_model(cfg.model.name, cfg.model.flavor, device="meta", **cfg.model.arg_overrides())
    with fake_world(world):
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        request = plan_request(cfg, mesh)  # "auto" hardware: the fake world's (cached measurement, else cpu)
        hardware = getattr(request.planner.hardware, "name", request.planner.hardware)
        print(f"planning {cfg.model.name} {cfg.model.flavor} on mesh {sizes} {names} ({world} ranks, "
              f"{hardware}); local batch {request.local_batch_size} x seq {request.seq_len}; "
              f"mixed precision {cfg.training.mixed_precision_param}", flush=True)
        t0 = time.perf_counter()
        with planning(model, mesh, request) as autop:
            if args.coverage:
                print(autop.coverage(), flush=True)
            if args.free_inputs:
                autop.constraints = [c for c in autop.constraints if c.kind != "input"]
            plan = autop.optimize_placement(verbose=True)
        plan.timings["total"] = time.perf_counter() - t0
    return plan, autop


def search_job(args: argparse.Namespace) -> Plan | PipelinePlan | None:
    """--mesh auto: plan every mesh of --world-size (cached) and TorchTitan's recipe shapes, print
    the meshes ranked and the recipes beside the pick, return the best plan."""
    cfg = job_config(args)
    hardware = cfg.parallelism.planner.hardware
    if hardware == "auto":
        raise SystemExit("--mesh auto plans for a named profile: pass --hardware (e.g. h100)")
    cache = PlanCache(args.cache_dir)
    t0 = time.perf_counter()
    try:
        found = search_with_recipes(base_job(cfg), args.world_size, hardware, workers=args.workers, cache=cache,
                                    pipelines=args.pipelines, screen=args.screen, verify=args.verify)
    except MeshSearchError as e:
        raise SystemExit(f"--world-size {args.world_size}: {e}") from None
    gb = search_global_batch(base_job(cfg), args.world_size)
    how = "screened (search/screen.py: MRF, recomputation fixed, model states only)" if found.screened else "planned"
    print(f"meshes of {args.world_size} devices for {cfg.model.name} {cfg.model.flavor} on {hardware}, "
          f"global batch {gb} x seq {cfg.training.seq_len}, {how}, ranked by predicted step time "
          f"(searched in {time.perf_counter() - t0:.0f} s):")
    print(ranked_table(found.rows))
    print("TorchTitan's recipe shapes, priced the same way:")
    print(compare_line(next((r for r in found.rows if r["rank"] == 1), None), found.recipes))
    if found.screened and (found.verified or found.verified_recipes):
        print("the screen's leaders planned with the job's whole request (what the trainer plans):")
        print(ranked_table(found.verified))
        print("TorchTitan's recipe shapes planned the same way:")
        print(compare_line(found.best, found.verified_recipes))
    best = found.best
    if best is None:
        raise SystemExit(f"no mesh of {args.world_size} devices fits; lower the batch, the sequence or the budget")
    if best.get("depth_scaled"):  # screened on shallow copies: no plan of the model was made
        print(f"best mesh: {best['mesh']}{' ' + best['pipeline'] if best.get('pipeline') else ''} "
              f"({best['step_ms']:.1f} ms per step predicted by the screen); it has no plan of the whole model "
              "yet: run again with --verify 1 to plan it")
        return None
    plan = cache.pipeline_plan(best["key"]) if best.get("pipeline") else cache.plan(best["key"])
    if plan is None:
        raise SystemExit(f"the best mesh's plan is missing from the cache {cache.folder}; run again")
    how = (f"{best['pipeline']} microbatches of {best['local_batch']}" if best.get("pipeline") else
           f"local batch {best['local_batch']} x {best.get('micro_batches', 1)} micro-batches")
    print(f"best mesh: {best['mesh']}, {how} ({best['step_ms']:.1f} ms per step predicted)")
    return plan


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The combinations of flags that make sense (argparse's usage error, exit 2, otherwise)."""
    if args.show:
        if not args.html:
            ap.error("--show needs --html (the page it writes)")
        if args.config or args.mesh or args.overrides:
            ap.error("--show draws a saved plan: it takes no --config, --mesh or config overrides")
        return
    if not args.config or not args.mesh:
        ap.error("--config and --mesh are required (or --show SAVED_PLAN_JSON --html PAGE)")
    if args.diff and not args.html:
        ap.error("--diff needs --html (the page it writes)")
    if (args.mesh == "auto") != (args.world_size is not None):
        ap.error("--mesh auto and --world-size N go together")


def _load(path: str | None, flag: str) -> Plan | None:
    """A saved plan named on the command line; PlanMismatchError with the flag in front."""
    if not path:
        return None
    try:
        return Plan.load(path)
    except PlanMismatchError as e:
        raise PlanMismatchError(f"{flag} {e}") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="job TOML (path or name under configs/)")
    ap.add_argument("--mesh", default=None, help="mesh shape, e.g. 8 or 4x8; auto: search every mesh of --world-size")
    ap.add_argument("--show", default=None, metavar="SAVED_PLAN_JSON",
                    help="with --html: draw this saved plan instead of planning (no --config, --mesh)")
    ap.add_argument("--world-size", type=int, default=None, help="with --mesh auto: the number of devices")
    ap.add_argument("--workers", type=int, default=2, help="with --mesh auto: planning processes")
    ap.add_argument("--pipelines", action=argparse.BooleanOptionalAction, default=None,
                    help="with --mesh auto: search pipelined meshes too (default: when the world spans nodes)")
    ap.add_argument("--screen", action=argparse.BooleanOptionalAction, default=None,
                    help="with --mesh auto: screen every candidate cheaply, plan the leaders in full (default: "
                         "from 64 devices)")
    ap.add_argument("--verify", type=int, default=3, help="with --mesh auto --screen: leaders planned in full")
    ap.add_argument("--cache-dir", default=None, help="with --mesh auto: plan cache (default ~/.cache/autotitan/plans)")
    ap.add_argument("--axis-names", default=None, help="comma-separated mesh axis names (default dp[,tp])")
    ap.add_argument("--hardware", default=None, help="hardware profile (default: [parallelism] hardware)")
    ap.add_argument("--out", default=None, help="write the plan JSON here")
    ap.add_argument("--html", default=None, help="write the plan as a self-contained HTML page here")
    ap.add_argument("--diff", default=None, metavar="OTHER_PLAN_JSON",
                    help="with --html: the page is OTHER (a saved plan.json) and this plan side by side")
    ap.add_argument("--local-batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--memory-high", type=float, default=None, help="parameter memory budget (fraction)")
    ap.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                    help="predicted peak memory per device may reach this (default: [parallelism] memory_limit_gib, "
                         "else the hardware profile's); 'inf': no limit")
    ap.add_argument("--solver", default=None, choices=["auto", "ilp", "mrf", "highs", "cbc"])
    ap.add_argument("--time-limit", type=float, default=None, help="solver seconds (default: [parallelism] time_limit)")
    ap.add_argument("--free-inputs", action="store_true", help="do not constrain inputs to batch sharding")
    ap.add_argument("--coverage", action="store_true",
                    help="print every ATen op of the traced graph and how the planner handles it")
    return ap


@freezes_at_exit  # the process ends after main: no collector walk over the planner's objects
def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    # anything else is a config override, e.g. --training.seq_len 2048
    args, extra = ap.parse_known_args(argv)
    args.overrides = extra
    _check_args(ap, args)
    try:  # fail before planning, not after
        other = _load(args.diff, "--diff")
        shown = _load(args.show, "--show")
    except PlanMismatchError as e:  # damaged, not a plan, or another version's: one line naming the file
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        if shown is not None:
            plan = shown
        elif args.mesh == "auto":
            plan = search_job(args)
        else:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
            plan, _ = plan_job(args)
    except MemoryLimitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if plan is None:  # a screen's pick without a plan of its own (said above)
        return 0
    if isinstance(plan, PipelinePlan):  # the search picked a pipeline
        return _pipeline_out(plan, args)
    print(plan.summary())
    print(f"objective: {plan.objective_us:,.1f} µs per step ({plan.status}, {plan.solver}); "
          f"timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in plan.timings.items()))
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if args.html and other is not None:
        mine = os.path.basename(args.show) if args.show else "this plan"
        save_diff_html(other, plan, args.html, names=(os.path.basename(args.diff), mine))
        print(f"{len(other.diff(plan))} nodes changed; diff page written to {args.html}")
    elif args.html:
        save_html(plan, args.html)
        print(f"plan page written to {args.html}")
    return 0


def _pipeline_out(plan: PipelinePlan, args: argparse.Namespace) -> int:
    """A pipeline's plan: its summary; --out writes it (replayable by the trainer's plan_file),
    --html its page (pipeline_plan.html and a page per stage, beside the --html path)."""
    print(plan.summary())
    if args.out:
        plan.save(args.out)
        print(f"pipeline plan written to {args.out}")
    if args.html:
        folder = Path(args.html).parent
        save_pipeline_html(plan, folder)
        print(f"pipeline page written to {folder / 'pipeline_plan.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
