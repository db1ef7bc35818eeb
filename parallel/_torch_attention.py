"""The attention half of the torch adapter (torch 2.13): the fused SDPA kernels' private ops.

The joint graph keeps every SDPA call a fused kernel can take as ONE op, the CPU flash
kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward): that is what
torch runs on CPU, and what a CPU-only build can trace for a CUDA job. For those ops this
module registers what torch lacks (a DTensor sharding rule agreeing with DTensor's own
rules of the CUDA kernels: batch or heads; torch's SDPA FLOP count), decides which kernel a
call gets on its job's device (`fused_kernel`, torch's `sdp_utils` rules as far as a CPU
build can apply them) and runs the traced CPU op as that CUDA kernel (`run_lowered`) when
the runtime builds a CUDA job's graphs. Re-exported by `parallel._torch`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder as ShardingPlaceholder
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

CPU_ATTENTION_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_ATTENTION_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
CPU_ATTENTION_PACKETS = (aten._scaled_dot_product_flash_attention_for_cpu,
                         aten._scaled_dot_product_flash_attention_for_cpu_backward)
CUDA_ATTENTION_OPS = {
    "flash": (aten._scaled_dot_product_flash_attention.default,
              aten._scaled_dot_product_flash_attention_backward.default),
    "efficient": (aten._scaled_dot_product_efficient_attention.default,
                  aten._scaled_dot_product_efficient_attention_backward.default),
}
"""The CUDA kernels a traced CPU attention op is lowered to (forward, backward)."""
GPU = "cuda"
CPU_ATTENTION_OPS = (CPU_ATTENTION_FWD, CPU_ATTENTION_BWD)
FUSED_ATTENTION_CAUSAL_ARG = {CPU_ATTENTION_FWD: 4, CPU_ATTENTION_BWD: 7,
                              CUDA_ATTENTION_OPS["flash"][0]: 4, CUDA_ATTENTION_OPS["flash"][1]: 11,
                              CUDA_ATTENTION_OPS["efficient"][0]: 6, CUDA_ATTENTION_OPS["efficient"][1]: 11}
"""Every fused attention op the plan or its step graph holds -> the position of `is_causal`."""
FUSED_ATTENTION_BACKWARD = frozenset({CPU_ATTENTION_BWD, CUDA_ATTENTION_OPS["flash"][1],
                                      CUDA_ATTENTION_OPS["efficient"][1]})
"""The backward ones among them: their query is the second argument (after the output's
gradient), the forward's the first."""


def lowers_attention(device_type: str) -> bool:
    """Whether a job on `device_type` runs the traced CPU attention ops as CUDA kernels."""
    return device_type == GPU


# ---------------------------------------------------------------------------
# sharding rules and FLOP formulas of the CPU ops
# ---------------------------------------------------------------------------


def _mask_placement(kwargs_schema: Any, d: int, q: Any) -> list[Any]:
    """The mask's placement when q/k/v are sharded on dim d: sharded alike when it has that dim
    whole ([B, H, Sq, Sk]), replicated when it broadcasts over it; no entry without a mask."""
    mask = kwargs_schema.get("attn_mask")
    if not isinstance(mask, TensorMeta):
        return []
    whole = len(mask.shape) == 4 and isinstance(q, TensorMeta) and mask.shape[d] == q.shape[d]
    return [ShardingPlaceholder(d) if whole else Replicate()]


