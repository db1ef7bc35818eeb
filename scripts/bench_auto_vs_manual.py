"""Auto-parallel plan vs the hand recipes, side by side: tokens/s of the same job.

    python scripts/bench_auto_vs_manual.py                  # 4 CPU ranks, debug LLaMA
    python scripts/bench_auto_vs_manual.py --nproc 4 --steps 10 --warmup 3 --variants fsdp auto_1d

Spawns `--nproc` gloo ranks; each variant builds the trainer (same model, data, global
batch, optimizer, mesh shape); `train_step` is timed round-robin over the variants
(so the shared cores' background load hits all alike) for `--steps` steps after
`--warmup` steps; tokens/s uses the median step time. Variants (those whose recipe exists):
  fsdp     manual FSDP on a 1-D mesh (dp_shard = nproc)
  auto_1d  auto-parallel plan on the same 1-D mesh
  fsdp_tp  manual FSDP + TP on a 2-D mesh (dp_shard = nproc/2, tp = 2)
  auto_2d  auto-parallel plan on the same 2-D mesh
  auto_1d_fsdp (opt-in) the auto runtime executing a plan CONSTRAINED to FSDP (every forward
           matmul data-parallel on a gathered weight): separates the materialised
           runtime's speed from the planner's choice
Prints tokens/s per variant and the ratios auto / recipe.
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("fsdp", "auto_1d", "fsdp_tp", "auto_2d", "auto_1d_fsdp")
DEFAULT_VARIANTS = ("fsdp", "auto_1d", "fsdp_tp", "auto_2d")


def _overrides(variant: str, args: argparse.Namespace, tmp: str) -> list[str]:
    n = args.nproc
    glob = args.global_batch
    if variant in ("fsdp", "auto_1d", "auto_1d_fsdp"):
        par = ["--parallelism.data_parallel_shard_degree", str(n), "--parallelism.tensor_parallel_degree", "1"]
        dp = n
    else:
        par = ["--parallelism.data_parallel_shard_degree", str(n // 2), "--parallelism.tensor_parallel_degree", "2"]
        dp = n // 2
    mode = "auto" if variant.startswith("auto") else "manual"
    if variant == "auto_1d_fsdp":
        par += ["--parallelism.plan_file", str(Path(tmp) / "fsdp_plan.json")]
    if mode == "auto" and args.memory_high is not None:
        par += ["--parallelism.memory_budget_high", str(args.memory_high)]
    return [*par, "--parallelism.mode", mode, "--parallelism.hardware", args.hardware,
            "--training.local_batch_size", str(glob // dp), "--training.seq_len", str(args.seq_len),
            "--training.steps", str(args.warmup + args.steps), "--checkpoint.enable", "false",
            "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1000",
            "--job.dump_folder", tmp, "--job.name", f"bench_{variant}"]


def _fsdp_plan(cfg, path: Path) -> None:
    """Rank 0: plan the trainer's model with every forward matmul constrained to
    (batch-sharded activation, replicated weight) -> batch-sharded output, i.e. FSDP."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from models import build_model
    from parallel.auto.api import AutoParallel, lm_loss
    from parallel.auto.trace import FWD
    from parallel.mesh import build_mesh
    from trainer.auto import data_degree, data_placements

    mesh = build_mesh(cfg.parallelism, dist.get_world_size(), "cpu")
    if dist.get_rank() == 0:
        t = cfg.training
        model = build_model(cfg.model.name, cfg.model.flavor, device="meta", vocab_size=256)
        g = torch.zeros(t.local_batch_size * data_degree(mesh), t.seq_len, dtype=torch.long, device="meta")
        with AutoParallel(model, (g, g), mesh, loss_fn=lm_loss, hardware=cfg.parallelism.hardware) as autop:
            pl = data_placements(mesh)
            autop.add_input_constraints([pl, pl])
            jg = autop.graph
            params = set(n.name for n in jg.params.values())
            for n in jg.gm.graph.nodes:
                if n.op != "call_function" or jg.phase.get(n.name) != FWD:
                    continue
                if n.target is torch.ops.aten.mm.default:
                    a, b = n.args[:2]
                    if b.op == "call_function" and b.target is torch.ops.aten.t.default and b.args[0].name in params:
                        autop.add_node_constraint(n.name, (Shard(0),), input_placements=[(Shard(0),), (Replicate(),)])
                elif n.target is torch.ops.aten.embedding.default:
                    autop.add_node_constraint(n.name, (Shard(0),), input_placements=[(Replicate(),), (Shard(0),)])
            autop.optimize_placement(verbose=False).save(str(path))
    dist.barrier()


