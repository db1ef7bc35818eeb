"""Distributed checkpoints (DCP): model, optimizer, LR schedule, data-loader state, step.

Layout: ``<dump_folder>/<job.name>/<checkpoint.folder>/step-N``. A save writes into
``step-N.tmp``; after every rank has finished (DCP writes ``.metadata`` last, then a
barrier) rank 0 renames it to ``step-N``. A process killed mid-save therefore leaves only
a ``.tmp`` folder, which restart ignores and deletes. Works with or without a process
group (single process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim.lr_scheduler import LambdaLR

from .config import Checkpoint
from .optim import lr_schedule_state, restore_lr_schedule

logger = logging.getLogger("autotitan")


@contextlib.contextmanager
def _quiet():
    """Silence DCP's 'assuming the intent is to save in a single process' warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


_STEP_RE = re.compile(r"^step-(\d+)$")


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


def resume_step(ckpt_cfg: Checkpoint, folder: Path) -> int:
    """The step a job will resume at (0: none, or checkpointing off), known before the model
    is built: a scheduled sequence length and the plan for it depend on it."""
    if not ckpt_cfg.enable:
        return 0
    done = complete_checkpoints(Path(folder))
    if ckpt_cfg.load_step >= 0:
        return ckpt_cfg.load_step if ckpt_cfg.load_step in done else 0  # a missing one: load() says so
    return max(done) if done else 0


class CheckpointManager:
    """Saves and restores the whole training state as DCP folders (see the module doc)."""

    def __init__(self, ckpt_cfg: Checkpoint, folder: Path, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, lr_scheduler: LambdaLR, dataloader: Any, dp_rank: int = 0):
        self.cfg = ckpt_cfg
        self.folder = Path(folder)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.dp_rank = dp_rank
        self.enabled = ckpt_cfg.enable

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
        """Write ``step-N.tmp`` on every rank, then rank 0 renames it: only complete
        checkpoints ever carry the final name."""
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        _barrier()
        with _quiet():
            dcp.save(self._state(step), checkpoint_id=str(tmp))
        _barrier()  # every rank has written its files and .metadata exists
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        logger.info(f"saved checkpoint {final}")
        return final

    def _prune(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        done = complete_checkpoints(self.folder)
        for step in list(done)[:-k]:
            shutil.rmtree(done[step], ignore_errors=True)

    # ------------------------------------------------------------------ load

    def clean_incomplete(self) -> None:
        """Delete ``step-N.tmp`` and unfinished folders (rank 0), then barrier."""
        if _rank() == 0 and self.folder.is_dir():
            for p in self.folder.iterdir():
                if p.is_dir() and (p.name.endswith(".tmp") or (
                        _STEP_RE.match(p.name) and not (p / ".metadata").is_file())):
                    logger.warning(f"removing incomplete checkpoint {p}")
                    shutil.rmtree(p, ignore_errors=True)
        _barrier()

    def find(self) -> Optional[Path]:
        """The checkpoint to resume from: ``load_step`` when set, else the latest complete one."""
        done = complete_checkpoints(self.folder)
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
