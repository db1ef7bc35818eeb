"""Validation of a loaded job config: every problem is one ConfigError naming the file, the
`section.key`, its value and the fix. Never touches `torch.distributed`: the world size
comes from `WORLD_SIZE` (1 when unset) or the caller, so every rank finds the same problem
before any collective.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

from models import build_model, get_model_spec, model_args, transformer_blocks
from models.layers import ArgError
from parallel.auto.cost import AUTO, ProfileError, load_hardware
from parallel.auto.cost.memory import OPTIMIZERS
from parallel.recipes import RecipeError
from parallel.recipes.cp import validate_cp
from parallel.recipes.pp import check_composition, pipeline_layout, schedule_name
from parallel.settings import SettingError

from .device import CPU, CUDA, check_compiler, check_device
from .errors import ConfigError
from .run_folder import check_folders
from .sources import packaged_builders
from .tokenizer import TokenizerError, tokenizer_for

JobConfig = Any  # trainer.config.JobConfig (this module sits below it)

CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("training", "dtype"): ("float32", "bfloat16"),
    ("training", "mixed_precision_param"): ("float32", "bfloat16"),
    ("training", "mixed_precision_reduce"): ("float32", "bfloat16"),
    ("optimizer", "name"): ("AdamW",),
    ("optimizer", "implementation"): OPTIMIZERS,
    ("lr_scheduler", "decay"): ("linear", "cosine", "none"),
    ("parallelism", "mode"): ("manual", "auto"),
    ("parallelism", "replan"): ("fresh", "replay"),
    ("parallelism", "reshard_after_forward"): (True, False, "auto"),
    ("job", "device"): ("auto", CUDA, CPU),
    ("training", "compile_mode"): ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"),
    ("data", "tokenizer"): ("byte",),
    ("checkpoint", "async_mode"): ("disabled", "async"),
}


def _err(cfg: JobConfig, section: str, key: str, msg: str) -> ConfigError:
    sec = getattr(cfg, section)
    owner = next((o for o in (sec, getattr(sec, "planner", None), getattr(sec, "degrees", None),
                              getattr(sec, "pipeline", None))
                  if o is not None and hasattr(o, key)), sec)
    return ConfigError(f"{cfg.source}: '{section}.{key}' = {getattr(owner, key)!r}: {msg}")


def env_world_size() -> int:
    """The world size torchrun announces (1 for a plain process)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"environment: WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not "
                          f"an integer") from None


def validate_config(cfg: JobConfig, world_size: Optional[int] = None, simulated_device: bool = False) -> None:
    """Raise ConfigError for the first problem found. Touches no process group, so every
    rank finds the same problem before any collective. `simulated_device`: a dry run, whose
    device is faked (a CUDA job checked on a CPU machine), so this machine need not have it."""
    for (section, key), choices in CHOICES.items():
        if getattr(getattr(cfg, section), key) not in choices:
            raise _err(cfg, section, key, f"must be one of {', '.join(map(repr, choices))}")
    _validate_ranges(cfg)
    check_folders(cfg)
    _validate_hardware(cfg)
    _validate_parallelism(cfg, env_world_size() if world_size is None else world_size)
    _validate_planner(cfg)
    _validate_model(cfg, world_size)
    _validate_tokenizer(cfg)
    _validate_runtime(cfg, simulated_device)


