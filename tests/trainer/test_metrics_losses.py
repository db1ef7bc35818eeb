"""losses.json on a long run: not rewritten every logged step, complete at a checkpoint and at close."""
import json

import torch

from trainer.config import Metrics
from trainer.metrics import MetricsLogger


def _logger(tmp_path, start_step=0):
    return MetricsLogger(Metrics(enable_tensorboard=False, log_freq=1), tmp_path, rank=0, world_size=1,
                         flops_per_token=1.0, compute_dtype="float32", device=torch.device("cpu"),
                         start_step=start_step)


def _steps(tmp_path):
    return sorted(int(k) for k in json.loads((tmp_path / "losses.json").read_text())["loss"])


def test_written_at_flush_and_close_not_each_step(tmp_path):
    m = _logger(tmp_path)
    for step in (1, 2, 3):
        m.log(step, float(step), 1.0, 1e-3)
    assert not (tmp_path / "losses.json").exists()  # three steps within LOSSES_WRITE_S: no rewrite yet
    m.flush()  # what the trainer does before a checkpoint
    assert _steps(tmp_path) == [1, 2, 3]
    m.log(4, 4.0, 1.0, 1e-3)
    assert _steps(tmp_path) == [1, 2, 3]
    m.close()
    assert _steps(tmp_path) == [1, 2, 3, 4]


def test_rewritten_when_the_interval_has_passed(tmp_path, monkeypatch):
    monkeypatch.setattr(MetricsLogger, "LOSSES_WRITE_S", 0.0)
    m = _logger(tmp_path)
    m.log(1, 1.0, 1.0, 1e-3)
    assert _steps(tmp_path) == [1]
    m.close()


def test_resume_keeps_steps_up_to_the_checkpoint(tmp_path):
    m = _logger(tmp_path)
    for step in range(1, 7):
        m.log(step, float(step), 1.0, 1e-3)
    m.close()
    m = _logger(tmp_path, start_step=4)  # resumed from step-4: steps 5, 6 are trained again
    m.log(5, 50.0, 1.0, 1e-3)
    m.close()
    d = json.loads((tmp_path / "losses.json").read_text())["loss"]
    assert d == {"1": 1.0, "2": 2.0, "3": 3.0, "4": 4.0, "5": 50.0}
