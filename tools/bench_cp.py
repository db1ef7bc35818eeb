"""Context parallelism in auto mode (the causal-attention local_map region): two figures.

    python scripts/bench_cp.py --table memory [--seq-len 4096]
        per-rank activation peak of one training step (forward, loss, backward; live tensor
        bytes created during the step, the region's inner K/V gathers included) of a small
        debug LLaMA 3, batch 1: no CP (1 rank) vs the sequence sharded on 2 gloo ranks
        (the plan forced to CP with presets.context_parallel), and the loss of both;

    python scripts/bench_cp.py --table crossover [--seq-lens 2048,4096,...] [--mesh 8x8]
        LLaMA 3 8B (its dims; --layers of its identical blocks) on a fake mesh with the h100
        profile, batch 1, the planner free: per sequence length, what it does with the
        attention regions (S(1) heads, S(2) sequence, R replicated, per axis), the
        objective, and the first length at which it shards the sequence (CP) by itself.
        On 8x8 the 32 heads fill one axis; on one axis of 8 the planner prefers the heads
        with all-to-alls around attention (fewer bytes than gathering K/V) at every length.
"""

from __future__ import annotations

import argparse
import math
import os
import time

from tools.bench_common import free_port

SMALL = {"n_layers": 2, "dim": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden_dim": 256}


def _tracker_cls():
    """MemoryTracker that also sees what a region op allocates inside (the mode is re-entered)."""
    from parallel.auto import regions
    from parallel.measure import MemoryTracker

    class RegionTracker(MemoryTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if regions.region_of(func) is None:
                return super().__torch_dispatch__(func, types, args, kwargs)
            with self:
                out = regions.run_kernel(func, *args, **(kwargs or {}))
            for t in [out] if not isinstance(out, (tuple, list)) else out:
                self._add(t, False)
            self.peak = max(self.peak, self.current)
            return out

    return RegionTracker


def _memory_worker(rank: int, world: int, seq: int, out_q) -> None:
    try:
        _measure(rank, world, seq, out_q)
    except BaseException as e:  # noqa: BLE001 - the parent prints it
        import traceback

        out_q.put({"error": f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"})


def _measure(rank: int, world: int, seq: int, out_q) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models import build_model
    from parallel.auto.config import PlannerConfig
    from parallel.auto.regions import load_balanced_batch
    from parallel.auto.request import PlanRequest, planning
    from parallel.auto.search import presets

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = build_model("llama3", "debug", device="meta", max_seq_len=seq, **SMALL)
    # the sequence load-balanced with its positions, attention the CP region: what the request builder asks
    request = PlanRequest(local_batch_size=1, seq_len=seq, planner=PlannerConfig(hardware="cpu"))
    with planning(model, mesh, request) as autop:
        if world > 1:
            presets.context_parallel(autop, 0)
        pm = autop.apply_placement(autop.optimize_placement(verbose=False))
    pm.to_empty(device="cpu")
    torch.manual_seed(0)
    pm.init_weights()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, model.args.vocab_size, (1, seq + 1), generator=g)
    # one rank: natural order, no positions (the request builder adds them for a cp axis only)
    batch = load_balanced_batch(data[:, :-1], data[:, 1:], world) if world > 1 else (data[:, :-1], data[:, 1:])
    pm.forward_backward(*batch)  # warm-up: builds the step graph
    tracker = _tracker_cls()()
    t0 = time.perf_counter()
    with tracker:
        loss = pm.forward_backward(*batch)
    if rank == 0:
        out_q.put({"world": world, "peak": tracker.peak, "loss": float(loss), "s": time.perf_counter() - t0})
    dist.destroy_process_group()


def _spawn_memory(world: int, seq: int) -> dict:
    import torch.multiprocessing as mp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for r in range(world):
        procs.append(ctx.Process(target=_memory_worker, args=(r, world, seq, q)))
        procs[-1].start()
    res = q.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
    if "error" in res:
        raise RuntimeError(res["error"])
    return res


def table_memory(seq: int) -> None:
    print(f"per-rank activation peak of one step: debug LLaMA 3 {SMALL}, batch 1, seq {seq}, fp32", flush=True)
    base = _spawn_memory(1, seq)
    cp = _spawn_memory(2, seq)
    for name, r in (("no CP, 1 rank", base), ("CP, sequence on 2 ranks", cp)):
        print(f"  {name:26s} peak {r['peak'] / 2**20:8.1f} MiB   loss {r['loss']:.6f}   step {r['s']:.2f} s")
    print(f"  reduction: {base['peak'] / cp['peak']:.2f}x   |dloss| {abs(base['loss'] - cp['loss']):.1e}")


def _crossover_one(seq: int, world: tuple[int, ...], layers: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from models import build_model
    from parallel.auto.api import fake_world
    from parallel.auto.config import PlannerConfig
    from parallel.auto.request import PlanRequest, planning
    from parallel.precision import mixed_precision_policy

    model = build_model("llama3", "8B", device="meta", n_layers=layers, max_seq_len=max(seq, 8192))
    mp = mixed_precision_policy("bfloat16", "float32")
    t0 = time.perf_counter()
    with fake_world(math.prod(world)):
        mesh = init_device_mesh("cpu", world, mesh_dim_names=("tp", "cp")[-len(world):])
        request = PlanRequest(local_batch_size=1, seq_len=seq, planner=PlannerConfig(hardware="h100"), mp_policy=mp)
        with planning(model, mesh, request) as autop:
            plan = autop.optimize_placement(verbose=False)
    attn = [n.output_placements[0] for n in plan.nodes.values() if n.target == "autotitan.causal_attention.default"]
    comm = sum(plan.comm_us.values())
    return {"seq": seq, "attention": sorted(set(attn)), "objective_ms": plan.objective_us / 1e3,
            "comm_ms": comm / 1e3, "s": time.perf_counter() - t0}


def table_crossover(seq_lens: list[int], world: tuple[int, ...], layers: int) -> None:
    names = ("tp", "cp")[-len(world):]
    print(f"LLaMA 3 8B dims, {layers} blocks, batch 1, fake mesh {world} {names}, h100 profile, bf16: "
          "what the planner does with attention", flush=True)
    first = None
    for seq in seq_lens:
        r = _crossover_one(seq, world, layers)
        seq_sharded = any("S(2)" in a for a in r["attention"])  # the sequence sharded on some axis
        if seq_sharded and first is None:
            first = seq
        print(f"  seq {seq:6d}: attention {', '.join(r['attention']):12s} objective {r['objective_ms']:9.2f} ms "
              f"(comm {r['comm_ms']:8.2f} ms)  {'CP' if seq_sharded else '  '}  [{r['s']:.0f} s]", flush=True)
    print(f"  crossover: the planner first shards the sequence at seq {first}" if first else
          "  the planner never sharded the sequence in this range")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", choices=("memory", "crossover"), default="memory")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--seq-lens", default="512,1024,2048,3072,4096,8192,32768")
    ap.add_argument("--mesh", default="8x8", help="N (one axis 'cp') or TxN (axes 'tp', 'cp')")
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args(argv)
    if a.table == "memory":
        table_memory(a.seq_len)
    else:
        table_crossover([int(s) for s in a.seq_lens.split(",")], tuple(int(x) for x in a.mesh.split("x")), a.layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
