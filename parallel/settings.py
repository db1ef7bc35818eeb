"""Settings of the parallel layer that a job fills from its TOML: the parallelism degrees and
activation checkpointing (the planner's own are parallel/auto/config.py).

Each settings object checks its own fields (`check`); a bad value is one SettingError naming
the field, its value and the fix, which the trainer turns into a config error naming the file
and the section. Checks that read several sections stay in the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

AC_MODES = ("none", "full", "selective", "auto")
"""\"auto\": the planner chooses each block's recomputation in its solve (auto mode only)."""


class SettingError(ValueError):
    """One setting out of range: the field, its value and the fix."""

    def __init__(self, key: str, value: Any, fix: str) -> None:
        super().__init__(f"{key} = {value!r}: {fix}")
        self.key, self.value, self.fix = key, value, fix


@dataclass
class ParallelDegrees:
    """How many ranks each kind of parallelism takes (the hand-written recipes' mesh; in auto
    mode the mesh the planner places on). data_parallel_shard_degree -1: the rest of the world."""

    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    enable_sequence_parallel: bool = True
    # pipeline parallel (manual mode): the number of pipeline ranks, the outermost mesh axis ``pp``
    pipeline_parallel_degree: int = 1

    def resolved(self, world_size: int) -> dict[str, int]:
        """Degrees by mesh axis name, with ``data_parallel_shard_degree = -1`` filled in (no checks)."""
        others = self._others()
        shard = self.data_parallel_shard_degree
        if shard == -1:
            shard = max(1, world_size // max(1, others))
        return {"dp_replicate": self.data_parallel_replicate_degree, "dp_shard": shard,
                "cp": self.context_parallel_degree, "tp": self.tensor_parallel_degree,
                "ep": self.expert_parallel_degree, "pp": self.pipeline_parallel_degree}

    def _others(self) -> int:
        """The product of every degree but data_parallel_shard_degree (and EP, which reuses ranks)."""
        return (self.pipeline_parallel_degree * self.data_parallel_replicate_degree * self.tensor_parallel_degree
                * self.context_parallel_degree)

    def check(self, world_size: int) -> None:
        """Positive degrees multiplying to `world_size`; EP dividing the data x cp ranks."""
        for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "context_parallel_degree",
                    "expert_parallel_degree", "pipeline_parallel_degree"):
            if getattr(self, key) < 1:
                raise SettingError(key, getattr(self, key), "must be >= 1")
        shard = self.data_parallel_shard_degree
        if shard < 1 and shard != -1:
            raise SettingError("data_parallel_shard_degree", shard, "must be >= 1, or -1 for the rest of the world")
        others = self._others()
        pp = f"pipeline_parallel_degree={self.pipeline_parallel_degree} x " if self.pipeline_parallel_degree > 1 else ""
        desc = (f"{pp}data_parallel_replicate_degree={self.data_parallel_replicate_degree} x "
                f"data_parallel_shard_degree={shard} x tensor_parallel_degree={self.tensor_parallel_degree} x "
                f"context_parallel_degree={self.context_parallel_degree}")
        if shard == -1 and world_size % others:
            raise SettingError("data_parallel_shard_degree", shard,
                               f"cannot fill the world: {desc} does not divide the world size {world_size}; change "
                               "the degrees or the number of processes")
        if shard != -1 and others * shard != world_size:
            raise SettingError("data_parallel_shard_degree", shard,
                               f"the parallelism degrees multiply to {others * shard} ({desc}) but the world size is "
                               f"{world_size}; make the product equal the number of processes or set "
                               "data_parallel_shard_degree = -1")
        deg = self.resolved(world_size)
        if self.expert_parallel_degree > 1 and (deg["dp_shard"] * deg["cp"]) % self.expert_parallel_degree:
            raise SettingError("expert_parallel_degree", self.expert_parallel_degree,
                               "must divide data_parallel_shard_degree x context_parallel_degree "
                               f"= {deg['dp_shard'] * deg['cp']}")


@dataclass(frozen=True)
class PipelineSettings:
    """How a pipeline-parallel job (``pipeline_parallel_degree`` > 1, manual mode) runs: the
    schedule, the microbatch rows and the layer split (parallel/recipes/pp.py checks them
    against the model, the degree and the batch)."""

    # torch.distributed.pipelining's schedule: "GPipe" | "1F1B" (one stage per rank), "Interleaved1F1B" |
    # "LoopedBFS" | "InterleavedZeroBubble" (several stages per rank, looped), "ZBVZeroBubble" | "DualPipeV"
    # (two stages per rank, V-shaped); case-insensitive
    pipeline_parallel_schedule: str = "1F1B"
    # rows of the local batch in one pipeline microbatch (local_batch_size / this = microbatches a step)
    pipeline_parallel_microbatch_size: int = 1
    # transformer layers per pipeline stage, the embedding and the output head counting as one layer each
    # (stages = ceil((n_layers + 2) / this), balanced); unset: one stage per rank (two for the multi-stage
    # schedules), the layers balanced the same way
    pipeline_parallel_layers_per_stage: Optional[int] = None
    # or the stage boundaries as the first block of each stage but the first, e.g. ["layers.2", "layers.4"]
    # (len + 1 stages); [] : the balanced split
    pipeline_parallel_split_points: list = field(default_factory=list)

    def check(self) -> None:
        """Positive sizes; one way to split, FQNs of blocks."""
        if self.pipeline_parallel_microbatch_size < 1:
            raise SettingError("pipeline_parallel_microbatch_size", self.pipeline_parallel_microbatch_size,
                               "must be >= 1 (rows of the local batch in one microbatch)")
        per = self.pipeline_parallel_layers_per_stage
        if per is not None and per < 1:
            raise SettingError("pipeline_parallel_layers_per_stage", per, "must be >= 1, or unset for the default")
        points = self.pipeline_parallel_split_points
        if points and per is not None:
            raise SettingError("pipeline_parallel_split_points", points,
                               "set either pipeline_parallel_split_points or pipeline_parallel_layers_per_stage")
        for p in points:
            if not (isinstance(p, str) and p.startswith("layers.") and p[len("layers."):].isdigit()):
                raise SettingError("pipeline_parallel_split_points", points,
                                   f"{p!r} is not a block's name; write names like \"layers.4\"")


@dataclass
class ActivationCheckpoint:
    """Activation checkpointing: mode "none" | "full" | "selective" | "auto" (the planner
    chooses per block; auto mode only); selective_ac_option "op" (per-op SAC) or an integer N
    as a string (every N-th block). Unset (""): "auto" in auto mode, "none" in manual mode
    (`resolved`)."""

    mode: str = ""
    selective_ac_option: str = "op"

    def resolved(self, parallelism_mode: str) -> str:
        """The mode in effect: an unset mode is the parallelism mode's default."""
        if self.mode:
            return self.mode
        return "auto" if parallelism_mode == "auto" else "none"

    def check(self) -> None:
        if self.mode and self.mode not in AC_MODES:
            raise SettingError("mode", self.mode, f"must be one of {', '.join(map(repr, AC_MODES))}")
        opt = self.selective_ac_option
        if self.mode == "selective" and opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise SettingError("selective_ac_option", opt,
                               "must be 'op' or a positive integer N (every N-th block) as a string")
