"""What the trainer benchmarks share: spawn gloo ranks, build one Trainer per variant, time
their steps round-robin, bring rank 0's figures back.

Round-robin (step i of every variant before step i+1 of any) makes the shared cores'
background load hit every variant alike, so ratios between variants hold even when the
machine's speed drifts; figures are medians over the timed steps.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import resource
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

BuildFn = Callable[[str, str], Any]  # (variant, tmp folder) -> Trainer


def time_round_robin(built: dict[str, Any], warmup: int, steps: int,
                     measure: Callable[[str, Any], dict] | None = None) -> dict[str, dict]:
    """Median step time, tokens per step and losses of every built trainer, and `cpu_s`: the
    median over steps of the CPU seconds all ranks spent in the step (user + system, every
    thread), an observer the scheduler's noise hardly moves: with more ranks than cores the
    step's wall time is about this / the cores."""
    import torch
    import torch.distributed as dist

    iters = {v: iter(tr.dataloader) for v, tr in built.items()}
    times: dict[str, list[float]] = {v: [] for v in built}
    cpu: dict[str, list[float]] = {v: [] for v in built}
    losses: dict[str, list[float]] = {v: [] for v in built}
    tokens: dict[str, int] = {}
    for step in range(warmup + steps):
        for v, trainer in built.items():
            inputs, labels = next(iters[v])
            dist.barrier()
            c, t = _cpu_seconds(), time.perf_counter()
            loss, _ = trainer.train_step(inputs, labels)
            losses[v].append(trainer.reduce_mean(float(loss)))
            dist.barrier()
            if step >= warmup:
                times[v].append(time.perf_counter() - t)
                spent = torch.tensor([_cpu_seconds() - c], dtype=torch.float64)
                dist.all_reduce(spent)
                cpu[v].append(spent.item())
            tokens[v] = inputs.numel() * trainer.dp_degree
    out = {}
    for v, trainer in built.items():
        out[v] = {"step_s": statistics.median(times[v]), "tokens": tokens[v], "losses": losses[v],
                  "tokens_per_s": tokens[v] / statistics.median(times[v]), "cpu_s": statistics.median(cpu[v])}
        if measure is not None:
            out[v].update(measure(v, trainer))
    return out


def _cpu_seconds() -> float:
    """This process's CPU time so far (user + system, all its threads: gloo's included)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def profile_steps(built: dict[str, Any], steps: int, top: int = 12) -> dict[str, dict]:
    """Rank 0's torch profile of `steps` more steps of every built trainer, one variant after
    another (every rank steps in lockstep; only rank 0 records): per variant its `top` ops by
    self CPU time, the step's phases (forward_backward, clip, optimizer) and its collectives
    with when each started (ms after the step began), all per step."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from parallel.measure import PHASE_PREFIX

    out = {}
    for v, trainer in built.items():
        it = iter(trainer.dataloader)
        batches = [next(it) for _ in range(steps)]
        dist.barrier()
        prof = profile(activities=[ProfilerActivity.CPU]) if dist.get_rank() == 0 else contextlib.nullcontext()
        with prof:
            for inputs, labels in batches:
                with torch.profiler.record_function("bench_step"):
                    trainer.train_step(inputs, labels)
                dist.barrier()
        if dist.get_rank() != 0:
            continue
        avg = prof.key_averages()
        ops = sorted((e for e in avg if not e.key.startswith((PHASE_PREFIX, "bench_step", "ProfilerStep"))),
                     key=lambda e: -e.self_cpu_time_total)[:top]
        phases = {e.key.removeprefix(PHASE_PREFIX): e.cpu_time_total / 1e3 / steps
                  for e in avg if e.key.startswith(PHASE_PREFIX)}
        out[v] = {"ops": [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in ops],
                  "phases": phases, "collectives": _collective_starts(prof.events())}
    return out


def _collective_starts(events: Any) -> list[tuple[str, float]]:
    """(collective, ms after its step began) of the last profiled step: c10d's dispatcher ops
    (the functional collectives call them too, so each is counted once; DDP's reducer calls
    the process group directly, so its buckets do not show)."""
    steps = [e for e in events if e.name == "bench_step"]
    if not steps:
        return []
    last = max(steps, key=lambda e: e.time_range.start)
    t0, t1 = last.time_range.start, last.time_range.end
    picked = [(e.name, (e.time_range.start - t0) / 1e3) for e in events
              if t0 <= e.time_range.start <= t1 and e.name.startswith("c10d::") and e.name != "c10d::barrier"]
    return sorted(picked, key=lambda x: x[1])


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, nproc: int, port: int, threads: int, q: Any, job: Callable[[], Any]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=nproc)
        buf = io.BytesIO()
        torch.save(job(), buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PORT_TRIES = 3


def run_on_ranks(job: Callable[[], Any], nproc: int, *, threads: int = 1, timeout: float = 3600) -> Any:
    """Run `job()` on `nproc` spawned gloo ranks; rank 0's result (RuntimeError if one fails).
    The port is free when picked, but another process may take it before rank 0 listens
    (two test workers launching at once): then the launch is tried again on a new port."""
    for attempt in range(PORT_TRIES):
        try:
            return _launch(job, nproc, free_port(), threads, timeout)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _launch(job: Callable[[], Any], nproc: int, port: int, threads: int, timeout: float) -> Any:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, threads, q, job), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(nproc):
            rank, status, payload = q.get(timeout=timeout)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    except queue.Empty:
        raise RuntimeError(f"timed out after {timeout:.0f}s") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results[0]


def temp_folder() -> str:
    """A scratch folder for the benchmark's run folders (removed by the OS, not by us: the
    spawned ranks write into it)."""
    return tempfile.mkdtemp(prefix="autotitan_bench_")