def _build(variant: str, args: argparse.Namespace, tmp: str):
    from trainer.config import load_config
    from trainer.trainer import Trainer

    cfg = load_config(args.config, _overrides(variant, args, tmp), world_size=args.nproc)
    if variant == "auto_1d_fsdp":
        _fsdp_plan(cfg, Path(tmp) / "fsdp_plan.json")
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    return trainer, time.perf_counter() - t0


def _run_variants(args: argparse.Namespace, tmp: str) -> list[dict]:
    """Build every variant's trainer, then time their steps round-robin (step i of every
    variant before step i+1), so background load on the shared cores hits all alike."""
    import torch.distributed as dist

    built, out = {}, {}
    for v in args.variants:
        try:
            built[v] = _build(v, args, tmp)
        except NotImplementedError as e:  # a recipe that does not exist (yet)
            out[v] = {"variant": v, "error": str(e)}
    iters = {v: iter(tr.dataloader) for v, (tr, _) in built.items()}
    times: dict[str, list[float]] = {v: [] for v in built}
    last: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for step in range(args.warmup + args.steps):
        for v, (trainer, _) in built.items():
            inputs, labels = next(iters[v])
            dist.barrier()
            t = time.perf_counter()
            loss, _ = trainer.train_step(inputs, labels)
            last[v] = float(loss)
            dist.barrier()
            if step >= args.warmup:
                times[v].append(time.perf_counter() - t)
            tokens[v] = inputs.numel() * trainer.dp_degree
    for v, (trainer, setup_s) in built.items():
        out[v] = {"variant": v, "setup_s": setup_s, "step_s": statistics.median(times[v]),
                  "mean_s": statistics.mean(times[v]), "tokens": tokens[v], "loss": last[v]}
    return [out[v] for v in args.variants]


def _worker(rank: int, args: argparse.Namespace, port: int, q, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
        out = _run_variants(args, tmp)
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3_debug")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--hardware", default="cpu")
    p.add_argument("--memory-high", type=float, default=None,
                   help="parallelism.memory_budget_high for the auto variants (default: fully sharded)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)

    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args, port, q, tmp), daemon=True) for r in range(args.nproc)]
        for pr in procs:
            pr.start()
        results = {}
        try:
            for _ in range(args.nproc):
                rank, status, payload = q.get(timeout=args.timeout)
                if status != "ok":
                    print(f"rank {rank} failed:\n{payload}", file=sys.stderr)
                    return 1
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        except queue.Empty:
            print("timed out", file=sys.stderr)
            return 1
        finally:
            for pr in procs:
                pr.join(timeout=5)
                if pr.is_alive():
                    pr.kill()
    rows = {r["variant"]: r for r in results[0]}
    print(f"\n{args.config}: {args.nproc} CPU ranks, global batch {args.global_batch} x {args.seq_len} tokens, "
          f"{args.steps} timed steps after {args.warmup} warm-up, hardware profile {args.hardware}"
          + (f", auto memory_budget_high {args.memory_high}" if args.memory_high is not None else ""))
    print(f"{'variant':<12} {'mesh':<22} {'step (median)':>14} {'tokens/s':>10} {'setup':>8}  loss")
    tps = {}
    for v in args.variants:
        r = rows[v]
        mesh = (f"dp_shard={args.nproc}" if v in ("fsdp", "auto_1d", "auto_1d_fsdp")
                else f"dp_shard={args.nproc // 2} x tp=2")
        if "error" in r:
            print(f"{v:<12} {mesh:<22} not available: {r['error'][:80]}")
            continue
        tps[v] = r["tokens"] / r["step_s"]
        print(f"{v:<12} {mesh:<22} {r['step_s'] * 1e3:>11.1f} ms {tps[v]:>10.0f} {r['setup_s']:>7.1f}s  "
              f"{r['loss']:.4f}")
    recipes = [v for v in ("fsdp", "fsdp_tp") if v in tps]
    for a, m in (("auto_1d", "fsdp"), ("auto_2d", "fsdp_tp"), ("auto_2d", "fsdp"), ("auto_1d_fsdp", "fsdp")):
        if a in tps and m in tps:
            print(f"ratio {a} / {m}: {tps[a] / tps[m]:.2f}")
    autos = [v for v in ("auto_1d", "auto_2d") if v in tps]  # the planner's own plans
    if autos and recipes:
        best_auto = max(tps[v] for v in autos)
        best_recipe = max(tps[v] for v in recipes)
        print(f"best auto / best recipe: {best_auto / best_recipe:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