def attention_fwd_rule(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
    """outputs (out [B,H,S,D], logsumexp [B,H,S]); inputs (q, k, v [, attn_mask]): batch or
    heads, as DTensor's rules of the CUDA kernels (sequence sharding needs a CP region)."""
    return [[ShardingPlaceholder(d)] * 5 + _mask_placement(kwargs_schema, d, args_schema[0]) for d in (0, 1)]


def attention_bwd_rule(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
    """outputs (grad_q, grad_k, grad_v); inputs (grad_out, q, k, v, out, logsumexp [, attn_mask])."""
    return [[ShardingPlaceholder(d)] * 9 + _mask_placement(kwargs_schema, d, args_schema[1]) for d in (0, 1)]


def attention_fwd_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """torch's SDPA convention (causal masking not discounted, as FlopCounterMode counts it)."""
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def attention_bwd_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                        **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# ---------------------------------------------------------------------------
# which kernel an SDPA call gets (torch's sdp_utils rules)
# ---------------------------------------------------------------------------


def _proxy(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor of t's shape, dtype and last-dim stride on a few bytes of storage
    (stride 0 elsewhere): what torch's kernel choice reads, without the memory."""
    s = max(int(t.stride(-1)), 1) if t.ndim else 1
    base = torch.empty(max(int(t.shape[-1]) if t.ndim else 1, 1) * s, dtype=t.dtype)[::s]
    return base.reshape((1,) * (t.ndim - 1) + (-1,)).expand(t.shape) if t.ndim else base[0]


def _cpu_fused(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool, scale: Any,
               enable_gqa: bool) -> bool:
    """torch's own CPU choice (`_fused_sdp_choice`), asked on proxies of the call's tensors."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():  # a question, not part of any trace
        choice = torch._fused_sdp_choice(_proxy(q), _proxy(k), _proxy(v), None if mask is None else _proxy(mask),
                                         dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return int(choice) == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _gpu_kernel(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool, dtype: torch.dtype) -> tuple:
    """(kernel, why not fused) by torch's CUDA order (flash, then memory-efficient) on an sm80+ GPU:
    sdp_utils.cpp's `can_use_flash_attention` / `can_use_mem_efficient_attention` checks a CPU
    build can apply (dtype, head dims, mask, causal shape). cuDNN (first in torch's order only
    with cuDNN > 9.15 on sm90/sm100, a runtime fact) is not chosen here."""
    dq, dk, dv = int(q.shape[-1]), int(k.shape[-1]), int(v.shape[-1])
    if mask is not None:
        return None, "an attention mask (the flash kernel takes none; the lowering of the " \
                     "memory-efficient kernel's attention bias is not built)"
    if dropout_p > 0:
        return None, f"dropout {dropout_p} (the backward would need the forward's RNG state)"
    half = dtype in (torch.float16, torch.bfloat16)
    if half and dq == dk == dv <= 256 and not (is_causal and q.shape[-2] != k.shape[-2]):
        return "flash", ""
    align = 8 if half else 4
    if dtype in (torch.float16, torch.bfloat16, torch.float32) and dq == dk and dq % align == 0 \
            and dv % align == 0:
        return "efficient", ""
    return None, f"{dtype} with head dims q {dq}, k {dk}, v {dv} (flash: fp16/bf16, equal dims <= 256; " \
                 f"memory-efficient: fp32/fp16/bf16, dims divisible by {align})"


def fused_kernel(device_type: str, q: Any, k: Any, v: Any, mask: Any = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: Any = None, enable_gqa: bool = False,
                 dtype: torch.dtype | None = None) -> tuple[str | None, str]:
    """The fused kernel an SDPA call runs on `device_type` at compute `dtype` (default q's):
    ("flash_cpu" | "flash" | "efficient", "") or (None, why torch would take the math path).
    The joint graph holds the CPU kernel, so a GPU job's call must be one both can take."""
    cpu = _cpu_fused(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    if device_type != GPU:
        return ("flash_cpu", "") if cpu else (None, "torch's CPU kernel choice is the math path")
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        return None, "grouped-query heads (enable_gqa) are not lowered"
    kernel, why = _gpu_kernel(q, k, v, mask, dropout_p, is_causal, dtype or q.dtype)
    if kernel is not None and not cpu:
        return None, "the CPU flash kernel the joint graph is traced with cannot take it"
    return kernel, why


def cpu_attention(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None) -> Any:
    """The call as the CPU flash op itself (its output; autograd records its backward)."""
    return CPU_ATTENTION_FWD(q, k, v, dropout_p, is_causal, scale=scale)[0]


# ---------------------------------------------------------------------------
# the traced CPU op run as a CUDA kernel
# ---------------------------------------------------------------------------


def _rng_placeholder(like: Any, shape: tuple, dtype: torch.dtype) -> Any:
    """The RNG state a backward without dropout never reads, where `like` lives (a replicated
    DTensor on a DTensor's mesh: DTensor's rules take it replicated)."""
    if isinstance(like, DTensor):
        local = torch.empty(shape, dtype=dtype, device=like.to_local().device)
        return DTensor.from_local(local, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _fwd(kernel: str, q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False,
         attn_mask: Any = None, scale: Any = None) -> tuple:
    op = CUDA_ATTENTION_OPS[kernel][0]
    if kernel == "flash":
        out = op(q, k, v, dropout_p, is_causal, False, scale=scale)
    else:
        out = op(q, k, v, None, True, dropout_p, is_causal, scale=scale)
    return out[0], out[1]


def _bwd(kernel: str, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float,
         is_causal: bool, attn_mask: Any = None, scale: Any = None) -> tuple:
    op = CUDA_ATTENTION_OPS[kernel][1]
    if kernel == "flash":
        seed, offset = _rng_placeholder(q, (2,), torch.uint64), _rng_placeholder(q, (), torch.uint64)
        return op(grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], dropout_p, is_causal,
                  seed, offset, scale=scale)
    seed, offset = _rng_placeholder(q, (), torch.int64), _rng_placeholder(q, (), torch.int64)
    g = op(grad_out, q, k, v, None, out, lse, seed, offset, dropout_p, [True, True, True, False], is_causal,
           scale=scale)
    return g[0], g[1], g[2]


def lowered_kernel(args: tuple, kwargs: dict, backward: bool, dtype: torch.dtype | None = None) -> str | None:
    """The CUDA kernel a traced CPU attention node's call runs as (its tensors' dtype; the same
    for the forward and the backward of one call), None when no fused CUDA kernel takes it."""
    q, k, v = args[1:4] if backward else args[:3]
    rest = args[6:8] if backward else args[3:5]
    dropout_p, is_causal = (list(rest) + [0.0, False][len(rest):])[:2]
    return _gpu_kernel(q, k, v, kwargs.get("attn_mask"), dropout_p, is_causal, dtype or q.dtype)[0]


def run_lowered(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run the traced CPU attention op `op` (forward or backward) as the CUDA kernel torch would
    choose for these tensors: the forward's outputs are (out, logsumexp) as the CPU op's; the
    backward's (grad_q, grad_k, grad_v). A call no fused CUDA kernel takes raises: the trace
    sends such calls through the math path (trace/attention.py)."""
    backward = op is CPU_ATTENTION_BWD
    kernel = lowered_kernel(args, kwargs, backward)
    if kernel is None:
        raise RuntimeError(f"no fused CUDA attention kernel takes this call of {op}")
    return (_bwd if backward else _fwd)(kernel, *args, **kwargs)
