"""Start a function on N gloo ranks (CPU) and collect per-rank results; used by the tests.

Every rank runs with one thread (``OMP_NUM_THREADS=1`` in its environment and
``torch.set_num_threads(1)``: N ranks share few cores), and the whole run has a deadline.
Ranks are forked from one fork server per test process that has imported torch and the
project once (``forkserver`` with preloaded modules): a fresh rank then starts in ~0.1 s
instead of the ~3.5 s a spawned interpreter spends importing them, and still shares no
state with the ranks of other tests.
"""

from __future__ import annotations

import io
import logging
import os
import queue as _queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, q, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # full_tensor() of (_StridedShard, Shard) grads warns about 2 sequential all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # bytes, not shared-memory tensors: safe after the worker exits
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# imported once by the fork server, before any rank is forked from it
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "torch.fx",
            "torch.distributed.fsdp", "models", "parallel.auto.api", "parallel.recipes", "trainer.trainer"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _start(ctx, fn, world_size: int, q, args) -> list:
    """Start the ranks with ``OMP_NUM_THREADS=1`` (read by the fork server when the first
    rank starts it, and by each child at its start)."""
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, q, args), daemon=True)
             for r in range(world_size)]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return procs


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function. Raises with the first rank's traceback on failure
    and kills all ranks when they have not all finished ``timeout`` seconds after the start.
    """
    ctx = _context()
    q = ctx.Queue()
    procs = _start(ctx, fn, world_size, q, args)
    deadline = time.monotonic() + timeout
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except _queue.Empty:
                raise TimeoutError(f"distributed test timed out after {timeout}s "
                                   f"({len(results)} of {world_size} ranks finished)") from None
            if status != "ok":
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
