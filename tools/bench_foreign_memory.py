"""Peak memory of models nobody here wrote: the planner's estimate against the allocator.

Hugging Face `transformers` models built from their configs (GPT-2: a GPT-style decoder;
T5: an encoder-decoder), planned through the API (`AutoParallel`) with the default
settings. Two tables:

  * `--table measured`: scaled-down models of the same structure on 2 gloo ranks; each
    plan's estimate (parallel/auto/runtime/memory.py), made on the gloo ranks as the
    trainer's (the planner's own, in its fake world, beside it: that one plans for NCCL,
    without gloo's all-gather staging), next to the peak the CPU allocator reports
    (parallel.measure.AllocatorPeak: the allocator's total over the step, every thread's
    allocations and frees, on top of the bytes alive before it), and the resident set;
  * `--table big`: GPT-2/GPT-NeoX/T5 shapes of 1.4-7B parameters at batch 16 x 1,024 on 8
    fake ranks (h100 profile, default limit): the estimate's parts, or the planner's
    MemoryLimitError.

    python scripts/bench_foreign_memory.py --table measured
    python scripts/bench_foreign_memory.py --table big --models gpt2_1.5b,t5_3b
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time
from typing import Any

import torch
from torch.nn import functional as F

GIB, MIB = 2**30, 2**20
SMALL_BATCH, SMALL_SEQ = 4, 64  # global batch on the 2 gloo ranks: few activations, the gradients matter
BIG_BATCH, BIG_SEQ, BIG_WORLD = 16, 1024, 8

# name -> (family, config keywords)
SMALL = {
    "gpt2_small": ("gpt2", dict(n_layer=4, n_embd=512, n_head=8, vocab_size=4096, n_positions=256)),
    "t5_small": ("t5", dict(num_layers=2, num_decoder_layers=2, d_model=512, d_ff=2048, num_heads=8, d_kv=64,
                            vocab_size=4096)),
}
BIG = {
    "gpt2_1.5b": ("gpt2", dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)),
    "gpt_neox_2.8b": ("gpt_neox", dict(num_hidden_layers=32, hidden_size=2560, num_attention_heads=32,
                                       intermediate_size=10240, vocab_size=50304, max_position_embeddings=2048)),
    "gpt_neox_6.9b": ("gpt_neox", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                       intermediate_size=16384, vocab_size=50432, max_position_embeddings=2048)),
    "t5_3b": ("t5", dict(num_layers=24, num_decoder_layers=24, d_model=1024, d_ff=16384, num_heads=32, d_kv=128,
                         vocab_size=32128)),
}


def build(name: str, device: str = "meta") -> torch.nn.Module:
    """The `transformers` model `name` (SMALL or BIG) with dropout off, on `device`."""
    import transformers as tf

    family, kw = {**SMALL, **BIG}[name]
    kw = dict(kw, tie_word_embeddings=False)  # the runtime shards parameters one by one: no tied weights
    if family == "gpt2":
        cfg = tf.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw)
        cls = tf.GPT2LMHeadModel
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, **kw)
        cls = tf.GPTNeoXForCausalLM
    else:
        cfg = tf.T5Config(dropout_rate=0.0, decoder_start_token_id=0, **kw)
        cls = tf.T5ForConditionalGeneration
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
        if family == "t5":  # T5 ties its embeddings and head to `shared` whatever the config says: untie them
            d, v = kw["d_model"], kw["vocab_size"]
            del model.shared
            model.encoder.embed_tokens, model.decoder.embed_tokens = torch.nn.Embedding(v, d), torch.nn.Embedding(v, d)
            model.lm_head = torch.nn.Linear(d, v, bias=False)
    return model


def is_seq2seq(name: str) -> bool:
    return {**SMALL, **BIG}[name][0] == "t5"


def decoder_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), labels.flatten())


def seq2seq_loss(model: torch.nn.Module, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=src, decoder_input_ids=tgt).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def loss_of(name: str) -> Any:
    return seq2seq_loss if is_seq2seq(name) else decoder_loss


def batch(name: str, global_batch: int, seq: int, step: int = 0) -> tuple[torch.Tensor, ...]:
    """Token ids (the same draws on every rank): (tokens, labels) or (source, target, labels)."""
    vocab = {**SMALL, **BIG}[name][1]["vocab_size"]
    g = torch.Generator().manual_seed(3000 + step)
    data = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    if is_seq2seq(name):
        return torch.randint(0, vocab, (global_batch, seq), generator=g), data[:, :-1], data[:, 1:]
    return data[:, :-1], data[:, 1:]


def plan_and_estimate(name: str, world: int, global_batch: int, seq: int, hardware: str | None,
                      kind: str = "auto", ac_mode: str = "none") -> dict:
    """Plan `name` on a fake world of `world` ranks (default settings, `hardware` if given,
    batch-sharded inputs; `kind` "fsdp" also shards every parameter; `ac_mode` the runtime's
    activation checkpointing) and estimate its peak:
    {"plan": JSON, "estimate": JSON} or {"error": the MemoryLimitError's text}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from parallel.auto.api import AutoParallel, MemoryLimitError, fake_world
    from parallel.auto.config import PlannerConfig
    from parallel.auto.runtime import RuntimeOptions

    planner = PlannerConfig(hardware=hardware) if hardware else PlannerConfig()
    t0 = time.perf_counter()
    with fake_world(world):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        ins = batch(name, global_batch, seq)
        with AutoParallel(build(name), ins, mesh, loss_fn=loss_of(name), planner=planner,
                          runtime=RuntimeOptions(ac_mode=ac_mode)) as autop:
            autop.add_input_constraints([(Shard(0),)] * len(ins))
            if kind == "fsdp":
                autop.add_parameter_memory_constraint()
            n_params = sum(v.meta["val"].numel() for v in autop.graph.params.values())
            try:
                plan = autop.optimize_placement(verbose=False)
            except MemoryLimitError as e:
                return {"error": str(e), "estimate": e.estimate.to_json() if e.estimate is not None else None,
                        "params": n_params, "seconds": time.perf_counter() - t0}
    return {"plan": plan.to_json(), "estimate": plan.memory.to_json(), "params": n_params,
            "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- allocator measurement
def _measure(mesh: Any, name: str, plan_json: dict) -> dict:
    """Two training steps (AdamW foreach) of `plan_json`; the second's peak is measured
    (AllocatorPeak: gloo's worker threads' frees counted too), next to the plan's estimate
    made here, on the gloo ranks, as the trainer's rank 0 makes it: the parent's fake world
    plans for NCCL, whose all-gathers stage nothing (GPT-2 12.0 and T5 15.7 MiB short)."""
    from parallel.auto.api import AutoParallel
    from parallel.auto.plan import Plan
    from parallel.auto.runtime import local_shard
    from parallel.measure import AllocatorPeak, phase, state_bytes

    ins = batch(name, SMALL_BATCH, SMALL_SEQ)
    with AutoParallel(build(name), ins, mesh, loss_fn=loss_of(name)) as autop:
        plan = Plan.from_json(plan_json)
        pm = autop.apply_placement(plan)
        est = autop.estimate_memory(plan).to_json()
    pm.to_empty(device="cpu")
    with torch.no_grad():
        for p in pm.parameters():
            p.to_local().normal_(0, 0.02)
    runner = pm.plan_runner
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
    out: dict = {}
    for step in range(2):
        xs = [local_shard(x, mesh, runner.input_placements(i)) for i, x in enumerate(batch(name, SMALL_BATCH,
                                                                                            SMALL_SEQ, step))]
        opt.zero_grad(set_to_none=True)
        base = state_bytes(pm, opt)
        with AllocatorPeak() as mem:
            with phase("forward_backward"):
                loss = pm.forward_backward(*xs)
            with phase("optimizer"):
                opt.step()
        m = mem.result
        out = {"base": base, "step_peak": m.peak_bytes, "peak": base + m.peak_bytes, "phase": m.phase, "op": m.op,
               "loss": loss.item(), "estimate": est, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    return out


def _rank(rank: int, world: int, port: int, jobs: list, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        res: Any = [_measure(mesh, name, plan) for name, plan in jobs]
    except Exception as e:  # noqa: BLE001 - the parent reports it
        res = RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")
    try:
        if rank == 0 or isinstance(res, Exception):
            queue.put(res)
    finally:
        dist.destroy_process_group()


def measure_on_ranks(jobs: list[tuple[str, dict]], world: int = 2) -> list[dict]:
    """Rank 0's measurement of every (model name, plan JSON) on `world` gloo ranks."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, jobs, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=900)
    for p in procs:
        p.join(60)
    if isinstance(res, Exception):
        raise res
    return res


# ---------------------------------------------------------------- tables
def _gib(b: float) -> str:
    return f"{b / GIB:,.2f}"


def _mib(b: float) -> str:
    return f"{b / MIB:,.1f}"


def table_measured(names: list[str], kinds: list[str], world: int) -> None:
    rows, jobs = [], []
    for name in names:
        for kind in kinds:
            r = plan_and_estimate(name, world, SMALL_BATCH, SMALL_SEQ, "cpu", kind)
            rows.append((name, kind, r))
            jobs.append((name, r["plan"]))
    meas = measure_on_ranks(jobs, world)
    print(f"\n{world} gloo ranks, global batch {SMALL_BATCH} x {SMALL_SEQ}, AdamW foreach; MiB per rank (rank 0)\n")
    print("| model | plan | estimate | est. phase | est. parts (params/grads/opt/act/transient) | allocator peak "
          "| peak phase (op) | error | planned (fake world) | RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, kind, r), m in zip(rows, meas):
        e = m["estimate"]  # made on the gloo ranks; the planner's, in the fake world, beside it
        parts = "/".join(_mib(e[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                               "transient_bytes"))
        err = e["peak_bytes"] / m["peak"] - 1
        print(f"| {name} | {kind} | {_mib(e['peak_bytes'])} | {e['phase']} | {parts} | {_mib(m['peak'])} | "
              f"{m['phase']} ({m['op']}) | {err:+.1%} | {_mib(r['estimate']['peak_bytes'])} | {_mib(m['rss'])} |")


def table_big(names: list[str], hardware: str | None, ac_mode: str) -> None:
    print(f"\n{BIG_WORLD} fake ranks, batch {BIG_BATCH} x {BIG_SEQ}, default planner settings "
          f"(hardware {hardware or 'default'}, AC {ac_mode}); GiB per device\n")
    print("| model | params | result | peak | phase | params | grads | optimizer | activations | transient | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = plan_and_estimate(name, BIG_WORLD, BIG_BATCH, BIG_SEQ, hardware, ac_mode=ac_mode)
        e = r.get("estimate")
        res = "planned" if "plan" in r else "MemoryLimitError"
        cells = ([_gib(e[k]) for k in ("peak_bytes",)] + [e["phase"]] + [_gib(e[k]) for k in (
            "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "transient_bytes")]
                 if e else ["-"] * 7)
        print(f"| {name} | {r.get('params', 0) / 1e9:.2f} B | {res} | " + " | ".join(cells)
              + f" | {r['seconds']:.0f} |", flush=True)
        if "error" in r:
            print(f"  error: {r['error']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", choices=("measured", "big"), default="measured")
    ap.add_argument("--models", default="", help="comma-separated names (default: all of the table's)")
    ap.add_argument("--kinds", default="auto,fsdp", help="measured table: plans per model (auto, fsdp)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hardware", default=None, help="big table: a hardware profile (default: the planner's)")
    ap.add_argument("--ac", default="none", choices=("none", "selective", "full"), help="big table: AC mode")
    a = ap.parse_args(argv)
    pool = SMALL if a.table == "measured" else BIG
    names = [n for n in a.models.split(",") if n] or list(pool)
    bad = [n for n in names if n not in pool]
    if bad:
        print(f"--models: unknown {', '.join(bad)}; use one of {', '.join(pool)}", file=sys.stderr)
        return 2
    if a.table == "measured":
        table_measured(names, [k for k in a.kinds.split(",") if k], a.world)
    else:
        table_big(names, a.hardware, a.ac)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
