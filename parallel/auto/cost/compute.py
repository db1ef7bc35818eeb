"""Compute cost of one op on per-device (local) shapes: a roofline.

    t = max(FLOPs / (peak[dtype] · eff_matmul), bytes / (mem_bw · eff_memory)) + kernel_floor

FLOPs come from ``FlopCounterMode`` by running the op on meta tensors of the local
shapes (no memory, no device), cached by (op, shapes, dtypes, static args) because a
transformer repeats the same ~100 keys thousands of times. Bytes moved = local input +
output bytes. View-like ops (view, reshape, t, transpose, getitem, detach, ...) launch no
kernel and cost 0.

CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward)
counts 0 FLOPs in FlopCounterMode until ``parallel._torch.register_planner_ops()``
registers torch's SDPA formulas for it; `FlopCache` makes sure it has. A fused attention op
is priced as its kernel (`attention_flops`): torch's count at the profile's attention
efficiency, halved when causal (the kernels skip the masked blocks), at the efficiency a
calibrated profile measured for the kernel's direction, head dim and sequence length
(`attention_efficiency`; the CPU kernel's speed varies ~2x over them).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from parallel import _torch as T

from .hardware import HardwareProfile

__all__ = [
    "ZERO_COST_OPS",
    "ComputeEstimate",
    "FlopCache",
    "TensorLike",
    "attention_efficiency",
    "attention_flops",
    "is_zero_cost",
    "op_class",
    "op_name",
    "roofline_us",
]

#: ops that launch no kernel (aliases / metadata changes): cost 0
ZERO_COST_OPS: frozenset[str] = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand",
    "expand_as", "view_as", "squeeze", "unsqueeze", "detach", "alias", "lift_fresh",
    "as_strided", "slice", "select", "split", "split_with_sizes", "unsafe_split", "unbind",
    "narrow", "chunk", "diagonal", "unflatten", "flatten", "view_as_real", "view_as_complex",
    "real", "imag", "getitem", "numpy_T", "_conj", "conj", "resolve_conj", "resolve_neg",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "empty_like_view",
    "wait_tensor", "_assert_tensor_metadata", "_assert_async", "sym_constrain_range_for_size",
})

#: what a per-device tensor may be described as
TensorLike = Any  # torch.Tensor (meta/fake), TensorMeta-like (.shape, .dtype), (shape, dtype)


def op_name(op: Any) -> str:
    """Short name of an OpOverload / packet / callable / fx node target ("mm", "view", ...)."""
    if op is operator.getitem:
        return "getitem"
    if isinstance(op, str):
        return op.split("::")[-1].split(".")[0]
    return T.op_name(op)


def is_zero_cost(op: Any) -> bool:
    """True for ops that launch no kernel (see ZERO_COST_OPS)."""
    return op_name(op) in ZERO_COST_OPS


#: memory-bound ops by class (a calibrated profile's `op_bandwidth_gbps`, cost/calibrate_ops.py):
#: transcendentals are compute-bound on a CPU core, reductions and `cat` run their own
#: kernels; every other op without FLOPs is "elementwise"
OP_CLASS_OF: dict[str, str] = {
    **dict.fromkeys(("silu", "silu_backward", "sigmoid", "sigmoid_backward", "exp", "exp2", "expm1", "log",
                     "log1p", "log2", "tanh", "tanh_backward", "gelu", "gelu_backward", "erf", "rsqrt", "sqrt",
                     "sin", "cos", "_softmax", "_softmax_backward_data", "_log_softmax",
                     "_log_softmax_backward_data", "softplus", "logsumexp"), "transcendental"),
    **dict.fromkeys(("sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod", "norm",
                     "linalg_vector_norm", "argmax", "argmin", "any", "all"), "reduction"),
    **dict.fromkeys(("cat", "stack"), "cat"),
}


def op_class(op: Any) -> str:
    """The memory-bound class an op without FLOPs is priced in (see OP_CLASS_OF)."""
    return OP_CLASS_OF.get(op_name(op), "elementwise")


def roofline_us(hw: HardwareProfile, flops: float, nbytes: float, dtype: torch.dtype | str | None,
                efficiency: float | None = None, op_class: str | None = None) -> float:
    """max(compute time, memory time) + kernel floor, in µs; `efficiency`: the compute roof's
    fraction the kernel reaches (default the profile's matmul efficiency); `op_class`: an op
    without FLOPs moves its bytes at that class's calibrated bandwidth (else the memory roof)."""
    t_flop = flops / (hw.peak_flops(dtype) * (efficiency or hw.matmul_efficiency)) if flops > 0 else 0.0
    bandwidth = hw.op_bandwidth(op_class if flops <= 0 else None)
    t_mem = nbytes / bandwidth if nbytes > 0 else 0.0
    return max(t_flop, t_mem) * 1e6 + hw.kernel_floor_us


def attention_flops(op: Any, args: Sequence[Any], flops: float) -> float | None:
    """The FLOPs a fused attention kernel runs for `op(*args)` (torch's count, which ignores
    causal masking, halved when `is_causal`), None for any other op."""
    at = T.FUSED_ATTENTION_CAUSAL_ARG.get(op)
    if at is None:
        return None
    return flops / 2 if len(args) > at and args[at] is True else flops


def attention_efficiency(hw: HardwareProfile, op: Any, args: Sequence[Any]) -> float:
    """The fraction of the compute roof the fused attention op `op(*args)` reaches: the
    profile's figure for its direction and query's (head dim, length) when it has a grid."""
    backward = op in T.FUSED_ATTENTION_BACKWARD
    at = 1 if backward else 0
    query = _as_shape_dtype(args[at]) if len(args) > at and hw.attention_grid else None
    if query is None or len(query[0]) < 2:
        return hw.attention_eff
    return hw.attention_eff_for(backward, query[0][-1], query[0][-2])


# ------------------------------------------------------------------ tensor descriptions
def _as_shape_dtype(x: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(shape, dtype) of a tensor description, or None when x is not one."""
    if isinstance(x, torch.Tensor):
        return tuple(int(s) for s in x.shape), x.dtype
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        return _as_shape_dtype(v) if v is not None else None
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype) and \
            isinstance(x[0], (tuple, list, torch.Size)):
        return tuple(int(s) for s in x[0]), x[1]
    if hasattr(x, "shape") and hasattr(x, "dtype") and isinstance(getattr(x, "dtype"), torch.dtype):
        return tuple(int(s) for s in x.shape), x.dtype
    if hasattr(x, "tensor_meta") and getattr(x, "tensor_meta") is not None:  # DTensorSpec (global!)
        return _as_shape_dtype(x.tensor_meta)
    return None


def _freeze(x: Any) -> Any:
    """Hashable signature of an argument tree; tensors become ('T', shape, dtype)."""
    sd = _as_shape_dtype(x)
    if sd is not None:
        return ("T", sd[0], sd[1])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_freeze(y) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _freeze(v)) for k, v in x.items())))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", str(x))
    try:
        hash(x)
        return x
    except TypeError:
        return ("R", repr(x))


def _materialize(x: Any) -> Any:
    """Replace tensor descriptions by meta tensors, devices by meta (never allocate)."""
    sd = _as_shape_dtype(x)
    if sd is not None:
        return torch.empty(sd[0], dtype=sd[1], device="meta")
    if isinstance(x, list):
        return [_materialize(y) for y in x]
    if isinstance(x, tuple):
        return tuple(_materialize(y) for y in x)
    if isinstance(x, dict):
        return {k: _materialize(v) for k, v in x.items()}
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


def _tensor_list(x: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    sd = _as_shape_dtype(x)
    if sd is not None:
        return [sd]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensor_list(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensor_list(y)]
    return []


def _nbytes(tensors: Sequence[tuple[tuple[int, ...], torch.dtype]], as_dtype: torch.dtype | None = None) -> int:
    total = 0
    for shape, dt in tensors:
        size = dt.itemsize
        if as_dtype is not None and dt.is_floating_point:
            size = as_dtype.itemsize
        total += math.prod(shape) * size
    return total


# ------------------------------------------------------------------ FLOP counting
@dataclass(frozen=True)
class ComputeEstimate:
    """FLOPs and output tensors of one op on local shapes (cached)."""

    flops: float
    outputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    ran: bool  # False when the op could not run on meta tensors (flops then 0)


class FlopCache:
    """Counts FLOPs (and output shapes) of an op on local shapes once per unique key."""

    MAX_ENTRIES = 200_000
    """Entries kept before the cache starts again (a 405B mesh search counts some 10 k)."""
    _shared: "FlopCache | None" = None

    def __init__(self) -> None:
        T.register_planner_ops()  # FLOP formulas of the CPU flash-attention ops
        self._cache: dict[Any, ComputeEstimate] = {}

    @classmethod
    def shared(cls) -> "FlopCache":
        """The process's cache: an op's FLOPs on given local shapes depend on neither the hardware
        nor the mesh, so every cost model of a process (a search's candidates, a pipeline's
        stages, the copies of a screened model) counts each op once."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def __len__(self) -> int:
        return len(self._cache)

    def estimate(self, op: Callable[..., Any], args: Sequence[Any],
                 kwargs: Mapping[str, Any] | None = None) -> ComputeEstimate:
        kwargs = dict(kwargs or {})
        key = (op, _freeze(tuple(args)), _freeze(kwargs))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        est = self._run(op, args, kwargs)
        if len(self._cache) >= self.MAX_ENTRIES:
            self._cache.clear()
        self._cache[key] = est
        return est

    @staticmethod
    def _run(op: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> ComputeEstimate:
        margs, mkwargs = _materialize(tuple(args)), _materialize(dict(kwargs))
        try:
            with FlopCounterMode(display=False) as fc:
                out = op(*margs, **mkwargs)
            flops = float(fc.get_total_flops())
            outputs, ran = tuple(_tensor_list(out)), True
        except Exception:
            flops, outputs, ran = 0.0, (), False
        return ComputeEstimate(flops, outputs, ran)
