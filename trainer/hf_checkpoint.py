"""Hugging Face weights in and out of a job: `[checkpoint] initial_load_path` (+ `initial_load_in_hf`)
and `last_save_in_hf`; also the file side of `scripts/convert_hf.py`.

Loading goes through DCP into the model's own (DTensor) state dict, so every rank reads only
its shards, in manual and auto mode and on any world size: an HF folder with torch's
`HuggingFaceStorageReader` (safetensors slices), a DCP folder (`convert_hf.py to-dcp`) with the
default reader. Saving gathers the full state dict on rank 0 (torch's `full_state_dict`
option), which writes the safetensors shards into a temporary folder and renames it: a
failed or killed export leaves no half-written folder under the final name. Names, config
translation and the RoPE layout are `models/hf.py`'s.

A DCP folder (`initial_load_path`, `dcp_to_hf`) is someone else's: it is checked against its
`manifest.json` when it has one, and read without running code from it (`checkpoint_files`);
a folder that would is refused with one line unless `trust_foreign`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from models import MODEL_SPECS, get_model_spec, model_args
from models.hf import (
    HF_ARCHITECTURES,
    HFConfigError,
    HFTensors,
    args_from_hf_config,
    args_overrides_from_hf,
    from_hf_key,
    hf_config_from_args,
    hf_skipped,
    hf_tensor_map,
)
from models.hf_deepseek_v3 import with_optional_keys
from models.hf_experts import is_stacked_experts, stack_experts
from models.layers import ArgError

from .checkpoint_files import (
    TRUST,
    UnsafeCheckpoint,
    damage,
    dcp_load,
    read_metadata,
    unsafe_message,
    write_manifest,
)
from .errors import ConfigError
from .hf_experts import ExpertSlicePlanner, hf_load_entries

HF_CONFIG_FILE = "hf_config.json"
"""The HF config inside a DCP folder written by `convert_hf.py to-dcp`: `to-hf` needs nothing else."""
MAX_SHARD_BYTES = 4 * 2**30
HF_MODELS = set(HF_ARCHITECTURES.values())
_FIRST = 3  # mismatches named in an error


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------- config


def read_hf_config(folder: Path | str) -> dict[str, Any]:
    """`config.json` of an HF folder (or `hf_config.json` of one of our DCP folders)."""
    folder = Path(folder)
    for name in ("config.json", HF_CONFIG_FILE):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    raise FileNotFoundError(f"{folder} has no config.json (nor {HF_CONFIG_FILE})")


def _key(cfg: Any) -> str:
    return f"{cfg.source}: 'checkpoint.initial_load_path' = {cfg.checkpoint.initial_load_path!r}"


def initial_arg_overrides(cfg: Any) -> dict[str, Any]:
    """The start checkpoint's non-shape model arguments (RoPE base and scaling, norm eps) over
    the flavor's; {} without an initial load or HF config. A missing folder or an HF config of
    another architecture is a ConfigError (checked when the model is built, before any read)."""
    ck = cfg.checkpoint
    if ck.last_save_in_hf and cfg.model.name not in HF_MODELS:
        raise ConfigError(f"{cfg.source}: 'checkpoint.last_save_in_hf' = true: model {cfg.model.name!r} has no "
                          f"Hugging Face export (supported: {sorted(HF_MODELS)}); set it false")
    if ck.initial_load_in_hf and not ck.initial_load_path:
        raise ConfigError(f"{cfg.source}: 'checkpoint.initial_load_in_hf' = true without "
                          "'checkpoint.initial_load_path'; give the HF folder to start from")
    path = ck.initial_load_path
    if not path:
        return {}
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{_key(cfg)}: no such folder; give an HF safetensors folder (initial_load_in_hf = true) "
                          "or a DCP folder (scripts/convert_hf.py to-dcp)")
    if not ck.initial_load_in_hf and not (folder / ".metadata").is_file():
        is_hf = (folder / "config.json").is_file()
        hint = " (it has config.json: set checkpoint.initial_load_in_hf = true)" if is_hf else ""
        raise ConfigError(f"{_key(cfg)}: not a DCP checkpoint folder (no .metadata){hint}")
    if ck.initial_load_in_hf and not any(folder.glob("*.safetensors")):
        raise ConfigError(f"{_key(cfg)}: no .safetensors files; give a Hugging Face checkpoint folder")
    try:
        hf_cfg = read_hf_config(folder)
    except FileNotFoundError as e:
        if cfg.checkpoint.initial_load_in_hf:
            raise ConfigError(f"{_key(cfg)}: {e}; an HF checkpoint folder has config.json next to its "
                              "safetensors") from None
        return {}
    try:
        name, _ = args_from_hf_config(hf_cfg)
    except (HFConfigError, KeyError) as e:
        raise ConfigError(f"{_key(cfg)}: {e}; convert a supported checkpoint") from None
    if name != cfg.model.name:
        raise ConfigError(f"{_key(cfg)}: a {hf_cfg['architectures'][0]} checkpoint ({name}), but model.name = "
                          f"{cfg.model.name!r}; set model.name = {name!r}")
    overrides = args_overrides_from_hf(hf_cfg)
    try:  # the checkpoint's routing on the flavor's shape (the job's [model] keys win)
        model_args(name, cfg.model.flavor, **{**overrides, **cfg.model.arg_overrides()})
    except ArgError as e:
        raise ConfigError(f"{_key(cfg)}: its config's routing does not fit {_flavor(cfg)}: {e}; set the model's "
                          "shape to the checkpoint's ([model] keys)") from None
    return overrides


# ---------------------------------------------------------------------------------- checks


def mismatches(want: dict[str, tuple], have: dict[str, tuple]) -> list[str]:
    """The first differences between a model's {name: shape} and a checkpoint's."""
    missing = [k for k in want if k not in have]
    shapes = [f"{k} {list(have[k])} (this model: {list(want[k])})" for k in want if k in have and have[k] != want[k]]
    extra = [k for k in have if k not in want]
    out = []
    if missing:
        out.append(f"missing {', '.join(missing[:_FIRST])}" + (" ..." if len(missing) > _FIRST else ""))
    out += shapes[:_FIRST]
    if extra:
        out.append(f"unexpected {', '.join(extra[:_FIRST])}" + (" ..." if len(extra) > _FIRST else ""))
    return out


def _check(path: Path, what: str, want: dict[str, tuple], have: dict[str, tuple]) -> None:
    bad = mismatches(want, have)
    if bad:
        raise ConfigError(f"checkpoint {path} does not match {what}: {'; '.join(bad)}; load it with the model "
                          "and flavor that wrote it (or its [model] arguments)")


def _flavor(cfg: Any) -> str:
    over = cfg.model.arg_overrides()
    extra = f" with {over}" if over else ""
    return f"model {cfg.model.name}/{cfg.model.flavor}{extra}"


# ---------------------------------------------------------------------------------- load


def hf_tensor_shapes(folder: Path) -> dict[str, tuple]:
    """{HF name: shape} of every tensor in a folder's safetensors files (headers only)."""
    out: dict[str, tuple] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = tuple(st.get_slice(k).get_shape())
    return out


