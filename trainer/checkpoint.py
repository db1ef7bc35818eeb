"""Distributed checkpoints (DCP): model, optimizer, LR schedule, data-loader state, step.

Layout: ``<dump_folder>/<job.name>/<checkpoint.folder>/step-N``. A save writes into
``step-N.tmp``; after every rank has finished (DCP writes ``.metadata`` last, then a
barrier) rank 0 writes ``manifest.json`` (every file's size) and renames the folder to
``step-N``. A process killed mid-save therefore leaves only a ``.tmp`` folder, which
restart ignores and deletes. A checkpoint whose files do not match its manifest (a shard
deleted or truncated after the save) is skipped for the previous complete one, with one
log line naming the damaged file. Old checkpoints are renamed ``step-N.deleting`` before
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from parallel import _torch as T

from .config import Checkpoint
from .errors import ConfigError, TrainingFault
from .hf_checkpoint import write_model_hf_config
from .optim import lr_schedule_state, restore_lr_schedule

logger = logging.getLogger("autotitan")


@contextlib.contextmanager
def _quiet():
    """Silence DCP's 'assuming the intent is to save in a single process' warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


_STEP_RE = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
DELETING = ".deleting"


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


def damage(path: Path) -> Optional[str]:
    """What is wrong with a complete checkpoint's files against its manifest (None: intact;
    a checkpoint written before manifests existed is taken as it is)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"{path / MANIFEST} is unreadable ({e})"
    for name, size in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} is {f.stat().st_size} bytes, not the {size} written"
    return None


def intact_checkpoints(folder: Path, log: bool = False) -> dict[int, Path]:
    """Complete checkpoints whose files match their manifests (damaged ones logged, once each,
    when `log`: the job resumes from the newest intact one)."""
    out = {}
    for step, path in complete_checkpoints(folder).items():
        why = damage(path)
        if why is None:
            out[step] = path
        elif log and _rank() == 0:
            logger.warning(f"skipping damaged checkpoint {path}: {why}")
    return out


def resume_step(ckpt_cfg: Checkpoint, folder: Path) -> int:
    """The step a job will resume at (0: none, or checkpointing off), known before the model
    is built: a scheduled sequence length and the plan for it depend on it."""
    if not ckpt_cfg.enable:
        return 0
    done = intact_checkpoints(Path(folder))
    if ckpt_cfg.load_step >= 0:
        return ckpt_cfg.load_step if ckpt_cfg.load_step in done else 0  # a missing one: load() says so
    return max(done) if done else 0


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
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": lr_schedule_state(self.lr_scheduler),
            # one entry per data-parallel rank (ranks read different slices)
            "dataloader": {f"dp_rank_{self.dp_rank}":
                           pickle.dumps(self.dataloader.state_dict())},
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
        if _rank() == 0:
            write_model_hf_config(tmp, self.model)  # what convert_hf.py to-hf needs (LLaMA 3, Qwen3)
            _write_manifest(tmp)
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
        """Delete ``step-N.tmp`` and unfinished folders (rank 0), then barrier."""
        if _rank() == 0 and self.folder.is_dir():
            for p in self.folder.iterdir():
                if p.is_dir() and (p.name.endswith((".tmp", DELETING)) or (
                        _STEP_RE.match(p.name) and not (p / ".metadata").is_file())):
                    logger.warning(f"removing incomplete checkpoint {p}")
                    shutil.rmtree(p, ignore_errors=True)
        _barrier()

    def find(self) -> Optional[Path]:
        """The checkpoint to resume from: ``load_step`` when set, else the latest intact one
        (damaged ones are skipped, saying which file is wrong)."""
        done = intact_checkpoints(self.folder, log=True)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in done:
                raise FileNotFoundError(
                    f"[checkpoint] load_step = {self.cfg.load_step}: no complete checkpoint "
                    f"step-{self.cfg.load_step} in {self.folder} (have: "
                    f"{', '.join(map(str, done)) or 'none'})")
            return done[self.cfg.load_step]
        return done[max(done)] if done else None

    def maybe_load(self) -> int:
        """Load the latest complete checkpoint (or ``load_step``); return its step
        (0 when there is none or checkpointing is off)."""
        if not self.enabled:
            return 0
        self.clean_incomplete()
        path = self.find()
        if path is None:
            return 0
        return self.load(path)

    def load(self, path: Path) -> int:
        """Restore everything from ``path`` (resharding if the layout changed); return its step."""
        state = self._state(0)
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        dl_key = f"dataloader.dp_rank_{self.dp_rank}"
        have_dl = dl_key in meta
        if not have_dl:
            state.pop("dataloader")
        _check_matches(path, state, meta)
        with _quiet():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        restore_lr_schedule(self.lr_scheduler, state["lr_scheduler"])
        step = int(state["train_state"]["step"])
        if have_dl:
            self.dataloader.load_state_dict(
                pickle.loads(state["dataloader"][f"dp_rank_{self.dp_rank}"]))
        else:
            # a different data-parallel layout: position the sampler by step instead
            logger.warning(f"{path} has no data-loader state for dp rank {self.dp_rank}; "
                           f"skipping to global batch {step}")
            self.dataloader.batch_sampler.skip_to(step)
        logger.info(f"resumed from {path} at step {step}")
        return step


def _write_manifest(folder: Path) -> None:
    """Every file of a written checkpoint with its size (written, then renamed)."""
    files = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=0))
    os.replace(tmp, folder / MANIFEST)


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

