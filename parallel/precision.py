"""Dtype names of the config and the mixed-precision policy built from them (one place).

The trainer's TOML names dtypes ("float32", "bfloat16"); the recipes (FSDP2) and the
planner take a `MixedPrecisionPolicy(param_dtype, reduce_dtype)`. Both come from here.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Config dtype name -> torch dtype."""


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a config name (a dtype passes through)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def mixed_precision_policy(param_dtype: str | torch.dtype = "float32",
                           reduce_dtype: str | torch.dtype = "float32") -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters cast to `param_dtype` for compute, gradients reduced in
    `reduce_dtype`. The planner reads the same object (apply/cost: bf16 compute, fp32 reduce)."""
    return MixedPrecisionPolicy(param_dtype=dtype_of(param_dtype), reduce_dtype=dtype_of(reduce_dtype))


def is_mixed(policy: MixedPrecisionPolicy | None) -> bool:
    """True when the policy changes a dtype (anything but fp32 compute and fp32 reduction)."""
    if policy is None:
        return False
    return any(d not in (None, torch.float32) for d in (policy.param_dtype, policy.reduce_dtype))
