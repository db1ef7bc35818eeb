"""Trainer overhead: step time of ``Trainer`` vs a bare PyTorch loop, same model & data.

    python scripts/bench_trainer.py [--steps 20] [--seq-len 128] [--batch 8] [--repeats 2]

Both run the debug LLaMA 3 on one process (no process group) with the same init, the
same batches (the trainer's data loader is used to pre-fetch the bare loop's batches),
AdamW + warmup/decay + grad clipping at 1.0. The step time is the median interval
between consecutive step starts after warm-up, so the trainer's data loading, metrics
and bookkeeping count against it. Runs alternate (trainer, bare, trainer, bare, ...) and
the best median of each is kept, which damps noise from other load on the machine.
Both wall-clock and process CPU time are reported: with one thread (the default) the
CPU time is what the step costs even when other programs share the cores.
Goal: ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from models import build_model, cross_entropy_loss
from trainer.config import load_config
from trainer.optim import build_lr_scheduler
from trainer.trainer import Trainer


def make_cfg(args, dump):
    return load_config("llama3_debug", [
        "--training.steps", str(args.steps + args.warmup),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
        "--metrics.log_freq", "10", "--job.dump_folder", dump, "--job.name", "bench",
    ], world_size=1)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def median_interval(starts: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds between consecutive step starts after warm-up."""
    pairs = list(zip(starts[warmup:], starts[warmup + 1:]))
    return (statistics.median(b[0] - a[0] for a, b in pairs),
            statistics.median(b[1] - a[1] for a, b in pairs))


def run_trainer(args, dump) -> float:
    trainer = Trainer(make_cfg(args, dump))
    starts = []
    inner = trainer.train_step

    def timed(inputs, labels):
        starts.append(_now())
        return inner(inputs, labels)

    trainer.train_step = timed
    trainer.train()
    starts.append(_now())
    return median_interval(starts, args.warmup)


def run_bare(args, dump) -> float:
    cfg = make_cfg(args, dump)
    # the same batches, fetched up front
    from trainer.data import build_dataloader
    it = iter(build_dataloader(cfg.data, seq_len=args.seq_len, local_batch_size=args.batch,
                               seed=cfg.job.seed))
    batches = [next(it) for _ in range(args.steps + args.warmup)]
    model = build_model("llama3", "debug", device="meta", vocab_size=256)
    model.to_empty(device="cpu")
    torch.manual_seed(cfg.job.seed)
    with torch.no_grad():
        model.init_weights()
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=True)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, cfg.training.steps)
    starts = []
    for i, (x, y) in enumerate(batches):
        starts.append(_now())
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm,
                                            foreach=True)
        opt.step()
        sched.step()
        if (i + 1) % 10 == 0:
            loss.item(), gn.item()
    starts.append(_now())
    return median_interval(starts, args.warmup)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: stable on a shared machine; 0: torch default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import logging
    logging.getLogger("autotitan").disabled = True
    tr, bare = [], []
    with tempfile.TemporaryDirectory() as dump:
        for _ in range(args.repeats):
            tr.append(run_trainer(args, dump))
            bare.append(run_bare(args, dump))
    tokens = args.batch * args.seq_len
    print(f"debug LLaMA 3, 1 rank, batch {args.batch} x seq {args.seq_len} "
          f"({tokens} tokens/step), {args.steps} timed steps x {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads; best of the per-run medians")
    for i, what in enumerate(("wall", "CPU ")):
        t, b = min(x[i] for x in tr), min(x[i] for x in bare)
        print(f"{what} time per step: trainer {t * 1e3:7.1f} ms ({tokens / t:6.0f} tok/s), "
              f"bare loop {b * 1e3:7.1f} ms ({tokens / b:6.0f} tok/s), "
              f"ratio trainer/bare {t / b:.3f}   runs trainer "
              + ", ".join(f"{x[i] * 1e3:.0f}" for x in tr) + " | bare "
              + ", ".join(f"{x[i] * 1e3:.0f}" for x in bare))
    print("goal: ratio <= 1.05 (on a busy machine trust the CPU-time ratio, with 1 thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