def load_initial(model: torch.nn.Module, cfg: Any) -> None:
    """Load `[checkpoint] initial_load_path` into the (parallelized) model in place: each rank
    reads its shards only. Names or shapes that differ from the model are one ConfigError
    naming the first mismatches and the model's flavor, before a tensor is read."""
    folder = Path(cfg.checkpoint.initial_load_path)
    sd = get_model_state_dict(model)
    try:
        if cfg.checkpoint.initial_load_in_hf:
            hf_cfg = read_hf_config(folder)
            tmap = hf_tensor_map(cfg.model.name, model.args, {k: tuple(v.shape) for k, v in sd.items()}, hf_cfg)
            load_hf_into(sd, folder, _flavor(cfg), tmap)
        else:
            load_dcp_model(sd, folder, _flavor(cfg), cfg.checkpoint.trust_foreign)
    except ConfigError as e:
        raise ConfigError(f"{_key(cfg)}: {e}") from None
    set_model_state_dict(model, sd)


def _trusted_metadata(folder: Path, trust_foreign: bool, override: str) -> dict:
    """A foreign DCP folder's metadata, after its manifest (if it has one) is checked; a damaged
    or unsafe folder is a ConfigError naming the file and `override` (the flag that loads it)."""
    why = damage(folder, trust_foreign, manifest_optional=True)
    if why is not None:
        raise ConfigError(f"{why}; nothing was loaded; get an intact copy (or, if you trust it as it is, remove its "
                          f"manifest.json and {override})")
    try:
        return read_metadata(folder, trust_foreign).state_dict_metadata
    except UnsafeCheckpoint as e:
        raise ConfigError(unsafe_message(e, override)) from None


