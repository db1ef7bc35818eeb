"""`[validation]`: the loss and perplexity of held-out data, every `freq` steps, forward only.

    tokens, held = holdout(cfg, tokens)         # the training stream without its held-back tail
    validator = Validator(cfg, tokenizer, held, dp_rank=..., dp_degree=..., device=...)
    loss, ppl, n = validator.run(model, parallelizer, seq_len)   # every rank; the same numbers

The data is `validation.data` (read like `[data] path`), or else the tail of the training
stream: `steps` global batches of windows of the longest scheduled length, cut off before
the training loader is built, so training never sees them. Each validation step takes one
global batch in order, data-parallel rank r its r-th slice (as training does), and runs the
mode's forward-only step (`ParallelismMode.forward_loss`: the recipes' model or the plan's
forward phase, no backward, no optimizer) under no_grad with the RNG forked, the model in
eval mode and put back as it was. The loss is averaged over every token of every rank
(all-reduce of loss x tokens and tokens), so it equals a 1-rank evaluation of the same
weights on the same windows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from .config import JobConfig
from .data import DataError, TokenWindows, load_tokens
from .device import CUDA
from .tokenizer import Tokenizer

logger = logging.getLogger("autotitan")


def held_tokens(cfg: JobConfig, dp_degree: int) -> int:
    """Tokens the training stream holds back for validation (0: none, validation has its own data):
    `steps` global batches of windows of the longest scheduled length."""
    v, t = cfg.validation, cfg.training
    if not v.enable or v.data:
        return 0
    return v.steps * t.local_batch_size * dp_degree * max(t.seq_lens()) + 1


def holdout(tokens: torch.Tensor, n_held: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(training tokens, held-back tail): the last `n_held` tokens go to validation only."""
    if n_held <= 0:
        return tokens, None
    if len(tokens) <= n_held:
        raise DataError(f"the corpus of {len(tokens)} tokens cannot hold back the {n_held} tokens that "
                        f"validation.steps global batches need and still train; lower validation.steps or set "
                        f"validation.data", key="validation.steps")
    return tokens[: len(tokens) - n_held + 1], tokens[len(tokens) - n_held:]


def validation_tokens(cfg: JobConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """The packed tokens of `validation.data` (the [data] section's reader settings)."""
    data_cfg = dataclasses.replace(cfg.data, path=cfg.validation.data, streaming=False, shuffle=False)
    return load_tokens(data_cfg, tokenizer)


class Validator:
    """Runs `[validation]` on this rank: its slice of each held-out global batch."""

    def __init__(self, cfg: JobConfig, tokens: torch.Tensor, *, dp_rank: int, dp_degree: int,
                 device: torch.device, source: str) -> None:
        self.cfg, self.tokens, self.device = cfg, tokens, device
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.distributed = dist.is_available() and dist.is_initialized()
        self.source = source  # how the data was chosen, for the log
        self.batches(max(cfg.training.seq_lens()))  # no full global batch at any length: a config error now

    def should_run(self, step: int) -> bool:
        return self.cfg.validation.enable and step % self.cfg.validation.freq == 0

    def batches(self, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, labels) of each validation global batch at `seq_len` (in order)."""
        b = self.cfg.training.local_batch_size
        gb = b * self.dp_degree
        try:
            ds = TokenWindows(self.tokens, seq_len)
        except DataError:
            ds = None
        n = min(self.cfg.validation.steps, len(ds) // gb) if ds is not None else 0
        if n < 1:
            raise DataError(f"the validation data has {len(self.tokens)} tokens, fewer than one global batch of "
                            f"{gb} windows of {seq_len} + 1 tokens; give it more text",
                            key="validation.data" if self.cfg.validation.data else "validation.steps")
        out = []
        for i in range(n):
            first = i * gb + self.dp_rank * b
            xs, ys = zip(*(ds[j] for j in range(first, first + b)))
            out.append((torch.stack(xs), torch.stack(ys)))
        return out

    def run(self, model: torch.nn.Module, parallelizer: Any, seq_len: int) -> tuple[float, float, int]:
        """(mean loss over all validation tokens, perplexity, tokens) of the model's current weights."""
        batches = self.batches(seq_len)
        total = evaluate(model, parallelizer, batches, self.device, self.distributed)
        return total[0], math.exp(min(total[0], 700.0)), int(total[1])


def evaluate(model: torch.nn.Module, parallelizer: Any, batches: list, device: torch.device,
             distributed: bool) -> tuple[float, float]:
    """(mean loss, tokens) over `batches` on every rank: forward only, nothing of training changed
    (no grad, RNG forked, the train/eval mode restored)."""
    was_training = model.training
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    devices = [device] if device.type == CUDA else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad():
            for inputs, labels in batches:
                inputs, labels, positions = parallelizer.shard_batch(inputs.to(device), labels.to(device))
                loss = parallelizer.forward_loss(model, inputs, labels, positions)
                sums[0] += loss.detach().double() * labels.numel()
                sums[1] += labels.numel()
    finally:
        model.train(was_training)
    if distributed and dist.get_world_size() > 1:
        dist.all_reduce(sums)  # every rank of a data-parallel group repeats its group's numbers: the ratio holds
    return (sums[0] / sums[1]).item(), sums[1].item()


__all__ = ["Validator", "evaluate", "held_tokens", "holdout", "validation_tokens"]
