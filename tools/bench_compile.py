"""The training step's runtime, measured: compile, activation checkpointing, overlap.

    python scripts/bench_compile.py                 # tokens/s: eager vs compiled, auto and manual FSDP, 2 ranks
    python scripts/bench_compile.py --table ac      # peak memory of each AC mode, auto and manual, 2 ranks
    python scripts/bench_compile.py --table overlap --nproc 4   # auto step time with and without overlap

The job (issue 11's): debug LLaMA with 6 layers, dim 256, 16 heads, vocab 2048, seq 512,
local batch 8, fp32, AdamW, on gloo CPU ranks. Every variant is a Trainer built from the
same config; steps are timed round-robin (tools/bench_common.py), medians quoted.
Memory (`--table ac`) is the peak of live tensor bytes during one training step, tracked
per storage by the dry run's dispatch-level tracker (eager graphs: the compiled kernels'
internal buffers would be invisible to it).
"""

from __future__ import annotations

import argparse
import time

from tools.bench_common import run_on_ranks, temp_folder, time_round_robin

JOB = ["--model.n_layers", "6", "--model.dim", "256", "--model.n_heads", "16", "--model.n_kv_heads", "16",
       "--model.vocab_size", "2048", "--training.seq_len", "512", "--training.local_batch_size", "8",
       "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "100000"]
COMPILE_VARIANTS = {
    "auto_eager": ["--parallelism.mode", "auto", "--training.compile", "false"],
    "auto_compiled": ["--parallelism.mode", "auto", "--training.compile", "true"],
    "auto_autotune": ["--parallelism.mode", "auto", "--training.compile", "true", "--training.compile_mode",
                      "max-autotune"],
    "fsdp_eager": ["--parallelism.mode", "manual", "--training.compile", "false"],
    "fsdp_compiled": ["--parallelism.mode", "manual", "--training.compile", "true"],
}
AC_MODES = {"none": ["--activation_checkpoint.mode", "none"], "full": ["--activation_checkpoint.mode", "full"],
            "selective_op": ["--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op"],
            "selective_2": ["--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_ac_option", "2"]}


def _variants(args: argparse.Namespace) -> dict[str, list[str]]:
    if args.table == "compile":
        return {k: v for k, v in COMPILE_VARIANTS.items() if k in args.variants}
    if args.table == "ac":
        return {f"{mode}_{ac}": ["--parallelism.mode", mode] + flags for mode in ("auto", "manual")
                for ac, flags in AC_MODES.items()}
    return {"auto_overlap": ["--parallelism.mode", "auto", "--parallelism.overlap", "true"],
            "auto_no_overlap": ["--parallelism.mode", "auto", "--parallelism.overlap", "false"]}


class _Job:
    """What every rank runs: build the variants' trainers, time them, measure memory."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.variants = _variants(args)
        self.tmp = temp_folder()

    def build(self, name: str) -> object:
        from trainer.config import load_config
        from trainer.trainer import Trainer

        a = self.args
        flags = [*JOB, *self.variants[name], "--training.steps", str(a.warmup + a.steps), "--job.dump_folder",
                 self.tmp, "--job.name", name, "--parallelism.hardware", a.hardware]
        return Trainer(load_config(a.config, flags, world_size=a.nproc))

    def __call__(self) -> dict:
        built, setup = {}, {}
        for name in self.variants:
            t0 = time.perf_counter()
            built[name] = self.build(name)
            setup[name] = time.perf_counter() - t0
        measure = _peak_memory if self.args.table == "ac" else None
        out = time_round_robin(built, self.args.warmup, self.args.steps, measure)
        for name, row in out.items():
            row["setup_s"] = setup[name]
            graphs = getattr(built[name].model, "step_graphs", {})
            row["first_call_s"] = max((g.first_call_seconds or 0.0 for g in graphs.values()), default=None)
        return out


def _peak_memory(name: str, trainer: object) -> dict:
    """Peak live tensor bytes of one more training step (rank 0's), eager graphs."""
    from parallel.measure import MemoryTracker

    inputs, labels = next(iter(trainer.dataloader))
    tracker = MemoryTracker()
    with tracker:
        trainer.train_step(inputs, labels)
    return {"peak_bytes": tracker.peak}


def _print_compile(rows: dict, args: argparse.Namespace) -> None:
    print(f"{'variant':<15} {'step (median)':>14} {'tokens/s':>10} {'setup':>8} {'first step':>11}  final loss")
    for name, r in rows.items():
        first = f"{r['first_call_s']:.1f}s" if r.get("first_call_s") else "-"
        print(f"{name:<15} {r['step_s'] * 1e3:>11.1f} ms {r['tokens_per_s']:>10.0f} {r['setup_s']:>7.1f}s "
              f"{first:>11}  {r['losses'][-1]:.4f}")
    tps = {k: r["tokens_per_s"] for k, r in rows.items()}
    for a, b in (("auto_compiled", "auto_eager"), ("auto_autotune", "auto_eager"), ("auto_compiled", "fsdp_eager"),
                 ("fsdp_compiled", "fsdp_eager")):
        if a in tps and b in tps:
            print(f"ratio {a} / {b}: {tps[a] / tps[b]:.2f}")


def _print_ac(rows: dict, args: argparse.Namespace) -> None:
    print(f"{'AC mode':<14} {'auto peak':>12} {'manual peak':>12} {'auto step':>10} {'manual step':>12}")
    for ac in AC_MODES:
        a, m = rows[f"auto_{ac}"], rows[f"manual_{ac}"]
        print(f"{ac:<14} {a['peak_bytes'] / 2**20:>9.1f} MiB {m['peak_bytes'] / 2**20:>9.1f} MiB "
              f"{a['step_s'] * 1e3:>7.0f} ms {m['step_s'] * 1e3:>9.0f} ms")
    base = rows["auto_none"]["losses"]
    for ac in AC_MODES:
        d = max(abs(x - y) for x, y in zip(rows[f"auto_{ac}"]["losses"], base))
        print(f"auto {ac}: max |loss - loss(none)| over {len(base)} steps = {d:.2e}")


def _print_overlap(rows: dict, args: argparse.Namespace) -> None:
    on, off = rows["auto_overlap"], rows["auto_no_overlap"]
    print(f"{args.nproc} ranks: step {on['step_s'] * 1e3:.1f} ms with overlap, {off['step_s'] * 1e3:.1f} ms without "
          f"(ratio {off['step_s'] / on['step_s']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", choices=["compile", "ac", "overlap"], default="compile")
    p.add_argument("--config", default="llama3_debug")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hardware", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--variants", nargs="+", default=[v for v in COMPILE_VARIANTS if v != "auto_autotune"],
                   choices=list(COMPILE_VARIANTS))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = run_on_ranks(_Job(args), args.nproc, threads=args.threads)
    print(f"\n{args.config}: 6 layers, dim 256, 16 heads, vocab 2048, seq 512, local batch 8, fp32; {args.nproc} "
          f"gloo ranks; {args.steps} timed steps after {args.warmup} warm-up, round-robin "
          f"({time.perf_counter() - t0:.0f}s in all)")
    {"compile": _print_compile, "ac": _print_ac, "overlap": _print_overlap}[args.table](rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
