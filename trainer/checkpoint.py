"""Distributed checkpoints (DCP): model, optimizer, LR schedule, data-loader state, step.

Layout: ``<dump_folder>/<job.name>/<checkpoint.folder>/step-N``. A save writes into
``step-N.tmp``; after every rank has finished (DCP writes ``.metadata`` last, then a
barrier) each rank checksums the files it wrote, rank 0 writes ``manifest.json`` (every
file's size and xxh3 checksum, `trainer/checkpoint_files.py`) and renames the folder to
``step-N``. A process killed mid-save therefore leaves only a ``.tmp`` folder, which
restart ignores and deletes. A checkpoint whose files do not match its manifest (a shard
deleted, truncated or changed after the save), one without a manifest, and one that DCP
fails to load are skipped for the previous complete one, with one log line naming the
file and the reason; when no complete checkpoint is left the job stops (exit 2) naming
them, and nothing is deleted. Nothing from the folder runs code: the loader state is
JSON, the step and LR position plain ints, and DCP reads the folder through
`checkpoint_files` (``.metadata`` with an unpickler that admits DCP's classes only,
non-tensor items with ``weights_only=True``); a folder that needs more (a planted pickle,
the pickled loader state of older checkpoints) is refused with one line unless
``[checkpoint] trust_foreign = true``. Old checkpoints are renamed ``step-N.deleting`` before
they are deleted (after a newer one is complete on every rank), so a kill mid-deletion
never leaves a half-deleted folder that looks complete. A save that fails (a full disk, a
folder without write permission) stops the job with one error naming the folder and the
bytes it needed; the previous complete checkpoint stays the latest. Works with or without a
process group (single process).

``[checkpoint] async_mode = "async"``: DCP's ``async_save`` copies the state to CPU memory
before it returns (the next optimizer step cannot change what is saved) and writes it in a
background thread, over a gloo process group of its own (its collectives never interleave
with training's), while the next steps run. The save is made complete (manifest, rename,
pruning) only after its future has finished on every rank: at the start of the next save, at
the end of training, and when every rank stops on a training fault (a non-finite step). A
kill before then leaves only ``step-N.tmp``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from parallel import _torch as T

from .checkpoint_files import (
    MANIFEST,
    TRUST,
    UnsafeCheckpoint,
    damage,
    dcp_load,
    failure_reason,
    file_entry,
    read_metadata,
    unsafe_message,
    write_manifest,
)
from .config import Checkpoint
from .errors import ConfigError, TrainingFault
from .hf_checkpoint import write_model_hf_config
from .optim import lr_schedule_state, restore_lr_schedule

logger = logging.getLogger("autotitan")


STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""The optimizer's state and hyperparameters keyed by each parameter's name
(``param_groups.<name>.lr``): a pipeline's ranks hold different parameters, and a nested
``param_groups`` list, one object that DCP saves once, would keep only one rank's names."""


