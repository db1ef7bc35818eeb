"""Ranking fidelity of the cost model: does it order plans the way this machine does?

    python scripts/fidelity.py                         # debug LLaMA, 4 gloo ranks, 1-D mesh of 4
    python scripts/fidelity.py --mesh 2x2              # the same on a 2 x 2 mesh (dp_shard x tp)
    python scripts/fidelity.py --model wide            # 6 layers, dim 512, seq 512

For one job and mesh it makes >= 10 distinct plans (the planner's free choice, and plans
shaped like FSDP, DDP, Megatron TP, mixtures, a memory budget, pinned embeddings, a plan
made for H100s), predicts each plan's step time (the runtime's step graph simulated on
the calibrated profile, `hardware = "auto"`), runs each for real through the trainer (warm-up,
then the median of the timed steps, round-robin across plans so machine noise hits all
alike), and prints the table with Spearman's rho, Kendall's tau, the median absolute
percentage error and the selection regret (measured time of the predicted-best plan /
the measured-best one - 1).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

from bench_common import run_on_ranks, temp_folder, time_round_robin

MODELS = {
    "debug": ["--model.n_layers", "4", "--training.seq_len", "128", "--training.local_batch_size", "4"],
    "wide": ["--model.n_layers", "6", "--model.dim", "512", "--model.n_heads", "8", "--model.n_kv_heads", "8",
             "--model.ffn_hidden_dim", "1536", "--training.seq_len", "512", "--training.local_batch_size", "2"],
}
COMMON = ["--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "100000",
          "--parallelism.mode", "auto"]


def _mesh_flags(mesh: str) -> list[str]:
    if mesh == "2x2":
        return ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]
    return ["--parallelism.data_parallel_shard_degree", mesh]


def _variants(ndim: int) -> dict[str, object]:
    """name -> a function adding constraints to an open AutoParallel (None: the free plan)."""
    from parallel.auto import presets

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
        "planned_for_h100": "h100",
    }
    if ndim > 1:
        out["tp_on_dp_axis"] = lambda a: presets.megatron(a, 0, fsdp_other_axes=True)
        out["fsdp_on_both_axes"] = lambda a: presets.fsdp(a, data_axes=(0, 1))
    else:
        out["tp_attention_ddp_mlp"] = lambda a: (presets.megatron(a, 0, fragments=["attention"]),
                                                presets.replicated(a, ["feed_forward"]))
    return out


class _Job:
    """Every rank: plan each variant (rank 0 solves, via the trainer), build its trainer,
    time them round-robin, predict each step on rank 0."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.tmp = args, temp_folder()

    def _trainer(self, name: str, how: object) -> object:
        from trainer.config import load_config
        from trainer.trainer import Trainer

        a = self.args
        flags = [*MODELS[a.model], *COMMON, *_mesh_flags(a.mesh), "--training.steps", str(a.warmup + a.steps + 1),
                 "--job.dump_folder", self.tmp, "--job.name", name]
        if how == "h100":
            flags += ["--parallelism.hardware", "h100"]
        tr_cfg = load_config(a.config, flags, world_size=a.nproc)
        return Trainer(tr_cfg, plan_constraints=how if callable(how) else None)

    def __call__(self) -> dict:
        import torch.distributed as dist

        variants = _variants(2 if self.args.mesh == "2x2" else 1)
        if self.args.plans:
            variants = {k: v for k, v in variants.items() if k in self.args.plans.split(",")}
        built = {name: self._trainer(name, how) for name, how in variants.items()}
        out = time_round_robin(built, self.args.warmup, self.args.steps)
        if dist.get_rank() == 0:
            for name, tr in built.items():
                auto_hw = built["auto"].model.plan_cost_model  # every plan predicted on the calibrated profile
                pred = tr.model.predict_step(auto_hw)
                out[name].update(predicted_s=pred.step_us / 1e6, objective_us=tr.model.plan.objective_us,
                                 explain=f"{tr.model.plan.breakdown()}\n{pred.summary()}\n"
                                         + "\n".join(f"  step graph {k}: {v['count']} x, {v['bytes'] / 2**20:.1f} MiB, "
                                                     f"{v['us']:,.0f} µs" for k, v in pred.collectives.items()),
                                 summary=tr.model.plan.summary().splitlines()[0] if tr.model.plan else "")
        return out


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    r = [0.0] * len(xs)
    for i, j in enumerate(order):
        r[j] = float(i)
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def kendall(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1) for i, j in pairs if a[i] != a[j] and b[i] != b[j])
    return s / len(pairs)


def report(rows: dict, args: argparse.Namespace) -> None:
    names = sorted(rows, key=lambda n: rows[n]["step_s"])
    pred = [rows[n]["predicted_s"] for n in names]
    meas = [rows[n]["step_s"] for n in names]
    print(f"{'plan':<32} {'objective ms':>13} {'predicted ms':>13} {'measured ms':>12} {'meas/pred':>10}")
    for n in names:
        r = rows[n]
        ratio = r["step_s"] / r["predicted_s"]
        print(f"{n:<32} {r['objective_us'] / 1e3:>13.1f} {r['predicted_s'] * 1e3:>13.1f} {r['step_s'] * 1e3:>12.1f} "
              f"{ratio:>10.2f}")
    mape = statistics.median(abs(p - m) / m for p, m in zip(pred, meas)) * 100
    best_pred = names[min(range(len(names)), key=pred.__getitem__)]
    regret = rows[best_pred]["step_s"] / min(meas) - 1
    print(f"\n{len(names)} plans: Spearman rho {spearman(pred, meas):.3f}, Kendall tau {kendall(pred, meas):.3f}, "
          f"median |error| {mape:.1f}%, selection regret {regret * 100:.1f}% (predicted best: {best_pred}, "
          f"measured best: {names[0]})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3_debug")
    p.add_argument("--model", choices=list(MODELS), default="debug")
    p.add_argument("--mesh", choices=["4", "2x2", "2"], default="4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--plans", default="", help="comma-separated subset of the plans (default: all)")
    p.add_argument("--explain", action="store_true", help="print each plan's objective breakdown and prediction")
    args = p.parse_args(argv)
    args.nproc = 4 if args.mesh in ("4", "2x2") else 2
    t0 = time.perf_counter()
    rows = run_on_ranks(_Job(args), args.nproc)
    took = time.perf_counter() - t0
    print(f"\n{args.config} ({args.model}: {' '.join(MODELS[args.model])}) on {args.nproc} gloo ranks, "
          f"mesh {args.mesh}; {args.steps} timed steps after {args.warmup} warm-up, round-robin ({took:.0f}s)")
    report(rows, args)
    if args.explain:
        for name, r in rows.items():
            print(f"\n== {name}\n{r['explain']}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
