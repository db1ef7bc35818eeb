"""Job configuration: one dataclass per TOML section, CLI overrides, validation.

    cfg = load_config("llama3_debug", ["--training.steps", "10", "--checkpoint.enable"])

A bare name resolves to ``configs/NAME`` (with or without ``.toml``) in the current
directory or in the project's own ``configs/`` folder. Every problem -- an unknown
section or key, a value of the wrong type, a bad choice, degrees whose product does not
match the world size, an unknown model or flavor -- raises one :class:`ConfigError`
that names the file, the ``section.key``, the value and the fix. Validation never
touches ``torch.distributed``: the world size comes from the ``WORLD_SIZE`` environment
variable (1 when unset) or from the ``world_size`` argument.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

from parallel.auto.config import JOB_KEY, PlannerConfig
from parallel.auto.cost import DEFAULT_HARDWARE
from parallel.settings import ActivationCheckpoint, ParallelDegrees, PipelineSettings

from .config_checks import validate_config
from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

logger = logging.getLogger("autotitan")

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIGS_DIR = PROJECT_ROOT / "configs"


# --------------------------------------------------------------------------- sections

FLAT = "flat"
"""Field metadata: a settings object whose fields are keys of the enclosing section (TOML stays flat)."""


@dataclass
class Job:
    name: str = "default"  # the run folder <dump_folder>/<name> (inside dump_folder; one job at a time: locked)
    dump_folder: str = "./outputs"
    seed: int = 0
    description: str = ""
    device: str = "auto"  # "auto" (CUDA when available) | "cuda" | "cpu"


@dataclass
class Model:
    name: str = "llama3"
    flavor: str = "debug"
    # -1: take the vocabulary size from the tokenizer (256 for the byte tokenizer).
    vocab_size: int = -1
    # the model's own arguments over the flavor's (unset: the flavor's); each is checked
    # against the model family's arguments (e.g. n_routed_experts is DeepSeek-V3 only)
    n_layers: Optional[int] = None
    dim: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    ffn_hidden_dim: Optional[int] = None
    max_seq_len: Optional[int] = None
    n_dense_layers: Optional[int] = None
    inter_dim: Optional[int] = None
    moe_inter_dim: Optional[int] = None
    n_routed_experts: Optional[int] = None
    n_shared_experts: Optional[int] = None
    n_activated_experts: Optional[int] = None
    # DeepSeek-V3 (unset: the flavor's): the q projection's LoRA rank (0: a plain wq)
    q_lora_rank: Optional[int] = None
    score_func: Optional[str] = None  # router scores: "softmax" | "sigmoid"
    # group-limited routing: the experts form n_expert_groups equal groups (1: none); a token
    # chooses among the experts of its n_limited_groups best groups
    n_expert_groups: Optional[int] = None
    n_limited_groups: Optional[int] = None
    route_norm: Optional[bool] = None  # top-k weights renormalised to sum to 1
    route_scale: Optional[float] = None  # factor on the top-k weights (DeepSeek-V3: 2.5)
    # aux-loss-free balancing: after each optimizer step every expert bias moves by this much towards
    # balance (sign of mean - tokens, counts summed over all ranks); 0: the bias is kept as loaded
    load_balance_coeff: Optional[float] = None
    moe_aux_loss_coeff: Optional[float] = None  # weight of the sequence-wise balance loss (0: off)
    # YaRN RoPE scaling (DeepSeek-V3; LLaMA 3: its own "llama3" scaling): factor (0: none) and the
    # context the model was trained at before
    rope_scaling_factor: Optional[float] = None
    rope_original_max_seq_len: Optional[int] = None
    # a Hugging Face tokenizer.json ("" : the byte tokenizer, [data] tokenizer); bos_token / eos_token
    # name its BOS / EOS ("" : as the tokenizer defines them: tokenizer_config.json, post-processor, specials)
    tokenizer_path: str = ""
    bos_token: str = ""
    eos_token: str = ""

    def arg_overrides(self) -> dict[str, Any]:
        """The model arguments this config sets (what build_model takes over the flavor)."""
        skip = {"name", "flavor", "vocab_size", "tokenizer_path", "bos_token", "eos_token"}
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in skip and getattr(self, f.name) is not None}


@dataclass
class Training:
    local_batch_size: int = 8
    # samples per optimizer step over all data-parallel ranks; -1: local_batch_size x the data degree
    # (dp_replicate x dp_shard). Larger: gradient accumulation over global / (local x data degree) micro-batches
    global_batch_size: int = -1
    seq_len: int = 256
    steps: int = 100
    max_norm: float = 1.0  # <= 0 disables gradient clipping
    dtype: str = "float32"  # dtype of the master parameters
    mixed_precision_param: str = "float32"
    mixed_precision_reduce: str = "float32"
    compile: bool = False  # manual: torch.compile per block; auto: the whole step as one Inductor graph
    compile_fallback: bool = False  # on a compile error, run eagerly (logged) instead of failing
    compile_mode: str = "default"  # torch.compile's mode: "default" | "max-autotune" (benchmarks GEMM kernels)
    # [[step, seq_len], ...]: from optimizer step `step` (0-based) on, train at `seq_len`; first step 0,
    # steps strictly increasing; overrides seq_len. Auto mode re-plans at each change (parallelism.replan)
    seq_len_schedule: list = field(default_factory=list)
    # a step whose loss or gradient norm is not finite stops the job before the optimizer step
    # (the weights and checkpoints stay finite); N > 0: up to N such steps are skipped instead
    skip_nonfinite_steps: int = 0

    def seq_len_at(self, step: int) -> int:
        """The sequence length of 0-based step `step` (seq_len when there is no schedule)."""
        seq = self.seq_len
        for start, length in self.seq_len_schedule:
            if start <= step:
                seq = length
        return seq

    def seq_lens(self) -> list[int]:
        """Every sequence length the job trains at, in order of first use."""
        return [length for _, length in self.seq_len_schedule] or [self.seq_len]

    def global_batch(self, dp_degree: int) -> int:
        """Samples per optimizer step on `dp_degree` data-parallel ranks (the default: one local batch each)."""
        return self.global_batch_size if self.global_batch_size > 0 else self.local_batch_size * dp_degree

    def micro_batches(self, dp_degree: int) -> int:
        """Forward/backward passes per optimizer step: the global batch over local batch x data degree
        (config_checks.py makes it a whole number before any work)."""
        return max(1, self.global_batch(dp_degree) // (self.local_batch_size * dp_degree))


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "foreach"  # "foreach" | "for-loop" | "fused" (one kernel a parameter group, no temporaries)


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    decay: str = "linear"  # "linear" | "cosine" | "none"
    # -1: decay over the rest of the run (training.steps - warmup_steps). Set it to keep
    # the schedule fixed while a run is split into pieces.
    decay_steps: int = -1
    min_lr_factor: float = 0.0  # final lr = lr * min_lr_factor


@dataclass
class Parallelism:
    mode: str = "manual"  # "manual" (hand recipes) | "auto" (planner)
    # data_parallel_replicate_degree, data_parallel_shard_degree (-1: the rest of the world),
    # tensor_parallel_degree, context_parallel_degree, expert_parallel_degree, enable_sequence_parallel,
    # pipeline_parallel_degree
    degrees: ParallelDegrees = field(default_factory=ParallelDegrees, metadata={FLAT: True})
    # manual mode with pipeline_parallel_degree > 1: pipeline_parallel_schedule, pipeline_parallel_microbatch_size,
    # pipeline_parallel_layers_per_stage, pipeline_parallel_split_points (parallel/settings.py: PipelineSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings, metadata={FLAT: True})
    # auto mode: "" builds the mesh from the degrees; "auto" plans every mesh of the world
    # size (trainer/mesh_auto.py) and builds the fastest that fits
    mesh: str = ""
    # auto mode: the planner's settings (parallel/auto/config.py), written as keys of [parallelism]:
    # hardware, solver, time_limit, mrf_patience, mrf_polish, repeated_blocks, split_seeding(_radius, _rounds),
    # memory_budget_low, memory_budget_high, memory_limit_gib, memory_estimate, moe_imbalance_factor
    planner: PlannerConfig = field(default_factory=PlannerConfig, metadata={FLAT: True})
    recalibrate: bool = False  # hardware "auto": measure again instead of reading the cached profile
    plan_file: str = ""  # replay this plan.json instead of solving
    # auto mode: gather parameters again in the backward (true: FSDP's default, less memory) or keep the
    # forward's gathered copies (false: ZeRO-2's shape); "auto": the planner prices both and chooses
    reshard_after_forward: Union[bool, str] = "auto"
    overlap: bool = True  # auto mode: collectives start early and are waited for at first use
    # auto mode: gradient buckets of consecutive blocks are joined until one holds this many MiB
    # (DDP's bucket_cap_mb rule and default); 0: one reduction bucket per block
    reduce_bucket_mb: float = 25.0
    # auto mode, when the input shape changes (training.seq_len_schedule): "fresh" solves for the new shape
    # (or takes the plan solved for it earlier in the job); "replay" keeps the current plan's placements
    replan: str = "fresh"


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoints"  # under <dump_folder>/<job.name>/ (a relative folder that stays inside it)
    interval: int = 500
    keep_latest_k: int = 0  # 0: keep all
    load_step: int = -1  # -1: the latest complete checkpoint; N: roll back to step-N (newer ones -> step-M.abandoned)
    # a fresh job (no checkpoint to resume) starts from these weights: a DCP folder
    # (scripts/convert_hf.py to-dcp), or an HF safetensors folder with initial_load_in_hf
    initial_load_path: str = ""
    initial_load_in_hf: bool = False
    last_save_in_hf: bool = False  # also write the final step as an HF folder: <folder>/step-N-hf
    # "disabled": a save blocks the step; "async": DCP's async_save snapshots the state to CPU and writes it
    # while the next steps run (complete, renamed step-N, once every rank's part is written)
    async_mode: str = "disabled"
    # true: also load checkpoint folders that cannot be verified or read without running their code: a step-N
    # without manifest.json, DCP metadata or items that need Python's full unpickler, the pickled data-loader
    # state of older checkpoints (resume, initial_load_path); only for folders from someone you trust
    trust_foreign: bool = False


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = False
    hardware: str = DEFAULT_HARDWARE  # profile for MFU (configs/hardware/NAME.toml; cpu is measured)


@dataclass
class Data:
    # "" : the corpus shipped in data/; otherwise a file, a folder (recursive) or a glob of
    # .txt, .jsonl, .parquet, .csv, .json, .arrow files (trainer/sources.py)
    path: str = ""
    tokenizer: str = "byte"
    jsonl_field: str = "text"  # the text's key / column in .jsonl, .parquet, .csv, .json, .arrow files
    shuffle: bool = True
    num_workers: int = 0
    # true: pack windows while reading (corpus order, the corpus never held in memory; trainer/streaming.py);
    # false: the corpus tokenized into memory first (shuffled windows)
    streaming: bool = False
    # "" : files read by their suffix (trainer/sources.py); a datasets.load_dataset builder name ("text", "json",
    # "csv", "parquet", ...) reads the files of `path` with it; "auto": `path` is a local dataset folder
    dataset_builder: str = ""
    split: str = "train"  # the split a dataset_builder reads


@dataclass
class Validation:
    # every `freq` steps: the loss and perplexity of `steps` global batches, forward only (trainer/validation.py)
    enable: bool = False
    freq: int = 10
    steps: int = 4
    # "" : the last `steps` global batches of the training data, held back from training; otherwise a path
    # read like [data] path (its tokenizer, jsonl_field and dataset_builder)
    data: str = ""


@dataclass
class Comm:
    # seconds a collective (and the process group's start) may wait for the other ranks; then
    # the job ends, naming the ranks that stalled
    timeout_s: float = 600.0


@dataclass
class Profiling:
    # torch.profiler Chrome traces per rank of every profile_freq-th step (steps N*profile_freq), in
    # <dump_folder>/<job.name>/<save_traces_folder>/iteration_N/rank{R}_trace.json (trainer/profiling.py)
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10
    # memory at the same steps, in <save_memory_snapshot_folder>/iteration_N/: CUDA's allocator snapshot
    # (rank{R}_memory_snapshot.pickle, for pytorch.org/memory_viz); on CPU the profiler's per-op memory
    # table (rank{R}_memory.txt), and the trace carries its memory events
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(
        default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    # where the config came from (for messages); not a TOML section
    source: str = field(default="<defaults>", compare=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: section_dict(getattr(self, f.name)) for f in fields(self) if f.name != "source"}

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


SECTIONS = [f.name for f in fields(JobConfig) if f.name != "source"]



# --------------------------------------------------------------------------- typing


def _keys(section_cls) -> dict[str, tuple[tuple[str, ...], Any]]:
    """Key -> (attribute path from the section, type); a FLAT field's own keys stand in for it
    (those set from another section, JOB_KEY, are not keys here)."""
    hints = typing.get_type_hints(section_cls)
    out: dict[str, tuple[tuple[str, ...], Any]] = {}
    for f in fields(section_cls):
        if f.metadata.get(FLAT):
            for key, (path, tp) in _keys(hints[f.name]).items():
                out[key] = ((f.name, *path), tp)
        elif JOB_KEY not in f.metadata:
            out[f.name] = ((f.name,), hints[f.name])
    return out


def _field_types(section_cls) -> dict[str, Any]:
    return {key: tp for key, (_, tp) in _keys(section_cls).items()}


def section_dict(sec: Any) -> dict[str, Any]:
    """A section's keys and values, flat as in the TOML file."""
    out = {}
    for key, (path, _) in _keys(type(sec)).items():
        value = sec
        for name in path:
            value = getattr(value, name)
        out[key] = value
    return out


