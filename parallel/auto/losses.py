"""The losses a language model is planned with: the model returns logits, the traced
forward returns a scalar."""

from __future__ import annotations

from typing import Any

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


NLL_FORWARD = torch.ops.aten.nll_loss_forward.default
NLL_BACKWARD = torch.ops.aten.nll_loss_backward.default
_MEAN = 1  # torch's Reduction::Mean
FP32_LOSS_OPS = (torch.ops.aten._log_softmax.default, torch.ops.aten._log_softmax_backward_data.default,
                 NLL_FORWARD, NLL_BACKWARD)
"""The cross-entropy's ops, which compute in fp32 under mixed precision (the model's
`logits.float()` is a no-op in the fp32 trace, so it is gone from the graph)."""


def is_mean_nll_without_weights(n: Any) -> bool:
    """`n` is a traced `nll_loss_forward` of a mean without class weights: its `total_weight`
    is the count of labels not ignored, which the runtime computes from the labels alone
    (runtime/loss_sync.py) and the planner prices as reduced beside the compute."""
    args = getattr(n, "args", ())
    return getattr(n, "target", None) is NLL_FORWARD and len(args) >= 5 and args[2] is None and args[3] == _MEAN