@contextlib.contextmanager
def _quiet():
    """Silence DCP's 'assuming the intent is to save in a single process' warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


_STEP_RE = re.compile(r"^step-(\d+)$")
_UNFINISHED_RE = re.compile(r"^step-\d+\.(tmp|deleting)$")
DELETING = ".deleting"
__all__ = ["MANIFEST", "CheckpointManager", "complete_checkpoints", "damage", "intact_checkpoints", "resume_step"]


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """{step: path} of finished checkpoints (renamed, with DCP's .metadata)."""
    out = {}
    if folder.is_dir():
        for p in folder.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir() and (p / ".metadata").is_file():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


_VERDICTS: dict[tuple[str, bool], tuple[Any, Optional[str]]] = {}
"""(path, trust_foreign) -> (the manifest's stat, what `damage` found): a checkpoint is read
for its checksums once per job start (`resume_step`, then `find`), not twice."""


def verdict(path: Path, trust_foreign: bool = False) -> Optional[str]:
    """`damage` of a complete checkpoint, checked on rank 0 (it reads every file) and broadcast:
    every rank takes the same decision. Call it on every rank."""
    try:
        st = (path / MANIFEST).stat()
        stamp: Any = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    key = (str(path), trust_foreign)
    if key in _VERDICTS and _VERDICTS[key][0] == stamp:
        return _VERDICTS[key][1]
    why = damage(path, trust_foreign) if _rank() == 0 else None
    if _dist():
        box = [why]
        dist.broadcast_object_list(box, src=0)
        why = box[0]
    _VERDICTS[key] = (stamp, why)
    if why is not None and _rank() == 0:
        logger.warning(f"skipping damaged checkpoint {path}: {why}")
    return why


def intact_checkpoints(folder: Path, log: bool = False, trust_foreign: bool = False) -> dict[int, Path]:
    """Complete checkpoints whose files match their manifests (each one read: `choose` stops at
    the newest intact one). `log`: kept for callers; damaged ones are logged once each."""
    return {step: path for step, path in complete_checkpoints(folder).items() if verdict(path, trust_foreign) is None}


def _no_usable(folder: Path, skipped: dict[int, str]) -> ConfigError:
    why = "; ".join(f"step-{s}: {r}" for s, r in sorted(skipped.items(), reverse=True)[:3])
    return ConfigError(f"no usable checkpoint in {folder} ({why}); nothing was deleted; to start fresh move them "
                       "away (or use another job.name or checkpoint.folder), or resume one with "
                       "'checkpoint.load_step' = N")


def choose(ckpt_cfg: Checkpoint, folder: Path, below: Optional[int] = None,
           skipped: Optional[dict[int, str]] = None) -> Optional[Path]:
    """The checkpoint to resume from: ``load_step`` when set (a damaged one is a ConfigError),
    else the newest intact one (below step `below`: after a failed load); None when there are no
    complete checkpoints. Complete ones that are all damaged (or failed, in `skipped`) are a
    ConfigError naming them: the job does not silently start over. Call it on every rank."""
    done = complete_checkpoints(folder)
    skipped = dict(skipped or {})
    trust = ckpt_cfg.trust_foreign
    if ckpt_cfg.load_step >= 0:
        step = ckpt_cfg.load_step
        if step not in done:
            raise ConfigError(f"'checkpoint.load_step' = {step}: there is no complete checkpoint step-{step} in "
                              f"{folder} (have: {', '.join(map(str, done)) or 'none'}); set load_step to one of "
                              "them, or -1 for the newest intact one")
        why = skipped.get(step) or verdict(done[step], trust)
        if why is not None:
            raise ConfigError(f"'checkpoint.load_step' = {step}: {why}; nothing was deleted; set load_step to another "
                              f"checkpoint (have: {', '.join(map(str, done))}), or -1 for the newest intact one")
        return done[step]
    for step in sorted(done, reverse=True):
        if below is not None and step >= below:
            continue
        why = skipped.get(step) or verdict(done[step], trust)
        if why is None:
            return done[step]
        skipped[step] = why
    if skipped:
        raise _no_usable(folder, skipped)
    return None


def resume_step(ckpt_cfg: Checkpoint, folder: Path) -> int:
    """The step a job will resume at (0: none, or checkpointing off), known before the model
    is built: a scheduled sequence length and the plan for it depend on it."""
    if not ckpt_cfg.enable:
        return 0
    path = choose(ckpt_cfg, Path(folder))
    return int(_STEP_RE.match(path.name).group(1)) if path is not None else 0


@dataclass
class _PendingSave:
    """An async save whose files are still being written (this rank's part)."""

    step: int
    tmp: Path
    future: Future
    need: int  # bytes of this rank's state (for a failed write's message)


class CheckpointManager:
    """Saves and restores the whole training state as DCP folders (see the module doc)."""

    def __init__(self, ckpt_cfg: Checkpoint, folder: Path, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, lr_scheduler: LambdaLR, dataloader: Any, dp_rank: int = 0,
                 timeout_s: float = 600.0):
        self.cfg = ckpt_cfg
        self.folder = Path(folder)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.dp_rank = dp_rank
        self.enabled = ckpt_cfg.enable
        self.async_save = ckpt_cfg.async_mode == "async"
        self._pending: Optional[_PendingSave] = None
        # async saves run their collectives on a group of their own (gloo: CPU tensors), as TorchTitan does
        self._pg = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
                    if self.enabled and self.async_save and _dist() else None)
        if self.enabled and self.async_save and not _dist():
            # the background thread's save warns "assuming a single process": that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    # ------------------------------------------------------------------ state

    def _state(self, step: int) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": lr_schedule_state(self.lr_scheduler),
            # one entry per data-parallel rank (ranks read different slices), as JSON text
            "dataloader": {f"dp_rank_{self.dp_rank}": _loader_json(self.dataloader.state_dict())},
            "train_state": {"step": step},
        }

    # ------------------------------------------------------------------ save

    def should_save(self, step: int, last_step: int) -> bool:
        """Every ``interval`` steps and at the last step, when enabled."""
        return self.enabled and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, step: int) -> Path:
        """Write ``step-N.tmp`` on every rank, then rank 0 writes the manifest and renames it:
        only complete checkpoints ever carry the final name. Async mode: the state is staged and
        its write started; it is completed by the next ``save`` or ``wait``."""
        self.wait()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        _barrier()
        state = self._state(step)
        try:
            with _quiet():
                if self.async_save:
                    future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._pg)
                    self._pending = _PendingSave(step, tmp, future, _state_bytes(state))
                    return final
                dcp.save(state, checkpoint_id=str(tmp))
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's write errors
            raise self._save_failed(step, tmp, _state_bytes(state), e) from None
        return self._complete(step, tmp)

    def wait(self) -> Optional[Path]:
        """Finish the pending async save (None: there is none): wait for this rank's write, then
        complete it on every rank. Called before the next save and at the end of training."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.future.result()
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's write errors
            raise self._save_failed(pending.step, pending.tmp, pending.need, e) from None
        return self._complete(pending.step, pending.tmp)

    def abandon(self) -> None:
        """Training ended on an error: let this rank's write of a pending async save end (its
        folder stays ``step-N.tmp``, never complete), so that no thread still uses the process
        groups when they are destroyed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.future.result()

    def _complete(self, step: int, tmp: Path) -> Path:
        """Every rank has written its part of ``tmp``: rank 0 writes the manifest, renames it to
        ``step-N`` and prunes old checkpoints."""
        final = self.folder / f"step-{step}"
        _barrier()  # every rank has written its files and .metadata exists
        sums = _own_checksums(tmp)  # each rank reads back what it wrote (still in the page cache)
        if _dist():
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, sums)
            sums = {k: v for d in every for k, v in d.items()}
        if _rank() == 0:
            write_model_hf_config(tmp, self.model)  # what convert_hf.py to-hf needs (models with an HF export)
            write_manifest(tmp, sums)  # the other files (.metadata, hf_config.json) checksummed here
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        logger.info(f"saved checkpoint {final}")
        return final

    def _save_failed(self, step: int, tmp: Path, need: int, error: Exception) -> TrainingFault:
        """A save that could not be written: the folder, the cause, the bytes it needed (`need`:
        this rank's); the half-written folder removed, the previous complete checkpoint left the latest."""
        if _dist():
            t = torch.tensor([need], dtype=torch.float64)
            with contextlib.suppress(Exception):
                dist.all_reduce(t)
                need = int(t.item())
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = complete_checkpoints(self.folder)
        latest = f"{prev[max(prev)]} stays the latest" if prev else "there is no earlier checkpoint"
        cause = _os_cause(error)
        return TrainingFault(f"step {step}: the checkpoint could not be written to {self.folder} ({cause}); it needs "
                             f"about {need / 2**20:,.1f} MiB; {latest}; free space or give the folder write "
                             "permission (or point job.dump_folder elsewhere), then run the same command to resume")

    def _prune(self) -> None:
        """Keep the newest ``keep_latest_k`` (called once a newer checkpoint is complete on every
        rank); each old one is renamed away first, so a kill mid-delete never leaves a
        half-deleted folder that looks complete."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        done = complete_checkpoints(self.folder)
        for step in list(done)[:-k]:
            gone = done[step].with_name(done[step].name + DELETING)
            os.replace(done[step], gone)
            shutil.rmtree(gone, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def clean_incomplete(self) -> None:
        """Delete the trainer's own unfinished folders, ``step-N.tmp`` and ``step-N.deleting``
        (rank 0), then barrier. Nothing else in the folder is touched: the run folder's lock keeps
        another job's unfinished saves out of it, and other names are not ours to delete."""
        if _rank() == 0 and self.folder.is_dir():
            for p in self.folder.iterdir():
                if p.is_dir() and _UNFINISHED_RE.match(p.name):
                    logger.warning(f"removing incomplete checkpoint {p}")
                    shutil.rmtree(p, ignore_errors=True)
        _barrier()

    def set_aside(self, path: Path, why: str) -> Path:
        """Rename a checkpoint out of the way (``step-N.<why>``, numbered when taken; rank 0 on
        the shared folder, every rank past the barrier sees it): kept for inspection, never
        resumed or pruned."""
        target = path.with_name(f"{path.name}.{why}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.{why}-{n}")
        if _rank() == 0:
            os.replace(path, target)
        _barrier()
        return target

    def _abandon_newer(self, step: int) -> None:
        """A rollback (``load_step``) to `step`: newer complete checkpoints belong to the run
        being abandoned; they are moved aside (``step-N.abandoned``) so that pruning and a later
        plain restart only see the new run's."""
        for newer, path in complete_checkpoints(self.folder).items():
            if newer > step:
                moved = self.set_aside(path, "abandoned")
                if _rank() == 0:
                    logger.warning(f"rolled back to step {step}: moved the newer checkpoint {path} to {moved}")

    def find(self, below: Optional[int] = None, skipped: Optional[dict[int, str]] = None) -> Optional[Path]:
        """The checkpoint to resume from: ``load_step`` when set, else the newest intact one
        (damaged ones are skipped, saying which file is wrong; see `choose`)."""
        return choose(self.cfg, self.folder, below, skipped)

    def maybe_load(self) -> int:
        """Load the latest intact checkpoint (or ``load_step``); return its step (0 when there is
        none or checkpointing is off). One that DCP fails to read is skipped for the previous one,
        with one line saying why (every rank sees the same failure: DCP gathers them)."""
        if not self.enabled:
            return 0
        self.clean_incomplete()
        path = self.find()
        while path is not None:
            try:
                step = self.load(path)
            except _LoadFailed as e:
                if self.cfg.load_step >= 0:  # the step asked for: not replaced by another
                    raise ConfigError(f"'checkpoint.load_step' = {self.cfg.load_step}: {path} could not be loaded "
                                      f"({e}); nothing was renamed or deleted; set load_step to another "
                                      "checkpoint, or -1 for the newest that loads") from None
                corrupt = self.set_aside(path, "corrupt")
                if _rank() == 0:
                    logger.warning(f"skipping checkpoint {path}: it could not be loaded ({e}); renamed to "
                                   f"{corrupt.name}, the previous complete checkpoint is used")
                path = self.find()
                continue
            if self.cfg.load_step >= 0:
                self._abandon_newer(step)
            return step
        return 0

    def load(self, path: Path) -> int:
        """Restore everything from ``path`` (resharding if the layout changed); return its step.
        A folder that would run code is a ConfigError; one DCP cannot read, `_LoadFailed`."""
        trust = self.cfg.trust_foreign
        state = self._state(0)
        dl_key = f"dp_rank_{self.dp_rank}"
        meta = _agreed(lambda: read_metadata(path, trust).state_dict_metadata)  # every rank, or none, goes on
        have_dl = f"dataloader.{dl_key}" in meta
        if not have_dl:
            state.pop("dataloader")
        _check_matches(path, state, meta)
        _agreed(lambda: dcp_load(state, path, trust))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=STATE_OPTIONS)
        restore_lr_schedule(self.lr_scheduler, state["lr_scheduler"])
        step = int(state["train_state"]["step"])
        if have_dl:
            self.dataloader.load_state_dict(_loader_state(path, state["dataloader"][dl_key], trust))
        else:
            # a different data-parallel layout: position the sampler by step instead
            logger.warning(f"{path} has no data-loader state for dp rank {self.dp_rank}; "
                           f"skipping to global batch {step}")
            self.dataloader.batch_sampler.skip_to(step)
        logger.info(f"resumed from {path} at step {step}")
        return step


