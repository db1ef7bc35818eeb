"""Replay vs fresh plans across sequence lengths (the paper's Figure 4), on the cost model
and measured on CPU ranks.

    python scripts/replan.py                      # LLaMA 3 8B, fake 4x8 mesh, h100 profile
    python scripts/replan.py --seq-lens 4096,8192 --local-batch-size 2
    python scripts/replan.py --measure            # debug LLaMA on 4 gloo CPU ranks (2x2 mesh)

Cost model: a plan P0 is solved at `--base-seq` (2048); for every longer sequence the
same job is traced again and (a) solved afresh, (b) P0's placements are replayed on the
new graph and priced by the same problem (`AutoParallel.replay_placement`). Printed:
predicted step time of each, the gain of Fresh over Replay (replay / fresh - 1, the
paper's throughput gain) and the nodes whose placements differ, next to the paper's
measured H100 figures.

--measure: the same question on this machine. Two trainers run the same job with
`[training] seq_len_schedule` stepping through `--measure-seq-lens` (128, 256, 512): one
re-plans at every change (`[parallelism] replan = "fresh"`), the other keeps P0's
placements (`replan = "replay"`); their steps are timed round-robin, and each phase's
median step time (after one warm-up step) is printed, with both runs' losses (equal up
to reduction order: a plan changes how numbers are summed, not what is computed).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time

from parallel.process_exit import freezes_at_exit

# the paper's Figure 4 (LLaMA 3 8B, 4x8 H100s, P0 at 2K): seq -> (gain %, changed nodes); None: not in the text
PAPER = {4096: (1.6, 36), 8192: (41.5, 2437), 16384: (None, None), 32768: (51.3, None)}


def _request(args: argparse.Namespace, seq: int):
    """The planning request at `seq` (as the trainer asks it: parallel/auto/request.py)."""
    from parallel.auto.config import PlannerConfig
    from parallel.auto.request import PlanRequest
    from parallel.precision import mixed_precision_policy

    return PlanRequest(local_batch_size=args.local_batch_size, seq_len=seq,
                       planner=PlannerConfig(hardware=args.hardware, memory_budget_high=args.memory_high),
                       mp_policy=mixed_precision_policy("bfloat16", "float32"))


def cost_rows(args: argparse.Namespace) -> tuple[list[dict], float]:
    """P0 at the base sequence length, then (replay, fresh) at each longer one."""
    from torch.distributed.device_mesh import init_device_mesh

    from models import build_model
    from parallel.auto.api import fake_world
    from parallel.auto.request import planning

    sizes = tuple(int(x) for x in args.mesh.split("x"))
    # one model for every length: RoPE tables long enough for the longest (8B's flavor stops at 8192)
    model = build_model("llama3", args.flavor, device="meta", max_seq_len=max([args.base_seq, *args.seq_lens]))
    rows = []
    with fake_world(math.prod(sizes)):
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("dp", "tp")[: len(sizes)])
        t0 = time.perf_counter()
        with planning(model, mesh, _request(args, args.base_seq)) as autop:
            p0 = autop.optimize_placement(verbose=False)
        print(f"P0 at seq {args.base_seq}: {p0.objective_us / 1e3:,.1f} ms predicted ({p0.status}, "
              f"{time.perf_counter() - t0:.0f}s)", flush=True)
        for seq in args.seq_lens:
            t0 = time.perf_counter()
            with planning(model, mesh, _request(args, seq)) as autop:
                fresh = autop.optimize_placement(verbose=False)
                replay = autop.replay_placement(p0)
            rows.append({"seq": seq, "replay_ms": replay.objective_us / 1e3, "fresh_ms": fresh.objective_us / 1e3,
                         "changed": len(replay.diff(fresh)), "nodes": len(fresh.nodes)})
            print(f"seq {seq}: replay {rows[-1]['replay_ms']:,.1f} ms, fresh {rows[-1]['fresh_ms']:,.1f} ms "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return rows, p0.objective_us / 1e3


def print_cost_table(args: argparse.Namespace, rows: list[dict], p0_ms: float) -> None:
    print(f"\nLLaMA 3 {args.flavor}, mesh {args.mesh} ({args.hardware}), global batch "
          f"{args.local_batch_size * int(args.mesh.split('x')[0])}, P0 solved at seq {args.base_seq} "
          f"({p0_ms:,.1f} ms predicted); predicted step times (cost model)")
    print(f"{'seq':>6} {'replay P0':>11} {'fresh':>11} {'gain':>8} {'changed nodes':>14}   paper (H100, measured)")
    for r in rows:
        gain = (r["replay_ms"] / r["fresh_ms"] - 1) * 100
        pg, pc = PAPER.get(r["seq"], (None, None))
        paper = f"{'+' + format(pg, '.1f') + ' %' if pg is not None else 'n/a':>8}, " \
                f"{pc if pc is not None else 'n/a'} changed"
        print(f"{r['seq']:>6} {r['replay_ms']:>8,.1f} ms {r['fresh_ms']:>8,.1f} ms {gain:>+7.1f}% "
              f"{r['changed']:>6} / {r['nodes']:<6}  {paper}")


def _measure_flags(args: argparse.Namespace, tmp: str, name: str, replan: str) -> list[str]:
    sched = "[" + ", ".join(f"[{i * args.phase_steps}, {s}]" for i, s in enumerate(args.measure_seq_lens)) + "]"
    steps = args.phase_steps * len(args.measure_seq_lens)
    return ["--training.seq_len_schedule", sched, "--training.local_batch_size", str(args.global_batch // 2),
            "--training.steps", str(steps), "--lr_scheduler.decay_steps", "100", "--checkpoint.enable", "false",
            "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1000", "--job.dump_folder", tmp,
            "--job.name", name, "--parallelism.mode", "auto", "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.tensor_parallel_degree", "2", "--parallelism.replan", replan,
            *(["--parallelism.memory_budget_high", str(args.memory_high)] if args.memory_high is not None else [])]


class _MeasureJob:
    """On every rank: two scheduled trainers (fresh, replay), stepped round-robin."""

    def __init__(self, args: argparse.Namespace, tmp: str):
        self.args, self.tmp = args, tmp

    def __call__(self) -> dict:
        import torch.distributed as dist

        from trainer.config import load_config
        from trainer.trainer import Trainer

        built = {v: Trainer(load_config(self.args.config, _measure_flags(self.args, self.tmp, v, v), world_size=4))
                 for v in ("fresh", "replay")}
        for tr in built.values():
            tr.start()
        times: dict[str, dict[int, list[float]]] = {v: {} for v in built}
        losses: dict[str, list[float]] = {v: [] for v in built}
        while built["fresh"].step < built["fresh"].cfg.training.steps:
            for v, tr in built.items():
                dist.barrier()
                t0 = time.perf_counter()
                loss = tr.next_step()
                dist.barrier()
                times[v].setdefault(tr.seq_len, []).append(time.perf_counter() - t0)
                losses[v].append(tr.reduce_mean(float(loss)))
        changed = {s: len(p.diff(built["fresh"].plans[s])) for s, p in built["replay"].plans.items()}
        return {"times": times, "losses": losses, "changed": changed,
                "objective_ms": {v: {s: p.objective_us / 1e3 for s, p in tr.plans.items()} for v, tr in built.items()}}


def measure(args: argparse.Namespace) -> int:
    from tools.bench_common import run_on_ranks, temp_folder

    t0 = time.perf_counter()
    out = run_on_ranks(_MeasureJob(args, temp_folder()), 4)
    print(f"\n{args.config}: 4 gloo CPU ranks (dp_shard 2 x tp 2), global batch {args.global_batch}, "
          f"seq {' -> '.join(map(str, args.measure_seq_lens))} every {args.phase_steps} steps; P0 solved at "
          f"seq {args.measure_seq_lens[0]}; median step after 1 warm-up step per phase "
          f"({time.perf_counter() - t0:.0f}s)")
    print(f"{'seq':>6} {'replay P0':>11} {'fresh':>11} {'gain':>8}   predicted replay / fresh   changed nodes")
    for seq in args.measure_seq_lens[1:]:
        med = {v: statistics.median(out["times"][v][seq][1:] or out["times"][v][seq]) * 1e3 for v in out["times"]}
        pred = {v: out["objective_ms"][v].get(seq) for v in out["objective_ms"]}
        gain = (med["replay"] / med["fresh"] - 1) * 100
        print(f"{seq:>6} {med['replay']:>8,.1f} ms {med['fresh']:>8,.1f} ms {gain:>+7.1f}%"
              f"   {pred['replay']:,.1f} / {pred['fresh']:,.1f} ms {out['changed'][seq]:>10}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(out["losses"]["replay"], out["losses"]["fresh"]))
    print(f"losses: max relative difference replay vs fresh {worst:.1e} over {len(out['losses']['fresh'])} steps")
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@freezes_at_exit  # the process ends after main: no collector walk over the planner's objects
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="8B")
    ap.add_argument("--mesh", default="4x8", help="fake mesh (dp x tp), inputs batch-sharded on dp")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--base-seq", type=int, default=2048, help="sequence length P0 is solved for")
    ap.add_argument("--seq-lens", type=_ints, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--local-batch-size", type=int, default=2, help="per dp rank (global = this x dp)")
    ap.add_argument("--memory-high", type=float, default=None,
                    help="parameter memory budget per device, fraction of the parameter bytes (default: fully "
                         "sharded for the cost model, the trainer's default for --measure)")
    ap.add_argument("--measure", action="store_true", help="measure on 4 gloo CPU ranks instead")
    ap.add_argument("--config", default="llama3_debug", help="--measure: the job")
    ap.add_argument("--measure-seq-lens", type=_ints, default=[128, 256, 512])
    ap.add_argument("--phase-steps", type=int, default=5, help="--measure: steps per sequence length")
    ap.add_argument("--global-batch", type=int, default=8, help="--measure: global batch")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.measure:
        return measure(args)
    rows, p0_ms = cost_rows(args)
    print_cost_table(args, rows, p0_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
