"""Expert balancing around the optimizer step (DeepSeek-V3's MoE; models/moe.py).

`prepare_moe_step` before a step's forwards: the sequence-wise auxiliary loss is a mean over
the step's micro-batches, as the language-model loss is. `balance_experts` after the optimizer
step: the token counts of every MoE layer with `load_balance_coeff` > 0 are summed over all
ranks (one all_reduce on the default process group, or, with pipeline stages, on the ranks of
this rank's stages: the counts must add up over the data and expert ranks; tensor-parallel ranks
route the same tokens and count them again, every expert alike, which leaves the sign of the
update unchanged) and each layer's expert bias takes its step. A step that was skipped
(non-finite) only restarts the counts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from models.moe import MoE

LOCAL = "local"
"""`balance_experts(ranks=LOCAL)`: no other rank holds this rank's layers (a pipeline without other axes)."""


def moe_layers(model: torch.nn.Module) -> list[MoE]:
    """The model's MoE layers."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def prepare_moe_step(model: torch.nn.Module, micro_batches: int) -> None:
    """Each micro-batch's auxiliary-loss gradient counts 1 / micro_batches."""
    for m in moe_layers(model):
        m.aux_grad_scale = 1.0 / micro_batches


def balance_experts(model: torch.nn.Module, stepped: bool = True, ranks: Any = None) -> int:
    """After the optimizer step: update the expert biases from the token counts summed over
    all ranks (`stepped` False: the step was skipped; the counts restart, the biases stay).
    `ranks`: the process group holding the same layers as this rank (pipeline parallel: the
    ranks of its stages; LOCAL: this rank alone); None: all ranks. Returns the number of layers
    updated."""
    layers = [m for m in moe_layers(model) if m.load_balance_coeff]
    if not layers:
        return 0
    if not stepped:
        for m in layers:
            m.tokens_per_expert.zero_()
        return 0
    counts = torch.stack([m.tokens_per_expert for m in layers])
    if ranks is not LOCAL and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts, group=ranks)
    for m, c in zip(layers, counts):
        m.update_expert_bias(c)
    return len(layers)