def _assign(sec: Any, key: str, value: Any) -> None:
    """Set `key` of section `sec`; a frozen settings object on the way (PlannerConfig) is
    replaced by a copy with the new value (checked with the whole config, validate_config)."""
    _replaced(sec, _keys(type(sec))[key][0], value)


def _replaced(obj: Any, path: tuple[str, ...], value: Any) -> Any:
    """`obj` with the attribute at `path` set to `value`: in place, or a copy where frozen."""
    if len(path) > 1:
        value = _replaced(getattr(obj, path[0]), path[1:], value)
    if getattr(type(obj), "__dataclass_params__", None) is not None and type(obj).__dataclass_params__.frozen:
        return dataclasses.replace(obj, **{path[0]: value})
    setattr(obj, path[0], value)
    return obj


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_name(args[0]) + (" or none" if type(None) in typing.get_args(tp) else "")
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false",
            list: "a list (TOML array)"}.get(tp, str(tp))


def _check_value(tp, value):
    """Return the value converted to ``tp`` or raise TypeError."""
    if typing.get_origin(tp) is typing.Union:
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in (a for a in typing.get_args(tp) if a is not type(None)):
            try:
                return _check_value(arg, value)
            except TypeError:
                continue
        raise TypeError
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list:
        if isinstance(value, list):
            return value
    raise TypeError


