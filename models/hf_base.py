"""What the Hugging Face maps share (models/hf.py and its per-family modules): the error and
the description of how one of our tensors is stored in an HF checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

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
