"""The training loop: build model -> parallelize (recipe or auto) -> train.

    cfg = load_config("llama3_debug", ["--training.steps", "10"])
    Trainer(cfg).train()          # returns {step: loss} of the logged steps

Works with an initialised process group (torchrun) or without one (single process).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from models import cross_entropy_loss
from parallel.auto.regions import load_balanced_batch
from parallel.auto.runtime import CompileError, is_parallel_module
from parallel.mesh import CP, axis_size, build_mesh, dp_rank_and_degree
from parallel.precision import dtype_of
from parallel.recipes.cp import cp_shard_batch
from parallel.recipes.tp import loss_parallel_context, loss_value

from .auto import PlanSource
from .build import build_parallel_model, parallelize
from .checkpoint import CheckpointManager, resume_step
from .config import ConfigError, JobConfig
from .data import DataError, build_dataloader, build_tokenizer
from .device import local_device
from .mesh_auto import choose_mesh
from .metrics import MetricsLogger, setup_logging
from .optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, follow_parameters

logger = logging.getLogger("autotitan")


def _is_fsdp(model: torch.nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


class Trainer:
    """One training job: mesh, data, model (parallelized), optimizer, checkpoints, metrics."""

    def __init__(self, job_config: JobConfig, plan_constraints: Optional[Callable[[Any], None]] = None):
        self.plan_constraints = plan_constraints  # auto mode: applied to the planner (parallel.auto.presets)
        self.cfg = cfg = job_config
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        setup_logging(self.rank)
        self.run_dir = Path(cfg.job.dump_folder) / cfg.job.name
        self.device = local_device(cfg.job.device)
        if cfg.parallelism.mesh == "auto" and self.distributed:  # plan every mesh, build the best
            self.cfg = cfg = choose_mesh(cfg, self.world_size, self.device.type, self._vocab_size())
        self.mesh = build_mesh(cfg.parallelism, self.world_size, self.device.type) if self.distributed else None
        self.dp_rank, self.dp_degree = dp_rank_and_degree(self.mesh)
        self.cp_axis = self.mesh is not None and CP in (self.mesh.mesh_dim_names or ())
        # the step a resumed job starts from fixes the first sequence length (and its plan)
        self.resume_step = resume_step(cfg.checkpoint, self.run_dir / cfg.checkpoint.folder)
        self.seq_len = cfg.training.seq_len_at(self.resume_step)
        self.plans: dict[int, Any] = {}  # auto mode: seq_len -> the plan this job trains that length with
        self._build_data()
        self.model = self._build_model()
        t = cfg.training
        # mixed precision without FSDP (single rank): autocast
        self.autocast = (t.mixed_precision_param != "float32" and not _is_fsdp(self.model)
                         and t.dtype == "float32" and cfg.parallelism.mode == "manual")
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, self.run_dir / cfg.checkpoint.folder, model=self.model,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, dp_rank=self.dp_rank)
        self.step = 0
        self._step_times: list[float] = []
        self.flops_per_token = self._flops_per_token()
        self.compute_dtype = t.mixed_precision_param if t.dtype == "float32" else t.dtype
        self.metrics: Optional[MetricsLogger] = None

    # ------------------------------------------------------------------ building

    def _vocab_size(self) -> int:
        """The model's vocabulary: `model.vocab_size`, or the tokenizer's when it is -1."""
        if self.cfg.model.vocab_size > 0:
            return self.cfg.model.vocab_size
        try:
            return build_tokenizer(self.cfg.data.tokenizer).vocab_size
        except DataError as e:
            raise ConfigError(f"{self.cfg.source}: {e}") from None

    def _build_data(self) -> None:
        """Tokenizer and this data-parallel rank's loader, one per scheduled sequence length
        (all built now: text that cannot fill a batch of any of them is a config error before
        any work; every rank reads the same text, so all ranks raise it)."""
        cfg, t = self.cfg, self.cfg.training
        try:
            self.tokenizer = build_tokenizer(cfg.data.tokenizer)
            self.loaders = {seq: build_dataloader(
                cfg.data, seq_len=seq, local_batch_size=t.local_batch_size,
                dp_rank=self.dp_rank, dp_degree=self.dp_degree, seed=cfg.job.seed,
                tokenizer=self.tokenizer) for seq in dict.fromkeys([*t.seq_lens(), self.seq_len])}
        except DataError as e:
            key = "seq_len_schedule" if t.seq_len_schedule else "seq_len"
            raise ConfigError(f"{cfg.source}: 'training.{key}': {e}") from None
        self.dataloader = self.loaders[self.seq_len]

    def _build_model(self) -> torch.nn.Module:
        """The model, initialised from the job's seed and parallelized (recipe or plan): see
        trainer/build.py, which the dry run shares."""
        cfg = self.cfg
        vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else self.tokenizer.vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise ConfigError(f"{cfg.source}: 'model.vocab_size' = {vocab} is smaller than "
                              f"the tokenizer's vocabulary {self.tokenizer.vocab_size}; raise it or "
                              f"set -1 to take the tokenizer's")
        model = build_parallel_model(cfg, self.mesh, self.device, vocab, self._sample_batch(), self.plan_constraints,
                                     PlanSource(resuming=self.resume_step > 0))
        self.model_args = model.args
        self.num_params = sum(p.numel() for p in model.parameters())
        if is_parallel_module(model):
            self.plans[self.seq_len] = model.plan
        return model

    def _sample_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeros shaped like this rank's (tokens, labels) at the current sequence length."""
        b = self.cfg.training.local_batch_size
        return (torch.zeros(b, self.seq_len, dtype=torch.long), torch.zeros(b, self.seq_len, dtype=torch.long))

    def _flops_per_token(self) -> float:
        """Model FLOPs per token of a training step (6 x params when the model does not say)."""
        try:
            return float(self.model_args.flops_per_token(self.seq_len))
        except (AttributeError, TypeError):
            return 6.0 * self.num_params

    # ------------------------------------------------------------------ pieces

    def _shard_batch(self, inputs, labels):
        """Per-rank inputs, labels and positions (context parallel shards the sequence; in auto
        mode every cp rank gets the whole sequence in the load-balanced order and the plan
        decides where it is cut)."""
        if self.cp_axis and hasattr(self.model, "forward_backward"):
            return load_balanced_batch(inputs, labels, axis_size(self.mesh, CP))
        if self.cp_axis:
            return cp_shard_batch(inputs, labels, self.mesh, CP)
        return inputs, labels, None

    def reduce_mean(self, x: float) -> float:
        """The mean of a per-rank number over all ranks (the global loss of a step)."""
        if not self.distributed or self.world_size == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (local loss, total grad norm) as tensors."""
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        inputs, labels, positions = self._shard_batch(inputs, labels)
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(self.model, "forward_backward"):  # auto mode: the step as one graph
            loss = self.model.forward_backward(*((inputs, labels) if positions is None
                                                 else (inputs, labels, positions)))
        else:
            loss = self._forward_backward(inputs, labels, positions)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        self.lr_used = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        return loss.detach(), grad_norm

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor,
                          positions: Optional[torch.Tensor]) -> torch.Tensor:
        """Manual mode: the model's forward, the loss and autograd's backward."""
        ctx = (torch.autocast(self.device.type, dtype=dtype_of(self.cfg.training.mixed_precision_param))
               if self.autocast else contextlib.nullcontext())
        # TP with loss parallel: vocab-sharded logits; loss and backward inside the context
        with loss_parallel_context(self.model):
            with ctx:
                logits = self.model(inputs) if positions is None else self.model(inputs, positions)
                loss = cross_entropy_loss(logits, labels)
                del logits
            loss.backward()
        return loss_value(loss)

    # ------------------------------------------------------------------ loop

    def train(self) -> dict[int, float]:
        """Train from the resumed step to `training.steps`; {step: loss} of the logged steps."""
        if not self.start():
            return self.logged
        try:
            while self.step < self.cfg.training.steps:
                self.next_step()
        finally:
            self.metrics.close()
        self._log_runtime()
        return self.logged

    def start(self) -> bool:
        """Resume from the latest checkpoint, open the metrics, log the job; False when the
        job has nothing left to train (metrics closed)."""
        cfg, t = self.cfg, self.cfg.training
        self.step = self.checkpointer.maybe_load()
        self.metrics = MetricsLogger(
            cfg.metrics, self.run_dir, rank=self.rank, world_size=self.world_size,
            flops_per_token=self.flops_per_token, compute_dtype=self.compute_dtype,
            device=self.device, start_step=self.step)
        if self.rank == 0:
            sched = f" (schedule {t.seq_len_schedule})" if t.seq_len_schedule else ""
            logger.info(
                f"job {cfg.job.name}: {cfg.model.name}/{cfg.model.flavor} "
                f"({self.num_params / 1e6:.2f}M params), world {self.world_size}, mesh "
                f"{self._mesh_desc()}, global batch {t.local_batch_size * self.dp_degree} x "
                f"{self.seq_len} tokens{sched}, steps {self.step + 1}..{t.steps}, MFU peak from "
                f"{self.metrics.peak_note or 'n/a'}")
        self.logged: dict[int, float] = {}
        self._data_iter = None
        if self.step >= t.steps:
            if self.rank == 0:
                logger.info(f"already at step {self.step} of training.steps = {t.steps} (resumed "
                            f"from {self.checkpointer.folder}): nothing to train. Raise "
                            f"--training.steps, or start fresh with another --job.name or "
                            f"--job.dump_folder")
            self.metrics.close()
            return False
        self.metrics.reset_timer()
        return True

    def next_step(self) -> torch.Tensor:
        """One training step (after `start`): the scheduled sequence length first (re-planning
        in auto mode when it changes), then data, step, metrics, checkpoint. The local loss."""
        seq = self.cfg.training.seq_len_at(self.step)  # self.step steps are done: this is 0-based step `step`
        if seq != self.seq_len:
            self.change_seq_len(seq)
        if self._data_iter is None:
            self._data_iter = iter(self.dataloader)
        self.step += 1
        inputs, labels = next(self._data_iter)
        t0 = time.perf_counter()
        loss, grad_norm = self._checked_step(inputs, labels)
        self._step_times.append(time.perf_counter() - t0)
        self._maybe_log_prediction()
        self.metrics.add_tokens(inputs.numel() * self.dp_degree)
        if self.metrics.should_log(self.step, self.cfg.training.steps):
            loss_v = self.reduce_mean(loss.item())
            self.metrics.log(self.step, loss_v, grad_norm.item(), self.lr_used)
            self.logged[self.step] = loss_v
        if self.checkpointer.should_save(self.step, self.cfg.training.steps):
            self.checkpointer.save(self.step)
            self.metrics.reset_timer()
        return loss

    def change_seq_len(self, seq: int) -> None:
        """Train at `seq` from now on, without a restart: the loader of that length continues
        at the same (epoch, batch) position; in auto mode the model is re-planned for the new
        shape (the plan this job made for it before, else a fresh solve or a replay, as
        `parallelism.replan` says) and parameters and AdamW state are redistributed in memory
        to the new placements. LR schedule and step count are untouched."""
        old, state = self.seq_len, self.dataloader.state_dict()
        self.seq_len = seq
        self.dataloader = self.loaders[seq]
        self.dataloader.load_state_dict(state)
        self.checkpointer.dataloader = self.dataloader
        self._data_iter = None
        self.flops_per_token = self._flops_per_token()
        if self.metrics is not None:
            self.metrics.flops_per_token = self.flops_per_token
        how = "same model (manual mode: the recipes do not depend on the sequence length)"
        if is_parallel_module(self.model):
            plan_s, move_s = self._replan()
            how = (f"{self.model.plan_origin}; planned and applied in {plan_s:.1f}s, parameters and optimizer "
                   f"state moved in {move_s:.2f}s")
        if self.rank == 0:
            logger.info(f"step {self.step + 1}: sequence length {old} -> {seq}: {how}")

    def _replan(self) -> tuple[float, float]:
        """Auto mode: the ParallelModule for the current sequence length, state moved into it;
        (seconds planning and applying, seconds moving the state)."""
        cfg, t0 = self.cfg, time.perf_counter()
        cached = self.plans.get(self.seq_len)
        replay = self.model.plan if cached is None and cfg.parallelism.replan == "replay" else None
        template = self.model.meta_template
        new = parallelize(template, self.mesh, cfg, self._sample_batch(), self.plan_constraints,
                          PlanSource(cached=cached, replay=replay))
        t1 = time.perf_counter()
        moved = new.take_state_from(self.model)
        follow_parameters(self.optimizer, moved)
        new.train(self.model.training)
        self.model = self.checkpointer.model = new
        self.plans[self.seq_len] = new.plan
        self._step_times = []
        return t1 - t0, time.perf_counter() - t1

    def _maybe_log_prediction(self, warmup: int = 2, timed: int = 5) -> None:
        """Auto mode, once: the measured step time (median after the warm-up) next to the
        cost model's prediction for the same step, so a user sees when the model is off."""
        last = min(warmup + timed, self.cfg.training.steps - self.step + len(self._step_times))
        if len(self._step_times) != last or not hasattr(self.model, "predict_step"):
            return
        times = self._step_times[warmup:] or self._step_times[-1:]
        measured = self.reduce_mean(statistics.median(times))
        if self.rank == 0:
            pred = self.model.predict_step()
            hw = self.model.plan_cost_model.hw.name
            logger.info(f"step time: measured {measured * 1e3:,.1f} ms (median of {len(times)} steps after the "
                        f"warm-up), predicted {pred.step_us / 1e3:,.1f} ms by the cost model ({hw}; "
                        f"{pred.summary()}); measured / predicted = {measured * 1e6 / pred.step_us:.2f}")

    def _log_runtime(self) -> None:
        """Auto mode: how the plan ran (one graph per step, deviations from the plan)."""
        runner = getattr(self.model, "plan_runner", None)
        if runner is not None and self.rank == 0:
            st = runner.stats
            logger.info(f"runtime: {st['step_graph_steps']} steps as one step graph per rank, "
                        f"{st['deviations']} deviations from the plan")

    def _checked_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A training step; Inductor's failure to compile is the job's error (key and fix)."""
        try:
            return self.train_step(inputs, labels)
        except CompileError as e:
            raise ConfigError(f"{self.cfg.source}: 'training.compile' = true: {e}") from None

    def _mesh_desc(self) -> str:
        if self.mesh is None:
            return "none (single process)"
        return " x ".join(f"{n}={s}" for n, s in zip(self.mesh.mesh_dim_names, self.mesh.shape))
