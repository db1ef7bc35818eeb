"""The training loop: build model -> parallelize (the job's mode) -> train.

    cfg = load_config("llama3_debug", ["--training.steps", "10"])
    Trainer(cfg).train()          # returns {step: loss} of the logged steps

Works with an initialised process group (torchrun) or without one (single process). The
parallelism mode (trainer/parallelizer.py: recipes or the planner) is chosen once; the loop
asks it to shard a batch, run a step, follow a sequence-length change and report. A job
with `[parallelism] mesh = "auto"` has its mesh chosen before (trainer/mesh_auto.py, which
train.py runs): the Trainer builds the mesh it is given.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.auto.cost.timeline import MeasuredStep
from parallel.auto.runtime import CompileError
from parallel.measure import phase
from parallel.mesh import build_mesh, dp_rank_and_degree

from .auto_mode import PlanSource
from .build import build_parallel_model
from .checkpoint import CheckpointManager, complete_checkpoints, resume_step
from .config import ConfigError, JobConfig
from .config_checks import check_writable
from .data import DataError, build_dataloader, load_tokens, tokenizer_for
from .device import local_device, peak_memory_bytes, reset_peak_memory
from .errors import TrainingFault
from .hf_checkpoint import export_hf_config, load_initial, save_hf
from .measured import (
    PEAK_SCALARS,
    SPLIT_SCALARS,
    CpuPeakProbe,
    StepForecast,
    describe,
    save_measured_page,
    step_scalars,
)
from .metrics import MetricsLogger, setup_logging
from .moe_balance import balance_experts, prepare_moe_step
from .optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, follow_parameters
from .parallelizer import parallelism_mode
from .profiling import StepProfiler, check_profiling
from .run_folder import RunFolderLock
from .step_guard import StepGuard
from .validation import Validator, held_tokens, holdout, validation_tokens

TIMEOUT_WORDS = ("timed out", "timeout")
WARMUP_STEPS, TIMED_STEPS = 2, 5
"""Steps before the measured ones (compilation, allocator growth), and the steps whose median is measured."""


def _timed_out(e: BaseException) -> bool:
    """A collective that waited past the process group's timeout (gloo's and NCCL's words)."""
    return any(w in str(e).lower() for w in TIMEOUT_WORDS)

logger = logging.getLogger("autotitan")