def _parse_cli_value(tp, text: str):
    """Parse a command-line string for a field of type ``tp`` (raise ValueError)."""
    if typing.get_origin(tp) is typing.Union:
        if text.lower() in ("none", "null", "") and type(None) in typing.get_args(tp):
            return None
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        for member in members[:-1]:  # the first member the text parses as (bool before str)
            try:
                return _parse_cli_value(member, text)
            except ValueError:
                continue
        tp = members[-1]
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    if tp is list:  # a TOML array, e.g. "[[0, 2048], [1000, 8192]]"
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            raise ValueError from None
    return text


# --------------------------------------------------------------------------- loading


def resolve_config_path(config: str) -> Path:
    """``NAME``, ``NAME.toml`` or a path -> an existing file (ConfigError otherwise)."""
    cand = [Path(config)]
    names = [config] if config.endswith(".toml") else [config + ".toml", config]
    for base in (Path("configs"), CONFIGS_DIR):
        cand += [base / n for n in names]
    if not config.endswith(".toml"):
        cand.append(Path(config + ".toml"))
    for p in cand:
        if p.is_file():
            return p
    known = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml")) if CONFIGS_DIR.is_dir() else []
    raise ConfigError(f"config '{config}' not found (looked for {config} and "
                      f"configs/{names[0]}); known configs: {', '.join(known) or 'none'}")


