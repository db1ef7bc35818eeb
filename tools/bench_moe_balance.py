"""Aux-loss-free balancing measured: max/mean tokens per expert with and without the expert bias.

    python scripts/bench_moe_balance.py [--steps 200] [--coeff 0.001] [--seq-len 32] [--batch 4]

Trains the debug DeepSeek-V3 (2 MoE layers of 8 experts, V3's routing: sigmoid, 4 groups of 2
keeping 2, top-2) on one process twice, with the same seed and data: once with
`--model.load_balance_coeff COEFF` (the bias moves by COEFF x sign(mean - count) after each
optimizer step; DeepSeek-V3 used 0.001) and once without it (unset: no bias). The routing is
observed from outside the trainer's own counter: a forward hook on each MoE router bincounts
the experts its forward selected. Per step and layer the imbalance is max/mean of the token
slots per expert (1.0: perfectly balanced; 4.0 = E / K: every token on the same K experts);
the curve is the mean of that over the MoE layers (the max over the layers is printed at the
end too). Printed: both curves at a few steps, their mean over the last `--last` steps, and
the language-model loss of both runs over the same steps (balancing should cost little loss).
Exit 0 when the balanced run's last value is below the unbalanced run's, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile

import torch

from models.moe import MoE
from trainer.config import load_config
from trainer.trainer import Trainer


def make_cfg(args, dump: str, coeff: float | None):
    extra = ["--model.load_balance_coeff", str(coeff)] if coeff is not None else []
    return load_config("deepseek_v3_debug", [
        "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--checkpoint.enable", "false",
        "--metrics.enable_tensorboard", "false", "--metrics.log_freq", str(max(1, args.steps // 4)),
        "--job.dump_folder", dump, "--job.name", "balanced" if coeff is not None else "unbalanced", *extra,
    ], world_size=1)


def run(args, dump: str, coeff: float | None) -> dict:
    """Train; per step the imbalance of each MoE layer (max/mean of the hooked counts) and the loss."""
    tr = Trainer(make_cfg(args, dump, coeff))
    layers = [m for m in tr.model.modules() if isinstance(m, MoE)]
    seen = [torch.zeros(m.router.num_experts, dtype=torch.int64) for m in layers]

    def observer(i: int):
        def hook(module, inputs, out):  # out: (top_scores, selected, counts); the selection only
            if module.training:
                seen[i].add_(torch.bincount(out[1].detach().flatten(), minlength=module.num_experts))
        return hook

    handles = [m.router.register_forward_hook(observer(i)) for i, m in enumerate(layers)]
    ratios: list[list[float]] = []  # [step][layer]
    losses: list[float] = []
    inner = tr.train_step

    def observed_step(inputs, labels):
        for s in seen:
            s.zero_()
        loss, grad_norm = inner(inputs, labels)
        ratios.append([(s.max() / s.float().mean()).item() for s in seen])
        losses.append(loss.item())
        return loss, grad_norm

    tr.train_step = observed_step
    try:
        tr.train()
    finally:
        for h in handles:
            h.remove()
    biases = [m.expert_bias.clone() for m in layers if m.expert_bias is not None]
    return {"ratios": ratios, "losses": losses, "biases": biases}


def _tail(xs: list, n: int) -> float:
    return statistics.fmean(xs[-n:])


def report(args, runs: dict[str, dict]) -> int:
    """Print the curves and the last values; the exit code (0: balancing lowered the imbalance)."""
    bal, unb = runs["balanced"], runs["unbalanced"]
    curve = {k: [statistics.fmean(r) for r in v["ratios"]] for k, v in runs.items()}
    worst = {k: [max(r) for r in v["ratios"]] for k, v in runs.items()}
    tokens = args.batch * args.seq_len
    print(f"debug DeepSeek-V3, 1 rank, {args.steps} steps of {args.batch} x {args.seq_len} tokens "
          f"({tokens * 2} token slots per MoE layer and step, 8 experts, top-2); "
          f"imbalance = max/mean tokens per expert (1.0 balanced, 4.0 worst), mean over the 2 MoE layers")
    print(f"{'step':>6} {'coeff ' + str(args.coeff):>14} {'no bias':>10}")
    points = sorted({1, *range(max(1, args.steps // 10), args.steps + 1, max(1, args.steps // 10)), args.steps})
    for s in points:
        print(f"{s:>6} {curve['balanced'][s - 1]:>14.3f} {curve['unbalanced'][s - 1]:>10.3f}")
    n = min(args.last, args.steps)
    last = {k: _tail(v, n) for k, v in curve.items()}
    print(f"last {n} steps, mean over the layers: with the bias {last['balanced']:.3f}, "
          f"without {last['unbalanced']:.3f}")
    print(f"last {n} steps, max over the layers:  with the bias {_tail(worst['balanced'], n):.3f}, "
          f"without {_tail(worst['unbalanced'], n):.3f}")
    print(f"LM loss, mean of the last {n} steps: with the bias {_tail(bal['losses'], n):.4f}, "
          f"without {_tail(unb['losses'], n):.4f} (step {args.steps}: {bal['losses'][-1]:.4f} vs "
          f"{unb['losses'][-1]:.4f})")
    for i, b in enumerate(bal["biases"]):
        print(f"expert bias of MoE layer {i}: " + " ".join(f"{x:+.3f}" for x in b.tolist()))
    ok = last["balanced"] < last["unbalanced"]
    print("balanced below unbalanced: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--coeff", type=float, default=1e-3, help="load_balance_coeff of the balanced run")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--last", type=int, default=20, help="steps the last values are averaged over")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("autotitan").disabled = True
    with tempfile.TemporaryDirectory() as dump:
        runs = {"balanced": run(args, dump, args.coeff), "unbalanced": run(args, dump, None)}
    return report(args, runs)


if __name__ == "__main__":
    raise SystemExit(main())