def load_dcp_model(sd: dict[str, torch.Tensor], folder: Path, what: str, trust_foreign: bool = False,
                   override: str = f"set {TRUST}") -> dict:
    """Fill our model state dict `sd` from a DCP folder's `model.*` items (checked against the
    manifest, names and shapes first; no code run from the folder unless `trust_foreign`);
    returns the folder's metadata."""
    meta = _trusted_metadata(folder, trust_foreign, override)
    have = {k[len("model."):]: tuple(m.size) for k, m in meta.items() if k.startswith("model.")}
    _check(folder, what, {k: tuple(v.shape) for k, v in sd.items()}, have)
    _load_model_items(sd, folder, trust_foreign, override)
    return meta


def _load_model_items(sd: dict[str, torch.Tensor], folder: Path, trust_foreign: bool, override: str) -> None:
    try:
        dcp_load({"model": sd}, folder, trust_foreign)
    except UnsafeCheckpoint as e:
        raise ConfigError(unsafe_message(e, override)) from None


def load_hf_into(sd: dict[str, torch.Tensor], folder: Path, what: str,
                 tmap: Optional[dict[str, HFTensors]] = None) -> None:
    """Fill our state dict `sd` (plain or DTensor values) from an HF safetensors folder by `tmap`
    (`models.hf.hf_tensor_map`; default: LLaMA 3 / Qwen3 names). Tensors stored as they are go
    through DCP's HF reader (each rank reads its shards), and so do stacked experts stored one HF
    tensor per expert (each rank reads the experts it holds: trainer/hf_experts.py); other
    transformed ones (DeepSeek-V3's RoPE rows, a gate with its bias) are read whole, one of ours at
    a time, and each rank keeps its shard. A tied
    checkpoint without `lm_head.weight` fills `output` from the embedding."""
    hf_cfg = read_hf_config(folder)
    tmap = tmap if tmap is not None else hf_tensor_map("llama3", None, {k: tuple(v.shape) for k, v in sd.items()})
    name = HF_ARCHITECTURES.get((hf_cfg.get("architectures") or [None])[0], "")
    have = {k: v for k, v in hf_tensor_shapes(folder).items() if not hf_skipped(name, k, hf_cfg)}
    tied = hf_cfg.get("tie_word_embeddings", False) and "lm_head.weight" not in have
    entries = {k: e for k, e in tmap.items() if k in sd and not (tied and k == "output.weight")}
    _check(folder, what, {hk: shape for e in entries.values() for hk, shape in zip(e.keys, e.shapes)}, have)
    # stacked experts as they are stored (one HF tensor per expert): each rank reads its experts only
    experts = {k: sd[k] for k, e in entries.items() if not e.direct and is_stacked_experts(k)}
    expert_sd, boxes = hf_load_entries(experts, ())
    reader = dcp.HuggingFaceStorageReader(str(folder))
    with _quiet():
        dcp.load({**{e.keys[0]: sd[k] for k, e in entries.items() if e.direct}, **expert_sd}, storage_reader=reader,
                 planner=ExpertSlicePlanner(boxes) if boxes else None)
        if tied:
            dcp.load({"model.embed_tokens.weight": sd["output.weight"]},
                     storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    files = _key_files(folder)
    for k, e in entries.items():
        if not e.direct and k not in experts:
            try:
                full = e.join([_read_full(files, hk) for hk in e.keys])
            except HFConfigError as err:
                raise ConfigError(f"{folder}: {err}") from None
            _fill(sd[k], full)


def _key_files(folder: Path) -> dict[str, Path]:
    """{HF tensor name: the safetensors file holding it}."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: f for k in st.keys()})
    return out


def _read_full(files: dict[str, Path], key: str) -> torch.Tensor:
    with safe_open(str(files[key]), framework="pt") as st:
        return st.get_tensor(key)


@torch.no_grad()
def _fill(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into `dst`: all of it, or a DTensor's local shard (cut on this rank)."""
    if isinstance(dst, DTensor):
        full = full.to(device=dst.to_local().device, dtype=dst.dtype)
        local = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        dst.to_local().copy_(local)
    else:
        dst.copy_(full)


def read_hf_folder(folder: Path | str) -> tuple[str, Any, dict[str, Any], dict[str, torch.Tensor]]:
    """(model name, args, HF config, our full state dict) of an HF folder, in one process
    (`convert_hf.py to-dcp`, tests); checked against the model the config describes."""
    folder = Path(folder)
    hf_cfg = read_hf_config(folder)
    name, args = args_from_hf_config(hf_cfg)
    with torch.device("meta"):
        model = get_model_spec(name).model_cls(args)
    tmap = hf_tensor_map(name, args, {k: tuple(v.shape) for k, v in model.state_dict().items()}, hf_cfg)
    sd = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items() if k in tmap}
    load_hf_into(sd, folder, f"the {name} model its config.json describes", tmap)
    return name, args, hf_cfg, sd