def _validate_ranges(cfg: JobConfig) -> None:
    """Numbers out of range and paths that do not exist."""
    t = cfg.training
    for key in ("local_batch_size", "seq_len"):
        if getattr(t, key) < 1:
            raise _err(cfg, "training", key, "must be >= 1")
    if t.steps < 0:
        raise _err(cfg, "training", "steps", "must be >= 0")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise _err(cfg, "lr_scheduler", "warmup_steps", "must be >= 0")
    if cfg.optimizer.lr <= 0:
        raise _err(cfg, "optimizer", "lr", "must be > 0")
    if cfg.metrics.log_freq < 1:
        raise _err(cfg, "metrics", "log_freq", "must be >= 1")
    ck = cfg.checkpoint
    if ck.interval < 1:
        raise _err(cfg, "checkpoint", "interval", "must be >= 1")
    if ck.keep_latest_k < 0:
        raise _err(cfg, "checkpoint", "keep_latest_k", "must be >= 0 (0 keeps all)")
    try:
        cfg.activation_checkpoint.check()
    except SettingError as e:
        raise _err(cfg, "activation_checkpoint", e.key, e.fix) from None
    if cfg.activation_checkpoint.mode == "auto" and cfg.parallelism.mode != "auto":
        raise _err(cfg, "activation_checkpoint", "mode", "the planner chooses the recomputation only in auto mode "
                   "([parallelism] mode = \"auto\"); with a recipe use \"none\", \"selective\" or \"full\"")
    if t.skip_nonfinite_steps < 0:
        raise _err(cfg, "training", "skip_nonfinite_steps", "must be >= 0 (0: stop at the first non-finite step)")
    if not cfg.parallelism.reduce_bucket_mb >= 0:
        raise _err(cfg, "parallelism", "reduce_bucket_mb", "must be >= 0 MiB (0: one gradient bucket per block; "
                   "DDP's default is 25)")
    if not cfg.comm.timeout_s > 0:
        raise _err(cfg, "comm", "timeout_s", "must be > 0 seconds")
    if cfg.data.num_workers < 0:
        raise _err(cfg, "data", "num_workers", "must be >= 0")
    if cfg.data.path and not any(c in cfg.data.path for c in "*?[") and not Path(cfg.data.path).exists():
        raise _err(cfg, "data", "path", "no such file or folder")  # a glob's matches are checked when read
    if cfg.data.streaming and cfg.data.shuffle:
        raise _err(cfg, "data", "shuffle", "a streamed corpus ([data] streaming = true) is read in order; set "
                   "data.shuffle = false (shuffle the files beforehand) or data.streaming = false")
    if cfg.data.streaming and cfg.data.num_workers:
        raise _err(cfg, "data", "num_workers", "a streamed corpus is read in the training process; set 0")
    _validate_builder(cfg)
    _validate_validation(cfg)


def _validate_validation(cfg: JobConfig) -> None:
    """`[validation]`: positive counts, a path that exists, a split a streamed corpus cannot give."""
    v = cfg.validation
    if not v.enable:
        return
    for key in ("freq", "steps"):
        if getattr(v, key) < 1:
            raise _err(cfg, "validation", key, "must be >= 1")
    if v.data and not any(c in v.data for c in "*?[") and not Path(v.data).exists():
        raise _err(cfg, "validation", "data", "no such file or folder")
    if not v.data and cfg.data.streaming:
        raise _err(cfg, "validation", "data", "a streamed corpus ([data] streaming = true) is read as it goes, so "
                   "no split of it can be held back: set validation.data to a validation dataset")


def _validate_builder(cfg: JobConfig) -> None:
    """`data.dataset_builder`: a builder datasets runs from local files (never the hub), with a path."""
    builder = cfg.data.dataset_builder
    if not builder:
        return
    if not cfg.data.path:
        raise _err(cfg, "data", "dataset_builder", "needs data.path (the files or the local dataset folder)")
    choices = packaged_builders()
    if builder != "auto" and builder not in choices:
        raise _err(cfg, "data", "dataset_builder", f"not a datasets builder for local files; use 'auto' (a local "
                   f"dataset folder) or one of {', '.join(choices)}")
    if builder == "auto" and not Path(cfg.data.path).is_dir():
        raise _err(cfg, "data", "dataset_builder", "'auto' reads a local dataset folder; data.path is not a folder")


def _validate_hardware(cfg: JobConfig) -> None:
    """Both hardware keys name a profile the planner can read (the planner's own loader)."""
    for section in ("metrics", "parallelism"):
        hardware = cfg.parallelism.planner.hardware if section == "parallelism" else cfg.metrics.hardware
        if hardware == AUTO:
            continue  # this machine, measured when the job starts
        try:
            load_hardware(hardware)
        except ProfileError as e:
            fix = "" if "available:" in str(e) else "; name a profile of configs/hardware/ or a valid profile .toml"
            raise _err(cfg, section, "hardware", f"{e}{fix}") from None


