"""Spawn a function on N gloo ranks (CPU) and collect per-rank results; used by recipe tests."""

from __future__ import annotations

import io
import os
import queue as _queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, q, args):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import logging

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


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function. Raises with the first rank's traceback on failure
    and kills all ranks after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, q, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = q.get(timeout=timeout)
            except _queue.Empty:
                raise TimeoutError(f"distributed test timed out after {timeout}s "
                                   f"({len(results)} of {world_size} ranks finished)")
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
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
