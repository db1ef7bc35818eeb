"""What the trainer needs from a parallelism mode, and the two modes that provide it.

    parallelizer = parallelism_mode(cfg, mesh, device, plan_constraints)   # the mode, chosen once
    model = parallelizer.parallelize(model, sample_batch)
    inputs, labels, positions = parallelizer.shard_batch(inputs, labels)
    loss = parallelizer.forward_backward(model, inputs, labels, positions)
    loss = parallelizer.accumulate(model, [(inputs, labels, positions), ...])   # gradient accumulation

`ManualMode` is `[parallelism] mode = "manual"`: the hand-written recipes (FSDP, HSDP, TP,
CP, EP), autograd's backward, autocast without FSDP. `AutoMode` is `mode = "auto"`: the plan
of parallel/auto (trainer/auto_mode.py), one step graph per step, re-planned when the sequence
length changes, its prediction (`predict`) set beside the measured step (trainer/measured.py). The trainer asks
the mode, never the model, what to do.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from models import cross_entropy_loss
from parallel import _torch as T
from parallel.auto.cost.correction import BAND, correctable, record_correction, run_delay_s
from parallel.auto.plan.pipeline import PipelinePlan
from parallel.auto.regions import load_balanced_batch
from parallel.auto.runtime import is_parallel_module
from parallel.mesh import CP, PP, axis_size, flatten_axes
from parallel.precision import dtype_of
from parallel.recipes import Pipeline, RecipeError, apply_compile, apply_pipeline, apply_recipe
from parallel.recipes.cp import cp_shard_batch
from parallel.recipes.ddp import ddp_reducer
from parallel.recipes.tp import loss_parallel_context, loss_value

from .auto_mode import PlanSource, auto_parallelize_for_training, planner_errors
from .auto_pipeline import STAGE_RANKS, auto_pipeline, gradient_scale, pipeline_forecast, save_pipeline_plan
from .config import ConfigError, JobConfig
from .measured import StepForecast, repeated
from .moe_balance import LOCAL

Batch = tuple[torch.Tensor, torch.Tensor]
logger = logging.getLogger("autotitan")


def stage_ranks(mesh: DeviceMesh) -> Any:
    """A pipeline's ranks that hold this rank's stages: its mesh without the pp axis, flattened."""
    others = [a for a in mesh.mesh_dim_names if a != PP]
    return flatten_axes(mesh, others, STAGE_RANKS).get_group() if others else LOCAL


class ParallelismMode:
    """One parallelism mode of a job on a mesh (None: a single process)."""

    def __init__(self, cfg: JobConfig, mesh: Optional[DeviceMesh]) -> None:
        self.cfg, self.mesh = cfg, mesh
        self.cp_axis = mesh is not None and CP in (mesh.mesh_dim_names or ())
        self.pp_group: Optional[dist.ProcessGroup] = None  # pipeline parallel: the gradient norm sums over it
        self.stage_ranks: Any = None  # the ranks holding this rank's layers (None: all; moe_balance.LOCAL: itself)

    def parallelize(self, model: torch.nn.Module, sample_batch: Batch,
                    source: Optional[PlanSource] = None) -> torch.nn.Module:
        """The parallel model (from the meta model; `sample_batch`: this rank's batch shape)."""
        raise NotImplementedError

    def shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple:
        """This rank's (inputs, labels, positions or None) of its data-parallel batch."""
        raise NotImplementedError

    def forward_backward(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                         positions: Optional[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """Forward, loss, backward of one (micro-)batch, the gradients of `scale` x the loss added
        to the parameters'; the local loss (unscaled)."""
        raise NotImplementedError

    def accumulate(self, model: torch.nn.Module, micro: list[tuple]) -> torch.Tensor:
        """One optimizer step's forward and backward over its micro-batches ((inputs, labels,
        positions) each, equal sizes): each backward scaled by 1 / their number, so the summed
        gradient is that of the mean loss over the global batch; all but the last run without
        gradient reductions (`no_gradient_sync`). The local loss: the mean over the micro-batches."""
        n = len(micro)
        if n == 1:
            return self.forward_backward(model, *micro[0])
        losses = []
        for i, (inputs, labels, positions) in enumerate(micro):
            with self.no_gradient_sync(model) if i < n - 1 else contextlib.nullcontext():
                losses.append(self.forward_backward(model, inputs, labels, positions, scale=1.0 / n).detach())
        return torch.stack(losses).mean()

    def no_gradient_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A micro-batch before the last: gradients accumulate unreduced where the mode can
        defer its reduction (default: it cannot; every micro-batch reduces, which is correct,
        only more communication)."""
        return contextlib.nullcontext()

    def forward_loss(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                     positions: Optional[torch.Tensor]) -> torch.Tensor:
        """Forward and loss only (validation, under no_grad): this rank's loss, as `forward_backward`'s."""
        raise NotImplementedError

    def for_seq_len(self, model: torch.nn.Module, sample_batch: Batch) -> tuple[torch.nn.Module, Any, str]:
        """The model for a new sequence length (`sample_batch`'s): (model, the parameters moved
        into it, or None when it is the same model, how it was made)."""
        return model, None, "same model (manual mode: the recipes do not depend on the sequence length)"

    def predict(self, model: torch.nn.Module, micro_batches: int = 1) -> Optional[StepForecast]:
        """The mode's prediction of one step of `micro_batches` forward/backward passes, to set
        beside the measured one (None: the mode predicts nothing)."""
        return None

    def correct_prediction(self, model: torch.nn.Module, measured_us: float, forecast: Optional[StepForecast],
                           micro_batches: int = 1) -> str:
        """What the mode learns from the measured step (auto mode: the cached profile's
        correction), as words for the log line ("": nothing)."""
        return ""

    def run_report(self, model: torch.nn.Module) -> Optional[str]:
        """How the job's steps ran, at its end (None: nothing to say)."""
        return None


class ManualMode(ParallelismMode):
    """`mode = "manual"`: the hand-written recipes of parallel/recipes."""

    def __init__(self, cfg: JobConfig, mesh: Optional[DeviceMesh], device: torch.device) -> None:
        super().__init__(cfg, mesh)
        self.device = device
        self.autocast = False
        self.pipeline: Optional[Pipeline] = None  # pipeline_parallel_degree > 1: this rank's stages and schedule

    def parallelize(self, model: torch.nn.Module, sample_batch: Batch,
                    source: Optional[PlanSource] = None) -> torch.nn.Module:
        t = self.cfg.training
        if t.compile and t.compile_fallback:
            T.compile_errors_fall_back(True)  # the per-block torch.compile falls back to eager
        if self.mesh is None:
            model = apply_compile(model) if t.compile else model
        else:
            try:
                if axis_size(self.mesh, PP) > 1:  # the stages, each parallelized by the recipes; the rank's model
                    self.pipeline = apply_pipeline(model, self.mesh, self.cfg, self.device, cross_entropy_loss)
                    model, self.pp_group = self.pipeline.model, self.pipeline.group
                    self.stage_ranks = stage_ranks(self.mesh)
                    if dist.get_rank() == 0:
                        logger.info(self.pipeline.describe())
                else:
                    model = apply_recipe(model, self.mesh, self.cfg)
            except RecipeError as e:
                raise ConfigError(f"{self.cfg.source}: {e}") from None
        # mixed precision without FSDP (a single rank): autocast
        fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
        self.autocast = t.mixed_precision_param != "float32" and not fsdp and t.dtype == "float32"
        return model

    def for_seq_len(self, model: torch.nn.Module, sample_batch: Batch) -> tuple[torch.nn.Module, Any, str]:
        if self.pipeline is None:
            return super().for_seq_len(model, sample_batch)
        self.pipeline.rebuild()  # the stages' shapes are inferred at their first step: again, at the new length
        return model, None, "same model; the pipeline's stages and schedule built again for the new shapes"


    def shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple:
        if self.cp_axis:  # context parallel: each cp rank keeps its load-balanced chunks
            return cp_shard_batch(inputs, labels, self.mesh, CP)
        return inputs, labels, None

    def forward_backward(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                         positions: Optional[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        ctx = (torch.autocast(self.device.type, dtype=dtype_of(self.cfg.training.mixed_precision_param))
               if self.autocast else contextlib.nullcontext())
        if self.pipeline is not None:  # the schedule runs the microbatches' forward and backward
            with ctx:
                return self.pipeline.step(inputs, labels, scale, positions)
        # TP with loss parallel: vocab-sharded logits; loss and backward inside the context
        with loss_parallel_context(model):
            with ctx:
                logits = model(inputs) if positions is None else model(inputs, positions)
                loss = cross_entropy_loss(logits, labels)
                del logits
            (loss if scale == 1.0 else loss * scale).backward()
        return loss_value(loss)

    @contextlib.contextmanager
    def no_gradient_sync(self, model: torch.nn.Module):
        """FSDP2 / HSDP: `set_requires_gradient_sync(False)` on every fully_shard module (no
        reduce-scatter or all-reduce; the unsharded gradients accumulate until the last
        micro-batch); DDP: its `no_sync()`, once its reducer exists (built at the first forward:
        before it, the first micro-batch reduces, which is correct)."""
        if self.pipeline is not None:  # each schedule step reduces its gradients (PipelineStage's last backward)
            yield
            return
        fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
        ddp = None if fsdp else ddp_reducer(model)
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
                yield
        finally:
            for m in fsdp:
                m.set_requires_gradient_sync(True, recurse=False)

    def forward_loss(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                     positions: Optional[torch.Tensor]) -> torch.Tensor:
        ctx = (torch.autocast(self.device.type, dtype=dtype_of(self.cfg.training.mixed_precision_param))
               if self.autocast else contextlib.nullcontext())
        if self.pipeline is not None:
            with ctx:
                return self.pipeline.eval_loss(inputs, labels, positions)
        with loss_parallel_context(model), ctx:
            logits = model(inputs) if positions is None else model(inputs, positions)
            return loss_value(cross_entropy_loss(logits, labels))


class AutoMode(ParallelismMode):
    """`mode = "auto"`: the planner's plan, run as one step graph per step."""

    def __init__(self, cfg: JobConfig, mesh: Optional[DeviceMesh], device: torch.device,
                 plan_constraints: Optional[Callable[[Any], None]] = None) -> None:
        super().__init__(cfg, mesh)
        self.plan_constraints = plan_constraints  # applied to the planner (parallel.auto.search.presets)
        self.plans: dict[int, Any] = {}  # seq_len -> the plan this job trains that length with
        self.origin = ""  # where the current plan came from (solved, replayed, cached, a plan file)
        self.delays: list[float] = []  # run_delay_s() at the first steps' starts (for the step time report)
        self.device = device
        self.pipeline: Optional[Pipeline] = None  # pipeline_parallel_degree > 1: the planned stages and schedule
        self.pipeline_plan: Optional[PipelinePlan] = None  # their plan (global rank 0)

    def parallelize(self, model: torch.nn.Module, sample_batch: Batch,
                    source: Optional[PlanSource] = None) -> torch.nn.Module:
        if axis_size(self.mesh, PP) > 1:  # each stage planned on the mesh without pp (trainer/auto_pipeline.py)
            return self._pipeline(model)
        model, self.origin = auto_parallelize_for_training(model, self.mesh, self.cfg, sample_batch,
                                                           self.plan_constraints, source=source)
        if is_parallel_module(model):
            self.plans[sample_batch[0].shape[1]] = model.plan
        return model

    def _pipeline(self, model: torch.nn.Module) -> torch.nn.Module:
        """This rank's planned stages under the job's schedule; the rank's model (their union)."""
        try:
            with planner_errors(self.cfg):
                self.pipeline, plan = auto_pipeline(model, self.mesh, self.cfg, self.device)
        except RecipeError as e:
            raise ConfigError(f"{self.cfg.source}: {e}") from None
        self.pp_group, self.stage_ranks = self.pipeline.group, stage_ranks(self.mesh)
        plan_file = self.cfg.parallelism.plan_file
        self.origin = f"loaded from {plan_file}" if plan_file else "each stage solved on the mesh without its pp axis"
        self.pipeline_plan = plan
        if dist.get_rank() == 0:
            if self.cfg.training.compile:
                logger.warning("training.compile = true: a pipeline's planned stages run their plans' per-device "
                               "graphs eagerly under the schedule (not compiled, not one step graph)")
            logger.info("auto-parallel pipeline plan:\n%s", plan.summary())
            save_pipeline_plan(plan, Path(self.cfg.job.dump_folder) / self.cfg.job.name)
        return self.pipeline.model

    def shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple:
        if self.cp_axis:  # every cp rank takes the whole sequence in the load-balanced order: the plan cuts it
            return load_balanced_batch(inputs, labels, axis_size(self.mesh, CP))
        return inputs, labels, None

    def forward_backward(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                         positions: Optional[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        """The plan's step graph once: with micro-batches (`accumulate`) once per micro-batch, its
        gradients scaled and summed unreduced, reduced to their planned placements once, by
        the last micro-batch (`no_gradient_sync`)."""
        if self.pipeline is not None:  # the schedule runs the planned stages over the microbatches
            return self.pipeline.step(inputs, labels, scale * gradient_scale(self.mesh), positions)
        if not is_parallel_module(model):  # a single process: nothing was planned
            loss = cross_entropy_loss(model(inputs), labels)
            (loss if scale == 1.0 else loss * scale).backward()
            return loss
        if len(self.delays) < 64:
            self.delays.append(run_delay_s())
        args = (inputs, labels) if positions is None else (inputs, labels, positions)
        return model.forward_backward(*args, grad_scale=scale)

    def no_gradient_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The plan's step graph without its gradient reductions: the micro-batches' unreduced
        gradients are summed and the last micro-batch reduces them once (ParallelModule)."""
        if not is_parallel_module(model):
            return contextlib.nullcontext()
        return model.no_gradient_sync()

    def forward_loss(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                     positions: Optional[torch.Tensor]) -> torch.Tensor:
        """The plan's forward phase alone (the module's forward: the planned placements, the
        DTensor parameters as they are); no backward, no optimizer."""
        if self.pipeline is not None:
            return self.pipeline.eval_loss(inputs, labels, positions)
        if not is_parallel_module(model):
            return cross_entropy_loss(model(inputs), labels)
        out = model(*((inputs, labels) if positions is None else (inputs, labels, positions)))
        return out[0] if isinstance(out, (tuple, list)) else out

    def for_seq_len(self, model: torch.nn.Module, sample_batch: Batch) -> tuple[torch.nn.Module, Any, str]:
        """The plan this job made for the new length before, else a fresh solve or a replay of
        the current plan (`parallelism.replan`); the parameters move into the new module."""
        if self.pipeline is not None:
            raise ConfigError(f"{self.cfg.source}: 'parallelism.pipeline_parallel_degree' = "
                              f"{axis_size(self.mesh, PP)}: auto mode plans a pipeline's stages for one sequence "
                              "length; keep training.seq_len fixed, or use mode = \"manual\" (the pp recipe)")
        if not is_parallel_module(model):
            return super().for_seq_len(model, sample_batch)
        cached = self.plans.get(sample_batch[0].shape[1])
        replay = model.plan if cached is None and self.cfg.parallelism.replan == "replay" else None
        new = self.parallelize(model.meta_template, sample_batch, PlanSource(cached=cached, replay=replay))
        moved = new.take_state_from(model)
        new.train(model.training)
        return new, moved, self.origin

    def predict(self, model: torch.nn.Module, micro_batches: int = 1) -> Optional[StepForecast]:
        """The cost model's step (its simulation of the step graph, `micro_batches` times) and
        the plan's memory estimate; the plan, so that its page shows the measured step too."""
        if self.pipeline_plan is not None:
            return pipeline_forecast(self.pipeline_plan, micro_batches)
        if not is_parallel_module(model):
            return None
        pred, n = model.predict_step(), micro_batches
        per = (f"{n} micro-batches x {pred.step_us / 1e3:,.1f} ms of the step graph without gradient "
               "reductions (the step's one reduction is not priced); " if n > 1 else "")
        memory = model.plan.memory
        return StepForecast(step_us=pred.step_us * n, compute_us=pred.compute_us * n, comm_us=pred.comm_us * n,
                            peak_bytes=memory.peak_bytes if memory is not None else None,
                            words=f"{model.plan_cost_model.hw.name}; {per}{pred.summary()}", plan=model.plan,
                            timeline=repeated(pred.timeline, n))

    def correct_prediction(self, model: torch.nn.Module, measured_us: float, forecast: Optional[StepForecast],
                           micro_batches: int = 1) -> str:
        """After the warm-up, on every rank: a prediction off by more than 25 % corrects the
        cached profile (`record_correction`); words for the log line when the ranks waited for
        cores other work held (the prediction already counts the host's load as the job
        started: cost/contention.py)."""
        if forecast is None or micro_batches != 1 or not is_parallel_module(model):
            return ""
        waited = self.waited_s() * 1e6
        self.record_correction(model, measured_us, forecast.step_us, waited)
        if waited <= 0.05 * measured_us:
            return ""
        return f"; its ranks waited {waited / 1e3:,.1f} ms a step for cores other work held"

    def waited_s(self, warmup: int = 2) -> float:
        """Median seconds a step after the warm-up waited for a core other work held, the most
        of any rank (a rank waiting for a core holds the others at the next collective)."""
        d = self.delays + [run_delay_s()]
        steps = [b - a for a, b in zip(d, d[1:])][warmup:] or [0.0]
        t = torch.tensor([sorted(steps)[len(steps) // 2]], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def record_correction(self, model: torch.nn.Module, measured_us: float, predicted_us: float,
                          waited_us: float) -> None:
        """`hardware = "auto"`: a prediction off by more than 25 % after the warm-up goes into the
        cached profile (cost/correction.py), so the next plan on this machine is priced with
        the measured ratio. The prediction counts the host's other work as the job started
        (the profile's `contention`), so the ratio is the cost model's error, not the load's.
        One line in the log (rank 0)."""
        hw = model.plan_cost_model.hw
        if correctable(hw) is None or dist.get_rank() != 0 or BAND[0] <= measured_us / predicted_us <= BAND[1]:
            return
        line = record_correction(hw, measured_us, predicted_us, {
            "job": self.cfg.job.name, "config": str(self.cfg.source), "world_size": dist.get_world_size(),
            "host_contention": getattr(hw, "contention", 1.0), "waited_for_cores_ms": waited_us / 1e3})
        if line is not None:
            logger.info(line)

    def run_report(self, model: torch.nn.Module) -> Optional[str]:
        if not is_parallel_module(model):
            return None
        st = model.plan_runner.stats
        return (f"runtime: {st['step_graph_steps']} steps as one step graph per rank, "
                f"{st['deviations']} deviations from the plan")


def parallelism_mode(cfg: JobConfig, mesh: Optional[DeviceMesh], device: torch.device,
                     plan_constraints: Optional[Callable[[Any], None]] = None) -> ParallelismMode:
    """The job's parallelism mode (`[parallelism] mode`): the one place it is asked."""
    if cfg.parallelism.mode == "auto":
        return AutoMode(cfg, mesh, device, plan_constraints)
    return ManualMode(cfg, mesh, device)


__all__ = ["ParallelismMode", "AutoMode", "ManualMode", "parallelism_mode"]
