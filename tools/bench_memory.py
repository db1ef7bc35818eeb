"""The planner's peak-memory estimate against the allocator, per rank, on gloo CPU ranks.

    python scripts/bench_memory.py --nproc 2                       # every plan on 2 ranks
    python scripts/bench_memory.py --nproc 4 --plans ddp,fsdp,tp   # some plans on 4 ranks
    python scripts/bench_memory.py --nproc 2 --plans auto_compiled # the compiled step (reported apart)

The job: debug LLaMA 3 (4 layers, dim 1024, vocab 256), seq 512, local batch 1, fp32, AdamW
(foreach), auto mode: a job whose peak falls in the backward for the FSDP-like, free, AC and
CP plans (the replicated states of DDP and TP put theirs in the optimizer step; at dim 256
and local batch 4 every plan without AC peaked at the loss). One Trainer per plan: DDP-,
FSDP- and TP-like (parallel/auto/search/presets.py), the planner's free choice, each of FSDP and
free with full activation checkpointing, and a cp axis of 2. Each rank trains one warm-up
step (the step graph is built, AdamW's states appear), then one measured step
(`Trainer.train_step`: zero_grad, forward, loss, backward, clipping, AdamW) under
`parallel.measure.AllocatorPeak`: the CPU allocator's own running total over every thread's
allocations and frees (gloo's worker threads included), its peak, the phase (the trainer's
step markers) and the op at the peak. Measured peak = the bytes alive when the step begins
that the estimate counts as state (parameter shards, buffers, AdamW states:
`parallel.measure.state_bytes`; the previous gradients are freed at the step's
zero_grad) + the allocator's peak inside the step. The estimate is the plan's own
(`plan.memory`, made by the planner for the job's runtime options; rank 0's shards).
Two requested plans that come out as one (the same placement digest, mesh, activation
checkpointing and compile setting: e.g. the free plan is the DDP-shaped one) are not
measured twice: the run names them and exits 2 without a table.
RSS: the kernel's peak resident set during the step (VmHWM, reset at the step's start)
minus the RSS at its start: glibc keeps freed blocks and the step reuses them, so it is a
lower bound of the step's growth, shown as an independent, coarse observer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tools.bench_common import run_on_ranks, temp_folder

JOB = ["--model.n_layers", "4", "--model.dim", "1024", "--training.seq_len", "512",
       "--training.local_batch_size", "1",
       "--training.mixed_precision_param", "float32", "--parallelism.mode", "auto",
       "--parallelism.hardware", "cpu", "--parallelism.time_limit", "60", "--checkpoint.enable", "false",
       "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "100000", "--metrics.hardware", "cpu",
       "--lr_scheduler.warmup_steps", "0"]
FULL_AC = ["--activation_checkpoint.mode", "full"]
# plan -> (preset name or None, job flags); the presets act on mesh axis 0
PLANS = {
    "ddp": ("ddp", []),
    "fsdp": ("fsdp", []),
    "fsdp_ac": ("fsdp", FULL_AC),
    "tp": ("megatron", ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree",
                        "{n}"]),
    "auto": (None, []),
    "auto_ac": (None, FULL_AC),
    "cp": (None, ["--parallelism.data_parallel_shard_degree", "{half}", "--parallelism.context_parallel_degree",
                  "2"]),
    "auto_compiled": (None, ["--training.compile", "true"]),
}
DEFAULT_PLANS = [p for p in PLANS if p != "auto_compiled"]


def _constraints(preset: str | None):
    if preset is None:
        return None
    from parallel.auto.search import presets

    if preset == "megatron":
        return lambda autop: presets.megatron(autop, 0)
    return getattr(presets, preset)


class _Job:
    """Every rank: build each plan's trainer in turn, one warm-up step, one measured step;
    rank 0 returns every rank's rows."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.tmp = args, temp_folder()

    def _trainer(self, name: str) -> object:
        from trainer.config import load_config
        from trainer.trainer import Trainer

        n = self.args.nproc
        preset, extra = PLANS[name]
        flags = [*JOB, *self.args.job_flags, *(f.format(n=n, half=max(n // 2, 1)) for f in extra),
                 "--training.steps", "3",
                 "--job.dump_folder", self.tmp, "--job.name", name]
        return Trainer(load_config(self.args.config, flags, world_size=n), plan_constraints=_constraints(preset))

    def _measure(self, name: str, seen: dict[tuple, str]) -> dict:
        import torch.distributed as dist

        from parallel.measure import AllocatorPeak, state_bytes

        t0 = time.perf_counter()
        tr = self._trainer(name)
        setup = time.perf_counter() - t0
        key = plan_identity(tr)
        if key in seen:  # every rank has the same plan, so every rank skips it: no collective waits
            return {"plan": name, "rank": dist.get_rank(), "duplicate_of": seen[key], "identity": key}
        seen[key] = name
        batches = iter(tr.dataloader)
        tr.train_step(*next(batches))  # warm-up: step graph built, AdamW states created
        inputs, labels = next(batches)
        dist.barrier()
        tr.optimizer.zero_grad(set_to_none=True)  # train_step's own first act: the base has no gradients
        base = state_bytes(tr.model, tr.optimizer)
        with AllocatorPeak(tr.device) as mem:
            tr.train_step(inputs, labels)
        m = mem.result
        est = tr.model.plan.memory
        t_args = tr.cfg.training
        dims = ", ".join(f"{k} {v}" for k, v in tr.cfg.model.arg_overrides().items())
        job = f"{tr.cfg.model.flavor} ({dims}), seq {t_args.seq_len}, local batch {t_args.local_batch_size}"
        row = {"plan": name, "rank": dist.get_rank(), "base": base, "step_peak": m.peak_bytes, "job": job,
               "measured": base + m.peak_bytes, "phase": m.phase, "op": m.op, "events": m.events,
               "rss_growth": (m.rss_peak - m.rss_start) if m.rss_peak else None, "rss_peak": m.rss_peak,
               "estimate": est.peak_bytes if est is not None else None,
               "est_phase": est.phase if est is not None else "", "est_parts": est.parts() if est is not None else "",
               "est_state": (est.params_bytes + est.optimizer_bytes) if est is not None else None,
               "setup_s": setup, "summary": tr.model.plan.summary().splitlines()[0], "identity": key}
        del tr
        return row

    def __call__(self) -> list[dict]:
        import torch.distributed as dist

        seen: dict[tuple, str] = {}
        rows = [self._measure(name, seen) for name in self.args.plans]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, rows)
        return [r for rank_rows in every for r in rank_rows]


def plan_identity(trainer: object) -> tuple:
    """What makes two measured plans the same run: the placement digest of the plan, the mesh,
    and the runtime settings that change memory without changing placements (activation
    checkpointing, compile). Two requested plans with one identity would be one row twice."""
    cfg = trainer.cfg
    mesh = trainer.mesh
    return (trainer.model.plan.placement_digest(), tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()),
            cfg.activation_checkpoint.mode, bool(cfg.training.compile))


def duplicates(rows: list[dict]) -> list[str]:
    """'b is a' for every requested plan that came out as an earlier one (rank 0's rows)."""
    return [f"{r['plan']} is {r['duplicate_of']} (placement digest {r['identity'][0]}, mesh {r['identity'][1]}, "
            f"activation checkpointing {r['identity'][3]}, compile {r['identity'][4]})"
            for r in rows if r["rank"] == 0 and r.get("duplicate_of")]


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    mib = 2**20
    print(f"\n{'plan':<14}{'rank':>4}{'estimate':>10}{'measured':>10}{'error':>8}{'state':>8}{'est st.':>8}"
          f"{'RSS+':>8}  {'phase (measured / estimated)':<28} op at the peak")
    for r in sorted(rows, key=lambda r: (args.plans.index(r["plan"]), r["rank"])):
        est = r["estimate"]
        err = f"{est / r['measured'] - 1:+.1%}" if est else "n/a"
        rss = f"{r['rss_growth'] / mib:.1f}" if r["rss_growth"] is not None else "n/a"
        print(f"{r['plan']:<14}{r['rank']:>4}{(est or 0) / mib:>10.1f}{r['measured'] / mib:>10.1f}{err:>8}"
              f"{r['base'] / mib:>8.1f}{(r['est_state'] or 0) / mib:>8.1f}{rss:>8}  "
              f"{r['phase'] + ' / ' + r['est_phase']:<28} {r['op']}")
    print("\nMiB per rank; error = estimate / measured - 1; state = parameter shards, buffers, AdamW states "
          "alive at the step's start (measured) / in the estimate; RSS+ = peak RSS during the step minus RSS "
          "at its start")
    for r in rows:
        if r["rank"] == 0:
            print(f"  {r['plan']}: {r['summary']}; estimate: {r['est_parts']}; setup {r['setup_s']:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3_debug_auto")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--plans", default=",".join(DEFAULT_PLANS),
                   help=f"comma-separated, of {', '.join(PLANS)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--job", default="", help="more job flags, after the default job's (e.g. '--model.dim 1024 "
                   "--training.local_batch_size 1': a job whose peak falls in the backward)")
    args = p.parse_args(argv)
    args.job_flags = args.job.split()
    args.plans = [x for x in args.plans.split(",") if x]
    bad = [x for x in args.plans if x not in PLANS]
    if bad:
        print(f"bench_memory: --plans {','.join(bad)}: unknown plan; use some of {', '.join(PLANS)}", file=sys.stderr)
        return 2
    if "cp" in args.plans and args.nproc % 2:
        print(f"bench_memory: --nproc {args.nproc} with plan cp: the cp axis has 2 ranks; use an even --nproc",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = run_on_ranks(_Job(args), args.nproc, threads=args.threads)
    same = duplicates(rows)
    if same:
        distinct = len(args.plans) - len(same)
        print(f"bench_memory: {distinct} distinct plans of the {len(args.plans)} requested on {args.nproc} ranks "
              f"({'; '.join(same)}); a table would show one measurement twice: drop the duplicates from "
              f"--plans, or give the job a shape where they differ (--job, --nproc)", file=sys.stderr)
        return 2
    print(f"\n{args.config} {' '.join(args.job_flags)}: {rows[0]['job']}, fp32, AdamW; {args.nproc} gloo ranks; "
          f"measured step 2 of each plan ({time.perf_counter() - t0:.0f}s in all)")
    _print(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
