"""What the Hugging Face maps share (models/hf.py and its per-family modules): the error and
the description of how one of our tensors is stored in an HF checkpoint, and the RoPE entries
of a config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


class HFConfigError(ValueError):
    """An HF config this project cannot load (another architecture, an unsupported option)."""


@dataclass(frozen=True)
class HFTensors:
    """One of our tensors in an HF checkpoint: the HF tensors ``keys`` of ``shapes``. ``join``
    makes ours from them (in order; None: the one tensor as it is) and ``split`` theirs from
    ours, e.g. our stacked experts from HF's one-per-expert tensors. ``join`` may raise
    `HFConfigError` for values our model cannot represent."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    join: Optional[Callable[[list[torch.Tensor]], torch.Tensor]] = None
    split: Optional[Callable[[torch.Tensor], list[torch.Tensor]]] = None

    @property
    def direct(self) -> bool:
        """One HF tensor holding ours as it is (read in place, shard by shard)."""
        return self.join is None


def rope_config(cfg: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """(RoPE base, scaling dict or None) from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` (what hub configs still carry)."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = params if params.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling
