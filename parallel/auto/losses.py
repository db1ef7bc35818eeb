"""The losses a language model is planned with: the model returns logits, the traced
forward returns a scalar."""

from __future__ import annotations

import torch
from torch import nn

from models import cross_entropy_loss


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Language-model loss around a model returning logits (mean cross-entropy, fp32)."""
    return cross_entropy_loss(model(tokens), labels)


def lm_loss_positions(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """`lm_loss` with the RoPE positions of the tokens (a reordered sequence: CP load balance)."""
    return cross_entropy_loss(model(tokens, positions), labels)