class _LoadFailed(Exception):
    """DCP could not read a checkpoint (the message: the first rank's error, one line)."""


def _agreed(read: Any) -> Any:
    """`read()` on every rank, then agreed: when it failed on any rank, every rank raises the
    first failing rank's error (a ConfigError for a folder that would run code, else
    `_LoadFailed`), so no rank goes on into a collective the others never reach."""
    result, error = None, None
    try:
        result = read()
    except UnsafeCheckpoint as e:
        error = ("config", unsafe_message(e))
    except ConfigError as e:
        error = ("config", str(e))
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP wraps every rank's read errors
        error = ("load", failure_reason(e))
    errors = [error]
    if _dist():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise (ConfigError if first[0] == "config" else _LoadFailed)(first[1])
    return result


def _loader_json(state: dict) -> str:
    """The data loader's state as JSON text (ints, strings, None: what it is made of)."""
    text = json.dumps(state, sort_keys=True)
    if json.loads(text) != state:
        raise TypeError(f"the data loader's state does not survive JSON: {state!r}")
    return text


def _loader_state(path: Path, value: Any, trust_foreign: bool) -> dict:
    """A checkpoint's loader state: JSON text; bytes are the pickled state of older checkpoints,
    unpickled only with ``trust_foreign`` (a pickle can run code)."""
    if isinstance(value, str):
        return json.loads(value)
    if isinstance(value, bytes) and trust_foreign:
        return pickle.loads(value)
    what = "stored with pickle (a checkpoint of an older autotitan)" if isinstance(value, bytes) else \
        f"a {type(value).__name__}, not JSON text"
    raise ConfigError(f"{path}: the data-loader state is {what}; unpickling it could run code, so it was refused "
                      f"(nothing was deleted); if this is your own checkpoint, set {TRUST}")


