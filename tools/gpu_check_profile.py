"""A training job whose last step runs under the PyTorch profiler, for scripts/gpu_check.sh.

    torchrun --standalone --nproc_per_node=1 scripts/gpu_check_profile.py --out DIR --name NAME \
        [--warmup 3] --config llama3_debug [--section.key value ...]

Builds the job's Trainer as train.py does (a process group from torchrun's variables, which auto
mode needs), trains `--warmup` steps (compilation, the plan's first runs; every step logged, as in
training: loss, tok/s, MFU, memory), then one more step under `torch.profiler.profile` (CPU and
CUDA activities). Rank 0 writes DIR/NAME.json.gz (a Chrome trace: ui.perfetto.dev or
chrome://tracing) and DIR/NAME_kernels.txt (the top 15 ops by CUDA time, then the top 15 GPU
kernels by their own time) and prints that text. A profiler that fails is reported and the job
still finishes (its step lines stand); a training error is the run's error.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from trainer.config import load_config
from trainer.device import backend, local_device, synchronize
from trainer.trainer import Trainer

ROWS = 15


def _self_device_us(evt) -> float:
    """A profiler average's own device time (µs), under the name of this torch version."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def kernel_table(prof, rows: int = ROWS) -> str:
    """The GPU kernels alone (device-side events), by their own time: where the step's GPU time goes."""
    kernels = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kernels.sort(key=_self_device_us, reverse=True)
    total = sum(_self_device_us(e) for e in kernels) or 1.0
    lines = [f"GPU kernels: {len(kernels)} distinct, {total / 1e3:,.2f} ms of kernel time in the step",
             f"{'ms':>9} {'%':>6} {'calls':>6}  kernel"]
    for e in kernels[:rows]:
        us = _self_device_us(e)
        lines.append(f"{us / 1e3:>9.3f} {100 * us / total:>5.1f}% {e.count:>6}  {e.key[:140]}")
    return "\n".join(lines)


def profile_last_step(tr: Trainer):
    """One step under the profiler; the profile, or None (said why) when the profiler itself fails."""
    cuda = tr.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    entered = stepped = False
    try:
        with profile(activities=activities) as prof:
            entered = True
            tr.next_step()
            synchronize(tr.device)
            stepped = True
        return prof
    except Exception as e:  # noqa: BLE001 - the profiler's failure must not cost the job's numbers
        if entered and not stepped:
            raise  # the step failed: the job's error
        print(f"profiler failed ({type(e).__name__}: {e}); no trace", file=sys.stderr, flush=True)
        if not entered:
            tr.next_step()  # the step, unprofiled
        return None


def save(prof, out: Path, name: str, what: str, cuda: bool) -> None:
    """NAME.json.gz (Chrome trace) and NAME_kernels.txt (tables, also printed) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:  # gzipped here: any torch version, a smaller file
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(out / f"{name}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        print(f"trace saved to {out / (name + '.json.gz')}")
    except Exception as e:  # noqa: BLE001 - the tables below may still be had
        print(f"exporting the trace failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    try:
        text = (f"{name}: one profiled step ({what}; torch {torch.__version__})\n\nTop {ROWS} by {sort}:\n"
                f"{prof.key_averages().table(sort_by=sort, row_limit=ROWS)}\n{kernel_table(prof)}\n")
    except Exception as e:  # noqa: BLE001 - a table this torch cannot make: said, the job's numbers stand
        text = f"{name}: the profile's tables failed ({type(e).__name__}: {e})\n"
    (out / f"{name}_kernels.txt").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="llama3_debug")
    ap.add_argument("--out", required=True, help="folder for NAME.json.gz and NAME_kernels.txt")
    ap.add_argument("--name", required=True)
    ap.add_argument("--warmup", type=int, default=3, help="steps trained before the profiled one")
    args, overrides = ap.parse_known_args(argv)
    # the last override wins: exactly warm-up + 1 steps, every one logged
    overrides += ["--training.steps", str(args.warmup + 1), "--metrics.log_freq", "1"]
    cfg = load_config(args.config, overrides)
    started = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if started:  # as train.py: a GPU rank binds its GPU before NCCL starts
        local_device(cfg.job.device)
        dist.init_process_group(backend(cfg.job.device), timeout=timedelta(minutes=10))
    try:
        tr = Trainer(cfg)
        if not tr.start():
            raise SystemExit("nothing to train (a checkpoint of this job exists?)")
        for _ in range(args.warmup):
            tr.next_step()
        synchronize(tr.device)
        prof = profile_last_step(tr)
        tr.metrics.close()
        if tr.rank == 0 and prof is not None:
            save(prof, Path(args.out), args.name, f"job {cfg.job.name}, step {tr.step} after {args.warmup} steps",
                 cuda=tr.device.type == "cuda")
        if started:
            dist.barrier()
    finally:
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
