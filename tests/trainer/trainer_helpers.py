"""Shared helpers of the trainer tests."""

import json
from pathlib import Path

from trainer.config import load_config

# small, fast settings shared by the trainer tests
FAST = ["--training.seq_len", "32", "--training.local_batch_size", "4",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "2e-3",
        "--checkpoint.enable", "false"]


def make_config(tmp_path, name="llama3_debug", extra=(), job="run"):
    return load_config(name, FAST + ["--job.dump_folder", str(tmp_path),
                                     "--job.name", job] + list(extra), world_size=1)


def read_losses(tmp_path, job="run") -> dict[int, float]:
    d = json.loads((Path(tmp_path) / job / "losses.json").read_text())
    return {int(k): v for k, v in d["loss"].items()}


def read_grad_norms(tmp_path, job="run") -> dict[int, float]:
    d = json.loads((Path(tmp_path) / job / "losses.json").read_text())
    return {int(k): v for k, v in d["grad_norm"].items()}