RENAMED = {("parallelism", "seed"): "split_seeding", ("parallelism", "seed_radius"): "split_seeding_radius",
           ("parallelism", "seed_rounds"): "split_seeding_rounds"}
"""Keys that were renamed (the split-dimension seeding, apart from [job] seed, the RNG's)."""

DEPRECATED = {("parallelism", "cluster_layers"): "repeated_blocks"}
"""Old keys that still work: each sets its new key, and loading says so in one line."""


def deprecated_key_note(section: str, key: str) -> str:
    """The one line loading logs for an old key of DEPRECATED."""
    return f"config: [{section}] {key} is now {DEPRECATED[(section, key)]}; the old key still works"


def _set(cfg: JobConfig, section: str, key: str, value, where: str, from_cli: bool,
         old_keys: Optional[set] = None) -> None:
    if (section, key) in DEPRECATED:  # the old name sets the new key; load_config says so once
        if old_keys is not None:
            old_keys.add((section, key))
        key = DEPRECATED[(section, key)]
    if (section, key) in RENAMED:
        new = RENAMED[(section, key)]
        raise ConfigError(f"{where}: '{section}.{key}' = {value!r}: renamed '{section}.{new}' (split-dimension "
                          f"seeding; [job] seed is the random seed); write {new} instead")
    if section not in SECTIONS:
        raise ConfigError(f"{where}: unknown section [{section}] (in '{section}.{key}' = "
                          f"{value!r}); known sections: {', '.join(SECTIONS)}")
    sec = getattr(cfg, section)
    types = _field_types(type(sec))
    if key not in types:
        raise ConfigError(f"{where}: unknown key '{section}.{key}' = {value!r}; "
                          f"keys of [{section}]: {', '.join(types)}")
    tp = types[key]
    try:
        if from_cli and isinstance(value, str):
            value = _parse_cli_value(tp, value)
        value = _check_value(tp, value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: '{section}.{key}' = {value!r} has the wrong type; "
                          f"expected {_type_name(tp)}") from None
    _assign(sec, key, value)


