"""What `hardware = "auto"` measures of the fused attention kernel: its speed per shape and direction.

Why: one figure (a forward at head dim 64, sequence 512) priced every attention op, but the
CPU flash kernel's speed varies about 2x over the shapes jobs run (on a 2-core Xeon, 1
thread a rank, causal, fp32, of the matmul roof with causal FLOPs halved as the cost model
counts them: head dim 32 / seq 128 0.24 forward, head dim 64 / seq 512 0.39, head dim 128 /
seq 2048 0.7), its backward runs at its own speed, and at short sequences it does not skip
the masked blocks the count halves. So the forward and the backward are timed as the models
call them (F.scaled_dot_product_attention, causal, through autograd) at a small grid of head
dims and sequence lengths, and the cost model prices an op at the nearest grid point
(HardwareProfile.attention_eff_for). Each figure is the best of short repeated runs
(cost/timing.py); the grid takes well under a second a rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from parallel import _torch as T

from .timing import _best_time

__all__ = ["HEAD_DIMS", "SEQ_LENS", "attention_key", "measure_attention_grid"]

HEAD_DIMS: tuple[int, ...] = (32, 64, 128)
SEQ_LENS: tuple[int, ...] = (128, 512, 2048)
CALL_FLOPS = 3e7
"""About what one timed forward runs (batch x heads chosen for it): ~0.3-1 ms on a CPU core."""


def attention_key(backward: bool, head_dim: int, seq: int) -> str:
    """The profile's [attention_efficiency] key of one grid point ("fwd_d32_s128")."""
    return f"{'bwd' if backward else 'fwd'}_d{head_dim}_s{seq}"


def _counted(fn: object) -> float:
    """FLOPs the cost model counts for `fn()` (torch's counter with the CPU kernels' formulas)."""
    with FlopCounterMode(display=False) as fc:
        fn()  # type: ignore[operator]
    return float(fc.get_total_flops())


def _point(head_dim: int, seq: int, causal: bool, device: torch.device | None) -> tuple[float, float, float]:
    """(forward TFLOP/s, backward TFLOP/s, spread) of one grid point, FLOPs counted as the cost
    model prices a fused attention op (halved when causal: compute.attention_flops)."""
    bh = max(1, int(CALL_FLOPS / (4 * seq * seq * head_dim)))
    q, k, v = (torch.randn(1, bh, seq, head_dim, device=device, requires_grad=True) for _ in range(3))
    g = torch.randn(1, bh, seq, head_dim, device=device)

    def fwd() -> object:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd() -> object:
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), g)

    f_fwd = _counted(fwd)
    f_bwd = _counted(fwd_bwd) - f_fwd
    reps = 5 if seq * seq * head_dim * bh <= 4 * CALL_FLOPS else 3
    t_fwd, sp_fwd = _best_time(fwd, reps)
    t_all, sp_all = _best_time(fwd_bwd, reps)
    t_bwd = max(t_all - t_fwd, 0.5 * t_fwd)  # a noisy difference never makes the backward free
    half = 0.5 if causal else 1.0
    return half * f_fwd / t_fwd / 1e12, half * f_bwd / t_bwd / 1e12, max(sp_fwd, sp_all)


def measure_attention_grid(head_dims: tuple[int, ...] = HEAD_DIMS, seq_lens: tuple[int, ...] = SEQ_LENS,
                           causal: bool = True, device: torch.device | None = None) -> dict[str, float]:
    """TFLOP/s of the fused attention kernel, forward and backward, fp32, at each (head dim,
    sequence length) of the grid (keys `attention_key`), and `spread`, the widest median /
    best - 1. Causal by default: what the models run (models/layers.py)."""
    T.register_planner_ops()  # the CPU kernels' FLOP formulas, as the cost model counts them
    out: dict[str, float] = {}
    spreads = []
    for d in head_dims:
        for s in seq_lens:
            fwd, bwd, spread = _point(d, s, causal, device)
            out[attention_key(False, d, s)], out[attention_key(True, d, s)] = fwd, bwd
            spreads.append(spread)
    out["spread"] = max(spreads, default=0.0)
    return out