class Trainer:
    """One training job: mesh, data, model (parallelized), optimizer, checkpoints, metrics."""

    def __init__(self, job_config: JobConfig, plan_constraints: Optional[Callable[[Any], None]] = None):
        self.cfg = cfg = job_config
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        setup_logging(self.rank)
        self.run_dir = Path(cfg.job.dump_folder) / cfg.job.name
        check_writable(cfg.source, "job.dump_folder", cfg.job.dump_folder, self.run_dir, self.rank)
        self.lock = RunFolderLock(self.run_dir, self.rank)  # one job at a time in a run folder
        self.lock.acquire()
        weakref.finalize(self, self.lock.release)  # a trainer dropped without train() lets the folder go
        try:
            self._build_job(plan_constraints)
        except BaseException:
            self.lock.release()
            raise

    def _build_job(self, plan_constraints: Optional[Callable[[Any], None]]) -> None:
        """Mesh, parallelism mode, data, model, optimizer and checkpoints (the run folder locked)."""
        cfg = self.cfg
        check_profiling(cfg)
        self.device = local_device(cfg.job.device)
        if cfg.parallelism.mesh == "auto" and self.distributed:
            raise ConfigError(f"{cfg.source}: 'parallelism.mesh' = 'auto': the mesh is chosen before the Trainer is "
                              "built: call trainer.mesh_auto.choose_mesh(cfg, ...) first (train.py does)")
        self.mesh = (build_mesh(cfg.parallelism.degrees, self.world_size, self.device.type,
                                expert_axis=cfg.parallelism.mode == "auto") if self.distributed else None)
        self.dp_rank, self.dp_degree = dp_rank_and_degree(self.mesh)
        # gradient accumulation: the global batch is the job, micro-batches of the local batch make it up
        self.global_batch = cfg.training.global_batch(self.dp_degree)
        self.micro_batches = cfg.training.micro_batches(self.dp_degree)
        # the parallelism mode, chosen once: recipes or the planner (plan_constraints: the planner's presets)
        self.parallelizer = parallelism_mode(cfg, self.mesh, self.device, plan_constraints)
        # the step a resumed job starts from fixes the first sequence length (and its plan)
        self.resume_step = resume_step(cfg.checkpoint, self.run_dir / cfg.checkpoint.folder)
        self.seq_len = cfg.training.seq_len_at(self.resume_step)
        self._build_data()
        self.model = self._build_model()
        t = cfg.training
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, self.run_dir / cfg.checkpoint.folder, model=self.model,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, dp_rank=self.dp_rank, timeout_s=cfg.comm.timeout_s)
        self.step = 0
        self.guard = StepGuard(t.skip_nonfinite_steps, self.rank, self.device)
        self._step_times: list[float] = []
        self.measured_step: Optional[MeasuredStep] = None  # after the warm-up (_maybe_log_prediction)
        self.forecast: Optional[StepForecast] = None
        self._splits: list[tuple[int, float, float]] = []  # profiled steps' splits before it is measured
        self._peak_probe = CpuPeakProbe()  # a CPU run's allocator peak, one step after the timed ones
        self.flops_per_token = self._flops_per_token()
        self.compute_dtype = t.mixed_precision_param if t.dtype == "float32" else t.dtype
        self.metrics: Optional[MetricsLogger] = None

    # ------------------------------------------------------------------ building

    def _build_data(self) -> None:
        """Tokenizer and this data-parallel rank's loader, one per scheduled sequence length
        (all built now: text that cannot fill a batch of any of them is a config error before
        any work; every rank reads the same text, so all ranks raise it)."""
        cfg, t = self.cfg, self.cfg.training
        try:
            self.tokenizer = tokenizer_for(cfg)
            # read and packed once for every length (a streamed corpus is read by each loader as it goes)
            tokens = None if cfg.data.streaming else load_tokens(cfg.data, self.tokenizer)
            self._held: Optional[torch.Tensor] = None
            if tokens is not None:  # [validation] without its own data: the stream's tail is held back
                tokens, self._held = holdout(tokens, held_tokens(cfg, self.dp_degree))
            self.loaders = {seq: build_dataloader(
                cfg.data, seq_len=seq, local_batch_size=t.local_batch_size,
                dp_rank=self.dp_rank, dp_degree=self.dp_degree, seed=cfg.job.seed,
                tokenizer=self.tokenizer, tokens=tokens, micro_batches=self.micro_batches)
                for seq in dict.fromkeys([*t.seq_lens(), self.seq_len])}
        except DataError as e:
            key = e.key or ("training.seq_len_schedule" if t.seq_len_schedule else "training.seq_len")
            value = f" = {cfg.data.path!r}" if key == "data.path" else ""
            raise ConfigError(f"{cfg.source}: '{key}'{value}: {e}") from None
        self.dataloader = self.loaders[self.seq_len]
        self.validator = self._build_validator()

    def _build_validator(self) -> Optional[Validator]:
        """`[validation]`: its own data (`validation.data`) or the held-back tail of the training stream."""
        v = self.cfg.validation
        if not v.enable:
            return None
        key = "validation.data" if v.data else "validation.steps"
        try:
            if v.data:
                tokens, source = validation_tokens(self.cfg, self.tokenizer), f"validation.data = {v.data!r}"
            else:
                tokens = self._held
                source = f"the last {len(tokens) - 1} tokens of the training data, held back from training"
            return Validator(self.cfg, tokens, dp_rank=self.dp_rank, dp_degree=self.dp_degree,
                             device=self.device, source=source)
        except DataError as e:
            msg = str(e).replace("[data] path", "validation.data")  # the reader's words name its own key
            raise ConfigError(f"{self.cfg.source}: '{key}' = {getattr(v, key.split('.')[1])!r}: {msg}") from None

    def validate(self) -> tuple[float, float, int]:
        """`[validation]` now: forward only on the current weights; logged (console, TensorBoard)."""
        self.guard.at(self.step, "the validation")
        loss, ppl, tokens = self.validator.run(self.model, self.parallelizer, self.seq_len)
        self.metrics.log_validation(self.step, loss, ppl, tokens)
        self.metrics.reset_timer()
        return loss, ppl, tokens

    def _build_model(self) -> torch.nn.Module:
        """The model, initialised from the job's seed and parallelized (recipe or plan): see
        trainer/build.py, which the dry run shares."""
        cfg = self.cfg
        vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else self.tokenizer.vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise ConfigError(f"{cfg.source}: 'model.vocab_size' = {vocab} is smaller than "
                              f"the tokenizer's vocabulary {self.tokenizer.vocab_size} ('model.tokenizer_path' = "
                              f"{cfg.model.tokenizer_path!r}); raise it or set -1 to take the tokenizer's")
        model = build_parallel_model(cfg, self.parallelizer, self.device, vocab, self._sample_batch(),
                                     PlanSource(resuming=self.resume_step > 0))
        self.model_args = model.args
        self.num_params = sum(p.numel() for p in model.parameters())
        if self.parallelizer.pp_group is not None:  # pipeline stages: each pp rank holds some of the layers
            n = torch.tensor([self.num_params], dtype=torch.int64, device=self.device)
            dist.all_reduce(n, group=self.parallelizer.pp_group)
            self.num_params = int(n.item())
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

    def reduce_mean(self, x: float) -> float:
        """The mean of a per-rank number over all ranks (the global loss of a step)."""
        if not self.distributed or self.world_size == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's part of the global batch (its micro-batches of
        `local_batch_size` rows, stacked); returns (local loss: the mean over the micro-batches,
        total grad norm) as tensors."""
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        b = self.cfg.training.local_batch_size
        micro = [self.parallelizer.shard_batch(x, y) for x, y in zip(inputs.split(b), labels.split(b))]
        self.optimizer.zero_grad(set_to_none=True)
        prepare_moe_step(self.model, len(micro))
        with phase("forward_backward"):  # named ranges: parallel.measure.AllocatorPeak locates its peak
            loss = self.parallelizer.accumulate(self.model, micro)
        self.guard.at(self.step, "the gradient norm")
        with phase("clip"):
            grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm,
                                        pp_group=self.parallelizer.pp_group)
        self.lr_used = self.optimizer.param_groups[0]["lr"]
        self.guard.at(self.step, "the step's agreement (finite values, stop requests)")
        if self.guard.check(self.step, loss, grad_norm, self.model):  # every rank agrees: finite
            self.guard.at(self.step, "the optimizer step")
            with phase("optimizer"):
                self.optimizer.step()
            self.lr_scheduler.step()
            self.guard.at(self.step, "the expert-bias update (token counts summed over the ranks)")
            balance_experts(self.model, ranks=self.parallelizer.stage_ranks)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            balance_experts(self.model, stepped=False, ranks=self.parallelizer.stage_ranks)
        return loss.detach(), grad_norm

    # ------------------------------------------------------------------ loop

    def train(self) -> dict[int, float]:
        """Train from the resumed step to `training.steps` (or a SIGTERM: the step is finished
        and saved); {step: loss} of the logged steps. A collective that times out is a
        TrainingFault naming the stalled ranks. The run folder's lock is released at the end."""
        try:
            return self._train()
        finally:
            self.lock.release()

    def _train(self) -> dict[int, float]:
        if not self.start():
            return self.logged
        try:
            with self.guard, StepProfiler(self.cfg, self.run_dir, self.rank, self.device, self.step) as prof:
                while self.step < self.cfg.training.steps and not self.guard.stop:
                    self.next_step()
                    prof.step()
                    self._take_profile(prof)
                self.guard.at(self.step, "the checkpoint save")
                self.checkpointer.wait()  # an async save still writing: complete on every rank
        except RuntimeError as e:
            if self.distributed and _timed_out(e):
                raise self.guard.stalled(e, self.cfg.comm.timeout_s) from None
            if isinstance(e, TrainingFault):  # every rank stops on it: an async save in flight is completed
                self.checkpointer.wait()
            raise
        finally:
            self.checkpointer.abandon()  # after an error: no async write left running (none otherwise)
            self.metrics.close()
        if self.guard.stop:
            self._stop_on_request()
        elif self.cfg.checkpoint.last_save_in_hf:
            self._save_hf()
        self._log_runtime()
        return self.logged

    def _save_hf(self) -> None:
        """`last_save_in_hf`: the final weights as an HF folder next to the DCP checkpoints."""
        out = self.run_dir / self.cfg.checkpoint.folder / f"step-{self.step}-hf"
        path = save_hf(self.model, export_hf_config(self.cfg, self.model_args), out)
        if path is not None:
            logger.info(f"saved Hugging Face checkpoint {path}")

    def _stop_on_request(self) -> None:
        """SIGTERM: the step finished; save it (unless just saved) and say how to resume."""
        ck = self.checkpointer
        saved = ck.enabled and self.step in complete_checkpoints(ck.folder)
        if ck.enabled and not saved:
            self.checkpointer.save(self.step)
            self.checkpointer.wait()
        if self.rank == 0:
            where = f"checkpoint step-{self.step} in {ck.folder}" if ck.enabled else "no checkpoint (disabled)"
            logger.info(f"stopped after step {self.step} on SIGTERM: {where}; run the same command to resume")

    def start(self) -> bool:
        """Resume from the latest checkpoint, open the metrics, log the job; False when the
        job has nothing left to train (metrics closed)."""
        cfg, t = self.cfg, self.cfg.training
        self.step = self.checkpointer.maybe_load()
        if self.step == 0 and cfg.checkpoint.initial_load_path:  # a fresh job from given weights
            load_initial(self.model, cfg)
            if self.rank == 0:
                logger.info(f"loaded initial weights from {cfg.checkpoint.initial_load_path}")
        self.metrics = MetricsLogger(
            cfg.metrics, self.run_dir, rank=self.rank, world_size=self.world_size,
            flops_per_token=self.flops_per_token, compute_dtype=self.compute_dtype,
            device=self.device, start_step=self.step)
        if self.rank == 0:
            sched = f" (schedule {t.seq_len_schedule})" if t.seq_len_schedule else ""
            logger.info(
                f"job {cfg.job.name}: {cfg.model.name}/{cfg.model.flavor} "
                f"({self.num_params / 1e6:.2f}M params), world {self.world_size}, mesh "
                f"{self._mesh_desc()}, global batch {self.global_batch} x {self.seq_len} tokens{sched}"
                f"{self._accumulation_desc()}, steps {self.step + 1}..{t.steps}, MFU peak from "
                f"{self.metrics.peak_note or 'n/a'}")
            if self.validator is not None:
                logger.info(f"validation every {cfg.validation.freq} steps: {cfg.validation.steps} global batches "
                            f"of {self.validator.source}")
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
        try:
            inputs, labels = self._next_batch()
        except DataError as e:  # a streamed corpus meets bad data where it is read
            raise ConfigError(f"{self.cfg.source}: 'data.path' = {self.cfg.data.path!r}: {e} (read at step "
                              f"{self.step + 1}: [data] streaming checks a file's first document before step 1, "
                              f"the rest when it is reached)") from None
        self.guard.at(self.step, "the forward and backward")
        t0 = time.perf_counter()
        with self._peak_probe.watch(self.measured_step, self.device, self.model, self.optimizer,
                                    self.cfg.profiling.enable_profiling):
            loss, grad_norm = self._checked_step(inputs, labels)
        self._step_times.append(time.perf_counter() - t0)
        self._take_peak()
        self._maybe_log_prediction()
        self.metrics.add_tokens(inputs.numel() * self.dp_degree)
        if self.metrics.should_log(self.step, self.cfg.training.steps):
            loss_v = self.reduce_mean(loss.item())
            self.metrics.log(self.step, loss_v, grad_norm.item(), self.lr_used)
            self.logged[self.step] = loss_v
        if self.validator is not None and self.validator.should_run(self.step):
            self.validate()
        if self.checkpointer.should_save(self.step, self.cfg.training.steps):
            self.guard.at(self.step, "the checkpoint save")
            self.guard.check_weights(self.step, self.model)
            self.metrics.flush()  # a run resumed from this checkpoint finds its steps in losses.json
            self.checkpointer.save(self.step)
            self.metrics.reset_timer()
        return loss

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one global batch: its `micro_batches` micro-batches, stacked."""
        if self.micro_batches == 1:
            return next(self._data_iter)
        xs, ys = zip(*(next(self._data_iter) for _ in range(self.micro_batches)))
        return torch.cat(xs), torch.cat(ys)

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
        t0 = time.perf_counter()
        new, moved, how = self.parallelizer.for_seq_len(self.model, self._sample_batch())
        if moved is not None:  # a new module: the optimizer follows its parameters
            t1 = time.perf_counter()
            follow_parameters(self.optimizer, moved)
            self.model = self.checkpointer.model = new
            self._step_times, self.measured_step, self._splits = [], None, []  # measured again
            self._peak_probe = CpuPeakProbe()
            how += (f"; planned and applied in {t1 - t0:.1f}s, parameters and optimizer state moved in "
                    f"{time.perf_counter() - t1:.2f}s")
        if self.rank == 0:
            logger.info(f"step {self.step + 1}: sequence length {old} -> {seq}: {how}")

    def _maybe_log_prediction(self) -> None:
        """Once per plan, after the warm-up and the timed steps: the measured step (the median
        step time, the allocator's peak over the timed steps, the profiler's split when the run
        profiles) beside the mode's prediction, in the log, TensorBoard and plan.html, so a
        user sees where the cost model is off."""
        warmup, n = WARMUP_STEPS, len(self._step_times)
        last = min(warmup + TIMED_STEPS, self.cfg.training.steps - self.step + n)
        if n == warmup < last:
            reset_peak_memory(self.device)  # the peak of the timed steps, not of the setup
        if n != last:
            return
        times = self._step_times[warmup:] or self._step_times[-1:]
        self.measured_step = MeasuredStep(self.reduce_mean(statistics.median(times)) * 1e6, len(times),
                                          self.reduce_max(peak_memory_bytes(self.device)))
        if self._splits:
            self._set_split(self._splits)
        self.forecast = self.parallelizer.predict(self.model, self.micro_batches)
        if self.forecast is not None:
            self.forecast.note = self.parallelizer.correct_prediction(self.model, self.measured_step.step_us,
                                                                      self.forecast, self.micro_batches)
        self._publish_measured()

    def _take_profile(self, prof: StepProfiler) -> None:
        """A step the profiler recorded after the warm-up: its compute / communication split
        joins the measured step (now, or when it is measured; all ranks record the same steps)."""
        split = prof.take_split()
        if split is None or len(self._step_times) <= WARMUP_STEPS:
            return
        if self.measured_step is None:
            self._splits.append(split)
        elif self.measured_step.compute_us is None:
            self._set_split([split])
            self._publish_measured(split_only=True)

    def _set_split(self, splits: list[tuple[int, float, float]]) -> None:
        m = self.measured_step
        m.compute_us = self.reduce_mean(statistics.median(s[1] for s in splits))
        m.comm_us = self.reduce_mean(statistics.median(s[2] for s in splits))
        steps = sorted(s[0] for s in splits)
        m.source = f"timers; split: profiler, step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
        self._splits = []

    def _take_peak(self) -> None:
        """After the step `CpuPeakProbe` watched: the allocator's peak (the most of any rank)
        joins the measured step, to TensorBoard and the page."""
        peak = self._peak_probe.take()
        if peak is None:
            return
        self.measured_step.peak_bytes = self.reduce_max(peak)
        self.measured_step.source += f"; peak: CPU allocator, step {self.step}"
        self._publish_measured(only=PEAK_SCALARS)

    def _publish_measured(self, split_only: bool = False, only: tuple[str, ...] = ()) -> None:
        """The measured step (and the forecast) to the log, TensorBoard and plan.html (rank 0);
        `split_only` / `only`: a later addition (the profiler's split, the CPU allocator's peak)."""
        m, f = self.measured_step, self.forecast
        scalars = step_scalars(m, f)
        only = SPLIT_SCALARS if split_only else only
        if only:  # the rest was written when the step was measured
            scalars = {k: v for k, v in scalars.items() if k in only}
        self.metrics.log_scalars(self.step, scalars)
        if self.rank != 0:
            return
        what = f.report(m.step_us / 1e6) if f is not None else "no prediction (the mode predicts none)"
        logger.info(f"step time: {describe(m)}, {what}")
        page = save_measured_page(f, m, self.run_dir)
        if page is not None and not only:
            logger.info(f"plan picture with the measured step saved to {page}")

    def reduce_max(self, x: Optional[int]) -> Optional[int]:
        """The largest of a per-rank number over all ranks (None: no rank has one, no collective)."""
        if x is None or not self.distributed or self.world_size == 1:
            return x
        t = torch.tensor([x], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _log_runtime(self) -> None:
        """How the mode ran the steps (auto mode: one graph per step, deviations from the plan)."""
        report = self.parallelizer.run_report(self.model)
        if report is not None and self.rank == 0:
            logger.info(report)

    def _checked_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A training step; Inductor's failure to compile is the job's error (key and fix)."""
        try:
            return self.train_step(inputs, labels)
        except CompileError as e:
            raise ConfigError(f"{self.cfg.source}: 'training.compile' = true: {e}") from None

    def _accumulation_desc(self) -> str:
        if self.micro_batches == 1:
            return ""
        t = self.cfg.training
        return (f" ({self.micro_batches} micro-batches of local batch {t.local_batch_size} x {self.dp_degree} data "
                f"ranks, gradients accumulated)")

    def _mesh_desc(self) -> str:
        if self.mesh is None:
            return "none (single process)"
        return " x ".join(f"{n}={s}" for n, s in zip(self.mesh.mesh_dim_names, self.mesh.shape))
