"""The one place that reads torch.distributed.pipelining's private state (the pp recipe's needs)."""

from __future__ import annotations

from typing import Any

__all__ = ["stage_infers_metadata"]


def stage_infers_metadata(stage: Any) -> bool:
    """True while a ``PipelineStage`` runs its one-time metadata inference: a real forward (and
    backward) on the first microbatch or on empty tensors, before its outputs' shapes are known
    (torch 2.13: ``stage._stage_meta.outputs`` is still None)."""
    meta = getattr(stage, "_stage_meta", None)
    return meta is not None and getattr(meta, "outputs", None) is None
