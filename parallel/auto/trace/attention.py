"""SDPA calls in the joint graph: one fused op each, or torch's math path with a note.

Every `F.scaled_dot_product_attention` call of the traced model is checked against the kernels
of the job's device (`T.fused_kernel`: torch's own CPU choice; for a GPU job torch's CUDA
rules at the compute dtype, flash then memory-efficient). A call a fused kernel takes is traced
as the CPU flash op, one node with its backward, whatever device the trace runs on: the
planner plans that op (DTensor rule: batch or heads), and the runtime runs it as the job's
kernel (a GPU job's CUDA kernel: runtime/interpreter.py). A call no fused kernel takes is
traced through torch's math path (bmm + softmax, the [S, S] scores as activations) and
noted: the coverage report prints the note, so the slower path is never silent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from parallel import _torch as T

_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def _call(args: tuple, kwargs: dict) -> dict[str, Any]:
    """SDPA's arguments by name."""
    bound = dict(zip(_PARAMS, _DEFAULTS))
    bound.update(zip(_PARAMS, args))
    bound.update(kwargs)
    return bound


def _shape(t: Any) -> str:
    return "x".join(str(int(s)) for s in t.shape)


class SdpaCalls(TorchFunctionMode):
    """Torch-function mode of a trace: each SDPA call as its fused op or, noted, the math path.

    `device_type`: the job's device; `dtype`: the dtype attention computes in at run time
    (mixed precision's parameter dtype; None: the traced dtype). `notes`: one line per
    distinct call taken through the math path; `kernels`: the fused kernel of each call shape."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None):
        super().__init__()
        self.device_type = device_type
        self.dtype = dtype
        self.notes: dict[str, None] = {}
        self.kernels: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        c = _call(args, kwargs)
        q, k, v, mask = c["query"], c["key"], c["value"], c["attn_mask"]
        kernel, why = T.fused_kernel(self.device_type, q, k, v, mask, c["dropout_p"], c["is_causal"], c["scale"],
                                     c["enable_gqa"], self.dtype)
        what = f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}{', mask ' + _shape(mask) if mask is not None else ''}"
        if kernel is None:
            self.notes[f"attention ({what}, {self.dtype or q.dtype}) on {self.device_type}: planned through "
                       f"torch's math path (bmm + softmax, [S, S] scores kept): {why}"] = None
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        self.kernels[what] = kernel
        if mask is None and not c["enable_gqa"]:
            return T.cpu_attention(q, k, v, c["dropout_p"], c["is_causal"], c["scale"])
        return func(*args, **kwargs)  # torch's CPU kernel takes it (a mask): its own dispatch
