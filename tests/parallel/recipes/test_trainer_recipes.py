"""End to end through the trainer: ``apply_recipe`` (TP2 with loss parallel, CP2) on 2 gloo
ranks logs the same losses as one process on the same data (dp = 1, so
both read the same batches)."""

import pytest
import torch
from dist_utils import run_distributed

from trainer.config import load_config
from trainer.trainer import Trainer

FAST = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "3",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "false", "--optimizer.lr", "2e-3"]

CASES = {
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
}


def _train(folder, extra, world):
    torch.set_num_threads(1)
    cfg = load_config("llama3_debug", FAST + ["--job.dump_folder", folder] + extra, world_size=world)
    t = Trainer(cfg)
    losses = t.train()
    return losses


def _worker(rank, world, folder):
    return {name: _train(f"{folder}/{name}", extra, world) for name, extra in CASES.items()}


@pytest.mark.slow
def test_trainer_tp2_and_cp2_match_one_process(tmp_path):
    ref = _train(str(tmp_path / "ref"), [], 1)
    got = run_distributed(_worker, 2, str(tmp_path), timeout=300)[0]
    for name in CASES:
        diffs = [abs(ref[s] - got[name][s]) for s in ref]
        print(name, got[name], "max loss diff", max(diffs))
        assert set(got[name]) == set(ref) and max(diffs) < 1e-4, (name, ref, got[name])