def _own_checksums(folder: Path) -> dict[str, dict]:
    """Manifest entries of the shard files this rank wrote (DCP names them ``__<rank>_<i>.distcp``)."""
    mine = re.compile(rf"^__{_rank()}_\d+\.distcp$")
    return {f.name: file_entry(f) for f in sorted(folder.iterdir()) if f.is_file() and mine.match(f.name)}


def _state_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a state dict (what its part of a checkpoint holds)."""
    total = 0
    for x in T.tree_flatten(state)[0]:
        if isinstance(x, torch.Tensor):
            local = x.to_local() if isinstance(x, DTensor) else x
            total += local.numel() * local.element_size()
        elif isinstance(x, bytes):
            total += len(x)
    return total


def _os_cause(error: BaseException) -> str:
    """The operating system's words for a failed write, found in DCP's wrapped errors."""
    text = str(error)
    for code in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
        if os.strerror(code) in text:
            return os.strerror(code).lower()
    return text.strip().splitlines()[-1][:200] if text.strip() else type(error).__name__


def _check_matches(path: Path, state: dict, meta: dict) -> None:
    """A checkpoint of another model (other names or shapes) is one error naming the first
    mismatches, before DCP reads a byte."""
    want = {f"model.{k}": tuple(v.shape) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    have = {k: tuple(getattr(m, "size", ())) for k, m in meta.items() if k.startswith("model.")}
    missing = [k for k in want if k not in have]
    shapes = [f"{k} {list(have[k])} (this model: {list(want[k])})" for k in want if k in have and have[k] != want[k]]
    if missing or shapes:
        first = (missing[:3] and [f"missing {', '.join(m[6:] for m in missing[:3])}"]) + shapes[:3]
        more = " ..." if len(missing) + len(shapes) > 6 else ""
        raise ConfigError(f"checkpoint {path} was written by another model: {'; '.join(first)}{more}; resume it "
                          "with the model that wrote it, or start fresh in another folder (job.name, job.dump_folder "
                          "or checkpoint.folder)")