def _validate_parallelism(cfg: JobConfig, world_size: int) -> None:
    """Degrees: positive, multiplying to the world size, EP dividing the data ranks."""
    try:
        cfg.parallelism.degrees.check(world_size)
    except SettingError as e:
        raise _err(cfg, "parallelism", e.key, e.fix) from None
    deg = cfg.parallelism.degrees.resolved(world_size)
    if cfg.parallelism.mode == "auto" and deg["pp"] > 1:
        for key, axis in (("context_parallel_degree", "cp"), ("expert_parallel_degree", "ep")):
            if deg[axis] > 1:
                raise _err(cfg, "parallelism", key, f"auto mode does not yet plan pipeline stages with a {axis} axis "
                           f"(pipeline_parallel_degree = {deg['pp']}); set it to 1, or use mode = \"manual\" (the "
                           "recipes compose pp with it)")
    try:
        cfg.parallelism.pipeline.check()
        schedule_name(cfg.parallelism.pipeline.pipeline_parallel_schedule)  # a typo should not wait for pp > 1
    except SettingError as e:
        raise _err(cfg, "parallelism", e.key, e.fix) from None
    except RecipeError as e:
        raise _err(cfg, "parallelism", e.key, e.reason) from None
    if cfg.parallelism.mode == "auto" and deg["ep"] > 1 and deg["dp_shard"] % deg["ep"]:
        raise _err(cfg, "parallelism", "expert_parallel_degree",
                   f"must divide data_parallel_shard_degree = {deg['dp_shard']} in auto mode (the mesh's dp_shard is "
                   "built as dp_shard_mod_ep x ep); choose a divisor of it")
    if cfg.parallelism.mesh != "auto":  # the mesh search divides the global batch per mesh itself
        _validate_global_batch(cfg, deg["dp_replicate"] * deg["dp_shard"])


def _validate_global_batch(cfg: JobConfig, data_degree: int) -> None:
    """`global_batch_size`: -1, or a whole number of micro-batches of local batch x data degree."""
    t = cfg.training
    g, b = t.global_batch_size, t.local_batch_size
    if g == -1:
        return
    if g < 1:
        raise _err(cfg, "training", "global_batch_size", "must be >= 1, or -1 (local_batch_size x the data degree)")
    step = b * data_degree
    if g % step == 0:
        return
    lower, upper = (g // step) * step, (g // step + 1) * step
    near = " or ".join(str(v) for v in (lower, upper) if v > 0)
    fix = f"set training.global_batch_size to a multiple of it ({near})"
    if g % data_degree == 0:
        per_rank = g // data_degree
        locals_ = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        best = sorted(locals_, key=lambda d: (abs(d - b), d))[:2]
        fix += f", or training.local_batch_size to a divisor of {per_rank} ({' or '.join(map(str, sorted(best)))})"
    raise _err(cfg, "training", "global_batch_size",
               f"is not a multiple of training.local_batch_size ({b}) x the data degree (dp_replicate x dp_shard = "
               f"{data_degree}) = {step}: every step is a whole number of micro-batches; {fix}")


def _validate_mesh(cfg: JobConfig) -> None:
    """`mesh = "auto"`: auto mode, and no degrees set (the search chooses them)."""
    p = cfg.parallelism
    if p.mesh not in ("", "auto"):
        raise _err(cfg, "parallelism", "mesh", 'must be "auto" (search the meshes) or "" (build it from the degrees)')
    if p.mesh != "auto":
        return
    if p.mode != "auto":
        raise _err(cfg, "parallelism", "mesh", 'the mesh search plans each mesh: it needs mode = "auto"')
    defaults = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1, "tensor_parallel_degree": 1,
                "context_parallel_degree": 1, "expert_parallel_degree": 1}
    for key, default in defaults.items():
        if getattr(p.degrees, key) != default:
            raise _err(cfg, "parallelism", key, f'is set, but mesh = "auto" chooses the degrees; remove it '
                       f'(default {default}) or set mesh = ""')


def _validate_planner(cfg: JobConfig) -> None:
    """The auto mode's knobs (checked in manual mode too: a typo should not wait)."""
    p = cfg.parallelism
    _validate_mesh(cfg)
    try:
        dataclasses.replace(p.planner, optimizer=cfg.optimizer.implementation).check()
    except SettingError as e:
        section, key = ("optimizer", "implementation") if e.key == "optimizer" else ("parallelism", e.key)
        raise _err(cfg, section, key, e.fix) from None
    if p.plan_file and not Path(p.plan_file).is_file():
        raise _err(cfg, "parallelism", "plan_file",
                   "no such file; point it at a plan.json the planner wrote (<dump_folder>/<job.name>/plan.json) "
                   "or leave it empty to plan")


