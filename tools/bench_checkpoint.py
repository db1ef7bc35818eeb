"""What a checkpoint save costs the training step, blocking vs async ([checkpoint] async_mode),
on 2 gloo ranks (FSDP) of this machine.

    python scripts/bench_checkpoint.py [--steps 16] [--interval 4] [--dim 512] [--layers 4] [--timeout 600]

Each mode runs the same job under torchrun; rank 0 times every step (`Trainer.next_step`,
the save included). Printed per mode, medians after the first `--warmup` steps: a step
without a save, a step that saves (blocking: the whole write; async: the CPU snapshot and
the start of the write), the step after a save (async: it runs while the write goes on),
and the wall time of the training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("disabled", "async")


def job_args(args: argparse.Namespace, mode: str, folder: str) -> list[str]:
    return ["--model.dim", str(args.dim), "--model.n_layers", str(args.layers), "--model.n_heads", "8",
            "--training.seq_len", "128", "--training.local_batch_size", "4", "--training.steps", str(args.steps),
            "--metrics.log_freq", "1000", "--checkpoint.enable", "true", "--checkpoint.interval", str(args.interval),
            "--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode", mode, "--job.dump_folder", folder,
            "--job.name", f"bench-{mode}"]


def worker(args: argparse.Namespace) -> None:
    """One rank of one mode's job (under torchrun): rank 0 prints its step times as JSON."""
    import torch.distributed as dist

    import train
    from trainer.config import load_config
    from trainer.trainer import Trainer

    train.init_distributed()
    tr = Trainer(load_config("llama3_debug", job_args(args, args.worker, args.folder)))
    times: list[tuple[int, float, bool]] = []
    step = tr.next_step

    def timed() -> object:
        t0 = time.perf_counter()
        out = step()
        times.append((tr.step, time.perf_counter() - t0, tr.checkpointer.should_save(tr.step, args.steps)))
        return out

    tr.next_step = timed
    t0 = time.perf_counter()
    tr.train()
    wall = time.perf_counter() - t0
    dist.barrier()
    if dist.get_rank() == 0:
        print("BENCH " + json.dumps({"params": tr.num_params, "times": times, "wall": wall}), flush=True)
    dist.destroy_process_group()


def run_mode(args: argparse.Namespace, mode: str, folder: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tools.bench_checkpoint", "--worker", mode, "--folder", folder, "--steps", str(args.steps),
           "--interval", str(args.interval), "--dim", str(args.dim), "--layers", str(args.layers)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(line[6:])


def summary(res: dict, warmup: int) -> dict[str, float]:
    """Medians (ms) of steps without / with a save and of the step after a save; wall seconds."""
    times = [(s, t, saved) for s, t, saved in res["times"] if s > warmup]
    saved_steps = {s for s, _, saved in times if saved}
    plain = [t for s, t, saved in times if not saved and s - 1 not in saved_steps]
    after = [t for s, t, saved in times if not saved and s - 1 in saved_steps]
    med = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
    return {"plain": med(plain), "save": med([t for _, t, saved in times if saved]), "after": med(after),
            "wall": res["wall"], "saves": len(saved_steps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mode's job")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            res = run_mode(args, mode, folder)
            rows[mode] = summary(res, args.warmup)
    print(f"2 gloo ranks (FSDP), {res['params'] / 1e6:.1f}M params, {args.steps} steps, a save every "
          f"{args.interval}; medians in ms")
    print(f"{'async_mode':<10} {'step':>8} {'save step':>10} {'next step':>10} {'loop s':>8}")
    for mode, r in rows.items():
        print(f"{mode:<10} {r['plain']:>8.1f} {r['save']:>10.1f} {r['after']:>10.1f} {r['wall']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
