"""The dry run of a pipeline-parallel job (``pipeline_parallel_degree`` > 1; trainer/dry_run.py
calls it): the simulated rank (rank 0, pp rank 0) builds its stages as the trainer does
(``parallel.recipes.pp``: the split, then the other recipes on each stage module), and each
local stage runs one microbatch forward + backward on fake tensors: the first stage from
tokens, the others from a fake hidden state ``[microbatch, seq, dim]``; the last one ends in
the loss, the others in a fake output gradient.

Memory: the activations a stage keeps for its backward are measured for one microbatch and
counted as many times as the schedule keeps microbatches in flight on that stage (GPipe and
LoopedBFS: all of them; the 1F1B family: at most the stages from it to the last, as torch's
1F1B warm-up does). Communication: the collectives of that one microbatch per local stage (FSDP's
all-gathers repeat per microbatch, its reduce-scatters once a step) and the pipeline's
point-to-point traffic of the whole step (activations forward, their gradients backward).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models import cross_entropy_loss
from parallel.mesh import CP, PP, axis_size
from parallel.precision import dtype_of
from parallel.recipes import apply_recipe, validate_pipeline
from parallel.recipes.cp import cp_shard_batch
from parallel.recipes.pp import PipelineLayout, rank_stages

from .config import JobConfig

__all__ = ["PipelineRank", "pipeline_rank", "pipeline_fwd_bwd"]

@dataclass
class PipelineRank:
    """The simulated pp rank's stages: their indices, modules and the rank's model (their union)."""

    layout: PipelineLayout
    stage_ids: list[int]
    parts: list[nn.Module]
    model: nn.Module

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations ``stage`` holds at once under the schedule."""
        return self.layout.in_flight(stage)


def pipeline_rank(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig) -> PipelineRank:
    """Split the meta ``model`` as pp rank 0 does and parallelize each stage (RecipeError for a
    degree that does not fit)."""
    validate_pipeline(mesh, cfg)
    layout, ids, parts, rank_model = rank_stages(model, mesh[PP], cfg.parallelism.pipeline,
                                                 cfg.training.local_batch_size)
    for part in parts:
        apply_recipe(part, mesh, cfg, ddp=False, loss_parallel=False, sequence_parallel=False)
    return PipelineRank(layout, ids, parts, rank_model)


def _hidden_dtype(cfg: JobConfig, model: nn.Module) -> torch.dtype:
    """The dtype a stage passes on: FSDP's param dtype when it shards, else the master dtype."""
    fsdp = any(type(m).__name__.startswith("FSDP") for m in model.modules())
    t = cfg.training
    return dtype_of(t.mixed_precision_param if fsdp else t.dtype)


def _stage_step(part: nn.Module, first: bool, last: bool, shape: tuple[int, int, int], dtype: torch.dtype,
                mem: Any, positions: Optional[torch.Tensor]) -> int:
    """One microbatch forward + backward through a stage module; the bytes its forward left alive."""
    mb, seq, dim = shape
    x = torch.zeros(mb, seq, dtype=torch.long) if first else torch.zeros(mb, seq, dim, dtype=dtype, requires_grad=True)
    before = mem.current
    out = part(x) if positions is None else part(x, positions)
    if last:
        out = cross_entropy_loss(out, torch.zeros(mb, seq, dtype=torch.long))
    kept = mem.current - before
    out.backward(None if last else torch.ones_like(out))
    return kept


def pipeline_fwd_bwd(cfg: JobConfig, run: PipelineRank, mesh: DeviceMesh, dim: int, mem: Any, comm: Any,
                     ctx: Callable[[], Any]) -> dict[str, Any]:
    """One microbatch forward + backward through each local stage under ``mem`` (MemoryTracker)
    and ``comm`` (the collective counter), inside ``ctx()``; returns the report's numbers:
    activations (in flight), peak, point-to-point count and bytes, notes."""
    layout, mb = run.layout, cfg.parallelism.pipeline.pipeline_parallel_microbatch_size
    tokens, positions = torch.zeros(mb, max(cfg.training.seq_lens()), dtype=torch.long), None
    if axis_size(mesh, CP) > 1:  # this cp rank's share of the sequence
        tokens, _, positions = cp_shard_batch(tokens, tokens, mesh, CP)
    shape = (mb, tokens.shape[1], dim)
    dtype = _hidden_dtype(cfg, run.model)
    activations, extra, p2p = 0, 0, 0
    with warnings.catch_warnings(), mem, ctx():
        # CommDebugMode hooks every module; a stage fed a fake hidden state, FSDP's view outputs: torch warns
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        for stage, part in zip(run.stage_ids, run.parts):
            first, last = stage == 0, stage == layout.n_stages - 1
            with comm:  # entered per stage: its module tracker follows one root module at a time
                kept = _stage_step(part, first, last, shape, dtype, mem, positions)
            activations += kept * run.in_flight(stage)
            extra += kept * (run.in_flight(stage) - 1)  # the microbatches in flight beside the one measured
            p2p += 2 * ((not first) + (not last))  # from the stage before, to the one after: activations, gradients
    count = p2p * layout.n_microbatches
    nbytes = count * shape[0] * shape[1] * dim * torch.empty((), dtype=dtype).element_size()
    notes = [f"pipeline: {layout.schedule}, {layout.n_stages} stages, this rank runs stage"
             f"{'s' if len(run.stage_ids) > 1 else ''} {', '.join(map(str, run.stage_ids))} "
             f"(blocks {', '.join(_blocks(layout.stages[s]) for s in run.stage_ids)}), "
             f"{layout.n_microbatches} microbatches of {shape[0]} rows; collectives: one microbatch per local stage, "
             "activations: as many microbatches as the schedule keeps in flight"]
    return {"activation_bytes": activations, "peak": mem.peak + extra, "p2p": (count, nbytes), "notes": notes}


def _blocks(ids: tuple[int, ...]) -> str:
    return f"layers.{ids[0]}-{ids[-1]}" if ids else "none"