# ---------------------------------------------------------------------------------- save


def write_hf_folder(tensors: dict[str, torch.Tensor], hf_cfg: dict[str, Any], out: Path | str,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write HF-named full tensors and `config.json` as a safetensors folder (one file, or shards
    with `model.safetensors.index.json`): into `OUT.tmp`, renamed to `OUT` once complete."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        t = t.detach().contiguous().cpu()
        # an expert's slice of a stacked tensor shares its storage, which safetensors refuses
        shards[-1][k] = t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
        size += nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, shard in zip(files, shards):
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: f for f, s in zip(files, shards) for k in s}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    _replace(tmp, out)
    return out


def check_destination(src: Path | str, dst: Path | str, overwrite: bool) -> None:
    """A conversion's destination: one that exists with files in it, or that overlaps the source
    (is it, holds it, or lies inside it), is replaced only with `overwrite` (a ConfigError naming
    it and ``--overwrite`` otherwise; nothing is deleted)."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if overwrite:
        return
    if dst == src or src in dst.parents or dst in src.parents:
        how = "is" if dst == src else "lies inside" if src in dst.parents else "holds"
        raise ConfigError(f"{dst}: the destination {how} the source {src}; writing it would replace the source; "
                          "choose a destination outside it (or pass --overwrite to replace it anyway)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(f"{dst}: the destination exists and is not empty; nothing was changed; choose a new "
                          "folder, or pass --overwrite to replace it")


def _replace(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`; an older `out` is renamed away first and deleted after."""
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def to_hf_tensors(sd: dict[str, torch.Tensor], hf_cfg: Optional[dict[str, Any]] = None) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF tensors (buffers without an HF name dropped) for the model of
    `hf_cfg` (default: LLaMA 3 / Qwen3 names one to one, stacked experts one tensor each)."""
    name, args = args_from_hf_config(hf_cfg) if hf_cfg is not None else ("llama3", None)
    tmap = hf_tensor_map(name, args, {k: tuple(v.shape) for k, v in sd.items()}, hf_cfg)
    out: dict[str, torch.Tensor] = {}
    for k, e in tmap.items():
        out.update(zip(e.keys, [sd[k]] if e.direct else e.split(sd[k])))
    return out


def from_hf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> ours (one tensor per expert stacked back into ours)."""
    return {from_hf_key(k) if k in tensors else k: v for k, v in stack_experts(tensors).items()}


def save_hf(model: torch.nn.Module, hf_cfg: dict[str, Any], out: Path | str) -> Optional[Path]:
    """Export the (parallelized) model as an HF folder: gathered on rank 0 (every rank takes
    part), written there; returns the folder on rank 0, None elsewhere."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model, options=opts)
    path = None
    if _rank() == 0:
        tensors = to_hf_tensors(sd, hf_cfg)
        dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        path = write_hf_folder(tensors, {**hf_cfg, "dtype": dtype, "torch_dtype": dtype}, out)
    _barrier()
    return path


def export_hf_config(cfg: Any, args: Any) -> dict[str, Any]:
    """The HF config of a job's export: the start checkpoint's (other entries kept) with the
    model's arguments, or one made from the arguments alone."""
    base = None
    if cfg.checkpoint.initial_load_path:
        with contextlib.suppress(FileNotFoundError):
            base = read_hf_config(cfg.checkpoint.initial_load_path)
    try:
        return hf_config_from_args(cfg.model.name, args, base)
    except HFConfigError as e:
        raise ConfigError(f"{cfg.source}: 'checkpoint.last_save_in_hf' = true: {e}") from None


