"""What `hardware = "auto"` measures beside the roofline: memory-bound op classes and the optimizer.

Why: the roofline prices an op that does no matmul at the copy bandwidth (one `copy_` of
8 MiB, its buffers reused), and the optimizer step as a few memory-bound passes over the
parameters. A training step's elementwise ops are slower than that: each writes a fresh
output (new pages) while the activations it reads were written long before (out of the
core's cache), transcendentals (silu, exp) are compute-bound on a CPU core, `cat` copies
through an output it allocates; and torch's AdamW runs about twenty passes over each
parameter's bytes plus Python work per tensor (measured on a 2-core Xeon, 2 ranks: the
debug LLaMA's elementwise ops 1.5-2.7x and its AdamW step and clipping ~4x the prices made
from the copy bandwidth).

So each class is timed as a training step runs it: a chain of ops on a pool of activations
larger than a core's cache, every output kept alive a while (as autograd keeps them) and
then freed, its memory reused by a later output; and the optimizer is a real
`torch.optim.AdamW` step (foreach, as the runtime builds it) with torch's gradient-norm
clipping over a parameter set in many tensors, split into a cost per byte and per tensor.
Each figure is the best of short repeated runs (cost/timing.py): other work on the host
only ever slows a run down.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .timing import _best_time

__all__ = ["OP_CLASSES", "measure_op_bandwidths", "measure_optimizer"]

OP_CLASSES: tuple[str, ...] = ("elementwise", "transcendental", "reduction", "cat")
"""The memory-bound op classes a calibrated profile has a bandwidth for (compute.op_class)."""


def _chain_gbps(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], nbytes: int,
                pool: list[torch.Tensor], live: int, calls: int = 16) -> tuple[float, float]:
    """(GB/s, spread) of `op` called `calls` times in a row on pairs of the pool's tensors, each
    output kept alive for the next `live` calls (a step keeps its activations a while, then
    frees them: the allocator reuses their memory, as in training); `nbytes`: what one call
    reads and writes."""
    p, ring = len(pool), [None] * live
    at = [0]

    def chain() -> None:
        for i in range(calls):
            ring[at[0] % live] = op(pool[i % p], pool[(i + p // 2 + 1) % p])
            at[0] += 1

    t, spread = _best_time(chain, reps=5)
    return calls * nbytes / t / 1e9, spread


def measure_op_bandwidths(rows: int = 1024, cols: int = 256, pool: int = 8, live: int = 16,
                          device: torch.device | None = None) -> dict[str, float]:
    """GB/s (bytes read + written per second) of each class of `OP_CLASSES` on activations of
    `rows` x `cols` fp32 (1 MiB by default: a debug model's; a pool of 8 is more than a core's
    L2), and `spread`, the widest median / best - 1. The reduction is the mean of a row sum
    (a norm's) and a column sum (a broadcast weight's gradient): a layer runs both."""
    xs = [torch.randn(rows, cols, device=device) for _ in range(pool)]
    size = rows * cols * 4
    out: dict[str, float] = {}
    spreads = []
    for key, op, nbytes in (
            ("elementwise", lambda a, b: a * b, 3 * size),
            ("transcendental", lambda a, b: F.silu(a), 2 * size),
            ("cat", lambda a, b: torch.cat([a, b], -1), 4 * size)):
        out[key], spread = _chain_gbps(op, nbytes, xs, live)
        spreads.append(spread)
    row, sp_row = _chain_gbps(lambda a, b: a.sum(-1, keepdim=True), size + rows * 4, xs, live)
    col, sp_col = _chain_gbps(lambda a, b: a.sum(0), size + cols * 4, xs, live)
    out["reduction"] = 2 / (1 / row + 1 / col)  # the same bytes of each: the harmonic mean
    out["spread"] = max(spreads + [sp_row, sp_col])
    return out


def _params(total_bytes: int, tensors: int, device: torch.device | None) -> list[torch.nn.Parameter]:
    """`tensors` fp32 parameters of `total_bytes` in all, each with a gradient."""
    n = max(1, total_bytes // 4 // tensors)
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(n, device=device)
    return params


def _optimizer_step_time(params: list[torch.nn.Parameter], reps: int, implementation: str) -> tuple[float, float]:
    """(best seconds, spread) of the runtime's optimizer phase on `params`: the gradient norm,
    clipping and an AdamW step of this implementation ("foreach" or "fused"; trainer/optim.py)."""
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=implementation == "foreach",
                            fused=implementation == "fused" or None)

    def step() -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
        opt.step()

    return _best_time(step, reps)


def measure_optimizer(mib: float = 16.0, tensors: int = 32, device: torch.device | None = None,
                      implementation: str = "foreach") -> dict[str, float]:
    """The optimizer phase's cost with AdamW's `implementation`: `gbps`, parameter bytes (fp32)
    stepped per second, from `mib` MiB in `tensors` tensors (optimizer states and gradients 4x
    that: out of cache, as a model's are), and `tensor_us`, what each further tensor adds (64
    tiny ones against 8); `spread`: the widest median / best - 1."""
    t_many, sp_many = _optimizer_step_time(_params(64 * 1024, 64, device), 9, implementation)
    t_few, sp_few = _optimizer_step_time(_params(8 * 1024, 8, device), 9, implementation)
    tensor_s = max(0.0, (t_many - t_few) / 56)
    total = int(mib * 2**20)
    t_big, sp_big = _optimizer_step_time(_params(total, tensors, device), 5, implementation)
    bytes_s = max(t_big - tensors * tensor_s, 0.25 * t_big)  # a noisy per-tensor figure never takes it all
    return {"gbps": total / bytes_s / 1e9, "tensor_us": tensor_s * 1e6, "spread": max(sp_many, sp_few, sp_big)}
