"""Host time of the auto runtime's training step, apart from the step graph itself.

    python scripts/bench_step_host.py [--layers 16] [--steps 30] [--seq-len 16] [--batch 1]

On a GPU the eager step graph's kernels run asynchronously, and what the host spends per
step — FX's Python and the dispatcher per node, plus the wrapper around the graph — is time
the GPU waits for when steps are short (the debug model's step on an H200 is ~13 ms). This
measures it on the CPU, where the same Python runs: the debug LLaMA with `--layers` blocks
planned on a 1-rank gloo group, a batch so small that the kernels cost next to nothing,
then `forward_backward` as the trainer calls it (clock, median over `--steps`).

Prints the step graph's node count and the median step. Run it before and after a change,
alternated (the machine is shared).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from parallel.mesh import build_mesh
from trainer.build import build_parallel_model
from trainer.config import load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = load_config("llama3_debug_auto", [
            "--model.n_layers", str(args.layers), "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch), "--parallelism.hardware", "h100",
            "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable", "false",
            "--job.dump_folder", "/tmp/bench_step_host"], world_size=1)
        mesh = build_mesh(cfg.parallelism.degrees, 1, "cpu")
        tokens = torch.zeros(args.batch, args.seq_len, dtype=torch.long)
        pm = build_parallel_model(cfg, mesh, torch.device("cpu"), 256, (tokens, tokens))
        n_params = len(list(pm.parameters()))
        pm.forward_backward(tokens, tokens)  # builds the step graph
        sg = next(iter(pm.step_graphs.values()))
        params = [pm.param_refs[f]() for f in pm.plan_runner.param_names]
        times = []
        for _ in range(args.steps):
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            pm.forward_backward(tokens, tokens)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times) * 1e3
        print(f"auto runtime (eager step graph), debug LLaMA with {args.layers} layers ({n_params} parameters), "
              f"batch {args.batch} x {args.seq_len}: {len(sg.gm.graph.nodes)} step-graph nodes, forward_backward "
              f"{med:.2f} ms per step (median of {args.steps}; {med * 1e3 / len(sg.gm.graph.nodes):.1f} µs per node)")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