def _validate_model(cfg: JobConfig, world_size: Optional[int] = None) -> None:
    """Known model and flavor; a sequence that fits the flavor's position tables."""
    try:
        spec = get_model_spec(cfg.model.name)
    except ValueError as e:
        raise _err(cfg, "model", "name", f"unknown model ({e})") from None
    if cfg.model.flavor not in spec.flavors:
        raise _err(cfg, "model", "flavor",
                   f"no such flavor of {cfg.model.name}; flavors: {', '.join(spec.flavors)}")
    overrides = cfg.model.arg_overrides()
    try:
        args = model_args(cfg.model.name, cfg.model.flavor, **overrides)
    except ArgError as e:  # a value the model's shape cannot take: named as the job sets it
        key = next((k for k in e.keys if k in overrides), e.keys[0])
        why = e.fix if key == e.keys[0] else str(e)
        raise _err(cfg, "model", key, f"{why} ({cfg.model.name}/{cfg.model.flavor} with {overrides})") from None
    except (ValueError, TypeError, AssertionError) as e:
        key = next((k for k in overrides if k in str(e)), next(iter(overrides), "flavor"))
        raise _err(cfg, "model", key, f"not an argument {cfg.model.name}/{cfg.model.flavor} can take ({e}); "
                   "remove it or fix the value") from None
    _validate_balancing(cfg, args)
    _validate_expert_axis(cfg, args)
    _validate_pipeline(cfg, args, world_size)
    max_seq_len = getattr(args, "max_seq_len", None)
    if max_seq_len is not None and cfg.training.seq_len > max_seq_len:
        raise _err(cfg, "training", "seq_len",
                   f"exceeds max_seq_len = {max_seq_len} of {cfg.model.name}/{cfg.model.flavor} (the length of its "
                   f"RoPE tables); set training.seq_len <= {max_seq_len}, or pick a flavor with a longer max_seq_len")
    _validate_schedule(cfg, max_seq_len)


def _validate_expert_axis(cfg: JobConfig, args: Any) -> None:
    """Auto mode's `ep` mesh axis: a model with routed experts, as many as ep divides (the
    planner may place them expert-parallel there; the manual recipe checks the same)."""
    ep = cfg.parallelism.degrees.expert_parallel_degree
    if cfg.parallelism.mode != "auto" or ep == 1:
        return
    n = getattr(args, "n_routed_experts", 0)
    if not n:
        raise _err(cfg, "parallelism", "expert_parallel_degree",
                   f"{cfg.model.name}/{cfg.model.flavor} has no routed experts; set it to 1")
    if n % ep:
        raise _err(cfg, "parallelism", "expert_parallel_degree",
                   f"does not divide the number of routed experts ({n}); choose a divisor of {n}")


def _validate_pipeline(cfg: JobConfig, args: Any, world_size: Optional[int]) -> None:
    """`pipeline_parallel_degree` > 1: a schedule torch has, stages that fit the degree, the
    schedule and the model's layers, microbatches the schedule can run (parallel/recipes/pp.py)."""
    deg = cfg.parallelism.degrees
    pp = deg.pipeline_parallel_degree
    if pp == 1:
        return
    if cfg.checkpoint.last_save_in_hf:
        raise _err(cfg, "checkpoint", "last_save_in_hf", f"the HF export gathers the model on rank 0, which holds "
                   f"only its pipeline stages with pipeline_parallel_degree = {pp}; set it to false and convert the "
                   "last DCP checkpoint (python scripts/convert_hf.py to-hf)")
    shard = deg.resolved(env_world_size() if world_size is None else world_size)["dp_shard"]
    try:
        ddp = deg.data_parallel_replicate_degree > 1 and shard == 1 and deg.context_parallel_degree == 1
        check_composition(pp, deg.data_parallel_replicate_degree, ddp)
        pipeline_layout(args.n_layers, pp, cfg.parallelism.pipeline, cfg.training.local_batch_size)
    except RecipeError as e:
        raise _err(cfg, "parallelism", e.key, e.reason) from None


def _validate_balancing(cfg: JobConfig, args: Any) -> None:
    """MoE balancing the job's mode can run: auto mode's step graph does not write buffers back
    (the token counts) and was not traced with the auxiliary-loss gradient; a sequence-wise
    loss needs whole sequences (not context-parallel shards)."""
    m = cfg.model
    for key in ("load_balance_coeff", "moe_aux_loss_coeff"):
        value = getattr(args, key, None)
        if not value:
            continue
        where = f"{key} = {value} ({m.name}/{m.flavor}{'' if getattr(m, key) is not None else ', its flavor'})"
        if cfg.parallelism.mode == "auto":
            raise _err(cfg, "parallelism", "mode", f"{where} is not supported in auto mode (the planned step does "
                       f"not update the balancing state); set model.{key} = 0 or use mode = \"manual\"")
        if key == "moe_aux_loss_coeff" and cfg.parallelism.degrees.context_parallel_degree > 1:
            section, named = ("model", key) if m.moe_aux_loss_coeff is not None else (
                "parallelism", "context_parallel_degree")
            raise _err(cfg, section, named, f"{where}: the sequence-wise balance loss needs whole sequences, but "
                       "context parallelism splits them; set model.moe_aux_loss_coeff = 0 or context_parallel_degree "
                       "= 1")