def model_hf_config(model: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The HF config of a model that has an HF map (None otherwise), from its arguments."""
    args = getattr(model, "args", None)
    names = [s.name for s in MODEL_SPECS.values() if type(args) is s.args_cls and s.name in HF_MODELS]
    try:
        return hf_config_from_args(names[0], args) if names else None
    except HFConfigError:  # a configuration with no HF equivalent (DeepSeek-V3 with softmax routing)
        return None


def write_model_hf_config(folder: Path, model: torch.nn.Module) -> None:
    """`hf_config.json` in a DCP checkpoint folder, so that `convert_hf.py to-hf` needs nothing else."""
    hf_cfg = model_hf_config(model)
    if hf_cfg is not None:
        (folder / HF_CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2))


# ---------------------------------------------------------------------------------- conversion


def hf_to_dcp(hf_dir: Path | str, dcp_dir: Path | str, overwrite: bool = False) -> Path:
    """An HF folder as a DCP folder of our names (`model.<name>`) with the HF config inside
    (`hf_config.json`); written as `DCP_DIR.tmp`, renamed once complete. An existing or
    overlapping `dcp_dir` is replaced only with `overwrite` (`check_destination`)."""
    hf_dir, out = Path(hf_dir), Path(dcp_dir)
    check_destination(hf_dir, out, overwrite)
    try:
        name, args, hf_cfg, sd = read_hf_folder(hf_dir)
    except (HFConfigError, KeyError) as e:
        raise ConfigError(f"{hf_dir}/config.json: {e}") from None
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet():
        dcp.save({"model": sd}, checkpoint_id=str(tmp))
    (tmp / HF_CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2))
    write_manifest(tmp, {})  # its files' checksums: checked when it is loaded
    _replace(tmp, out)
    return out


def dcp_to_hf(dcp_dir: Path | str, hf_dir: Path | str, trust_foreign: bool = False, overwrite: bool = False) -> Path:
    """A DCP folder with `hf_config.json` (`to-dcp`'s, or a training checkpoint's) as an
    HF folder; its names and shapes are checked against the model the config describes, its
    files against its manifest (when it has one), and no code runs from it unless `trust_foreign`
    (`convert_hf.py to-hf --trust-foreign`). An existing or overlapping `hf_dir` is replaced
    only with `overwrite` (`check_destination`)."""
    src = Path(dcp_dir)
    check_destination(src, hf_dir, overwrite)
    if not (src / HF_CONFIG_FILE).is_file():
        raise ConfigError(f"{src}: no {HF_CONFIG_FILE} (the HF config that to-dcp's folders and the training "
                          f"checkpoints of {', '.join(sorted(HF_MODELS))} carry; DeepSeek-V3 with sigmoid routing): "
                          "not such a DCP folder; give one of those")
    hf_cfg = json.loads((src / HF_CONFIG_FILE).read_text())
    try:
        name, args = args_from_hf_config(hf_cfg)
    except (HFConfigError, KeyError) as e:
        raise ConfigError(f"{src / HF_CONFIG_FILE}: {e}") from None
    override = "pass --trust-foreign to convert_hf.py to-hf"
    meta = _trusted_metadata(src, trust_foreign, override)
    have = {k[len("model."):]: tuple(m.size) for k, m in meta.items() if k.startswith("model.")}
    if name == "deepseek_v3":  # a checkpoint of a model without expert bias: exported as zeros
        args = with_optional_keys(args, set(have))
    with torch.device("meta"):
        model = get_model_spec(name).model_cls(args)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = {k: shapes[k] for k in hf_tensor_map(name, args, shapes, hf_cfg)}
    _check(src, f"the {name} model its {HF_CONFIG_FILE} describes", want, have)
    sd = {k: torch.empty(shape, dtype=meta[f"model.{k}"].properties.dtype) for k, shape in want.items()}
    _load_model_items(sd, src, trust_foreign, override)
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    hf_cfg = {**hf_config_from_args(name, args, hf_cfg), "dtype": dtype, "torch_dtype": dtype}
    return write_hf_folder(to_hf_tensors(sd, hf_cfg), hf_cfg, hf_dir)