def parse_overrides(overrides) -> list[tuple[str, str, Optional[str]]]:
    """``["--a.b", "1", "--c.d=x", "--flag"]`` -> [(a, b, "1"), (c, d, "x"), (flag...)]."""
    out = []
    items = list(overrides)
    i = 0
    while i < len(items):
        arg = items[i]
        if not arg.startswith("--"):
            raise ConfigError(f"command line: unexpected argument {arg!r}; overrides look "
                              f"like --section.key value")
        body = arg[2:]
        if "=" in body:
            dotted, value = body.split("=", 1)
            i += 1
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            dotted, value = body, items[i + 1]
            i += 2
        else:  # bare flag: a boolean set to true
            dotted, value = body, None
            i += 1
        if "." not in dotted:
            raise ConfigError(f"command line: override {arg!r} must name a section and a "
                              f"key, like --training.steps 10")
        section, key = dotted.split(".", 1)
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
    return out


def load_config(config: Optional[str] = None, overrides=(), *,
                world_size: Optional[int] = None, validate: bool = True) -> JobConfig:
    """Load a TOML job (a path or a bare name under configs/), apply CLI overrides,
    validate. ``config=None`` starts from the defaults."""
    cfg = JobConfig()
    old_keys: set[tuple[str, str]] = set()
    if config is not None:
        path = resolve_config_path(config)
        cfg.source = str(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key '{section}' = {table!r} is not a "
                                  f"section; put keys under one of [{'], ['.join(SECTIONS)}]")
            if section not in SECTIONS:
                raise ConfigError(f"{path}: unknown section [{section}]; known sections: "
                                  f"{', '.join(SECTIONS)}")
            for key, value in table.items():
                _set(cfg, section, key, value, str(path), from_cli=False, old_keys=old_keys)
    for section, key, value in parse_overrides(overrides):
        where = f"{cfg.source} (command-line override --{section}.{key})"
        if value is None:
            # a bare flag: only booleans may omit the value
            sec = getattr(cfg, section, None)
            known = DEPRECATED.get((section, key), key)
            tp = _field_types(type(sec)).get(known) if sec is not None and section in SECTIONS else None
            if tp not in (bool, Optional[bool]) and sec is not None and tp is not None:
                raise ConfigError(f"{where}: '{section}.{key}' needs a value "
                                  f"({_type_name(tp)})")
            value = "true"
        _set(cfg, section, key, value, where, from_cli=True, old_keys=old_keys)
    for section, key in sorted(old_keys):
        logger.warning("%s", deprecated_key_note(section, key))
    ac = cfg.activation_checkpoint  # unset: the parallelism mode's default, made concrete once
    ac.mode = ac.resolved(cfg.parallelism.mode)
    if validate:
        validate_config(cfg, world_size=world_size)
    return cfg


# --------------------------------------------------------------------------- printing


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def dump_toml(d: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, table in d.items():
        lines.append(f"[{section}]")
        for key, v in table.items():
            if v is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)