def _validate_tokenizer(cfg: JobConfig) -> None:
    """`model.tokenizer_path` parses, its BOS/EOS resolve, and `model.vocab_size` holds its vocabulary."""
    m = cfg.model
    if not m.tokenizer_path:
        for key in ("bos_token", "eos_token"):
            if getattr(m, key):
                raise _err(cfg, "model", key, "needs model.tokenizer_path (the byte tokenizer has no special "
                           "tokens); set the tokenizer.json or remove the key")
        return
    try:
        tok = tokenizer_for(cfg)
    except TokenizerError as e:
        section, key = e.key.split(".")
        msg = str(e).removeprefix(f"{m.tokenizer_path}: ") if key == "tokenizer_path" else str(e)
        raise _err(cfg, section, key, msg) from None
    if 0 < m.vocab_size < tok.vocab_size:
        raise _err(cfg, "model", "vocab_size", f"smaller than the vocabulary of {tok.vocab_size} tokens of "
                   f"'model.tokenizer_path' = {m.tokenizer_path!r}; set model.vocab_size >= {tok.vocab_size} or -1 "
                   f"(the tokenizer's)")


SCHEDULE_FORM = "a list of [step, seq_len] pairs, e.g. [[0, 2048], [1000, 8192]]"


def _validate_schedule(cfg: JobConfig, max_seq_len: Optional[int]) -> None:
    """`training.seq_len_schedule`: [step, seq_len] pairs, first step 0, steps strictly increasing,
    every length one the model (RoPE tables) and the context-parallel split can take."""
    sched = cfg.training.seq_len_schedule
    if not sched:
        return

    def bad(msg: str) -> ConfigError:
        return _err(cfg, "training", "seq_len_schedule", msg)

    for i, pair in enumerate(sched):
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise bad(f"entry {i} ({pair!r}) is not [step, seq_len] (two integers); write {SCHEDULE_FORM}")
    if sched[0][0] != 0:
        raise bad(f"the first entry starts at step {sched[0][0]}; it must start at step 0 (the length to begin with)")
    for (a, _), (b, _) in zip(sched, sched[1:]):
        if b <= a:
            raise bad(f"steps must be strictly increasing ({a} then {b}); order the entries by step, one per step")
    for step, seq in sched:
        if seq < 1:
            raise bad(f"seq_len {seq} at step {step} must be >= 1")
        if max_seq_len is not None and seq > max_seq_len:
            raise bad(f"seq_len {seq} at step {step} exceeds max_seq_len = {max_seq_len} of {cfg.model.name}/"
                      f"{cfg.model.flavor} (its RoPE tables); keep every length <= {max_seq_len}, or set "
                      f"model.max_seq_len")
        cp = cfg.parallelism.degrees.context_parallel_degree
        if cp > 1:
            try:
                validate_cp(seq, cp)
            except RecipeError as e:
                raise bad(f"seq_len {seq} at step {step}: {e}") from None


def _validate_runtime(cfg: JobConfig, simulated_device: bool = False) -> None:
    """The device exists, and a compile has its compiler (Inductor's C++ toolchain on CPU)."""
    why = None if simulated_device else check_device(cfg.job.device)
    if why:
        raise _err(cfg, "job", "device", why)
    if cfg.activation_checkpoint.mode in ("full", "selective"):
        why = _no_blocks(cfg)
        if why:
            raise _err(cfg, "activation_checkpoint", "mode", f"{why}; set mode = \"none\"")
    if cfg.training.compile and not cfg.training.compile_fallback:
        why = check_compiler(cfg.job.device)
        if why:
            raise _err(cfg, "training", "compile", why)


def _no_blocks(cfg: JobConfig) -> str | None:
    """Why activation checkpointing has nothing to work on (no transformer blocks), or None."""
    try:
        blocks = transformer_blocks(build_model(cfg.model.name, cfg.model.flavor, device="meta",
                                                **cfg.model.arg_overrides()))
    except (ValueError, AttributeError) as e:
        return f"{cfg.model.name} has no transformer blocks to checkpoint ({e})"
    return None if blocks else f"{cfg.model.name} has no transformer blocks to checkpoint"


def check_writable(source: str, key: str, value: Any, folder: Path, rank: int) -> None:
    """The folder a setting names can be made and written by this rank: else one config error
    naming the key and its value, before the first step (not a crash at the first write)."""
    probe = folder / f".writable-{rank}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{source}: '{key}' = {value!r}: cannot write {folder} ({e.strerror or e}); "
                          "choose a folder this job may write") from None
