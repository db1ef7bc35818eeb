"""`[validation]`: on 2 gloo ranks, manual FSDP (its own `validation.data`) and auto mode (the
held-back tail of the training data), the logged validation loss equals a 1-rank evaluation of
the same weights, and training with validation on has the losses of training with it off; bad
settings are one config error naming the key."""

from __future__ import annotations

import functools
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
from dist_utils import run_distributed

from trainer.config import ConfigError, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.steps", "2",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.hardware", "h100",
        "--checkpoint.enable", "false", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "2e-3"]
VAL = ["--validation.enable", "true", "--validation.freq", "1", "--validation.steps", "2"]
# job -> (mode, its [validation] settings); "never": validation built (same held-back data) but not run
JOBS = {"manual_val": ("manual", VAL + ["--validation.data", "{val_file}"]),
        "manual_off": ("manual", []),
        "auto_val": ("auto", VAL),
        "auto_never": ("auto", VAL + ["--validation.freq", "1000"])}
RTOL = 1e-5


def job_args(job: str, tmp: str, world: int) -> list[str]:
    mode, val = JOBS[job]
    extra = ["--parallelism.hardware", "cpu"] if mode == "auto" else []
    # the 1-rank reference reads the 2-rank global batch (2 x 2) as its local batch
    return [*TINY, *[a.format(val_file=f"{tmp}/val.txt") for a in val], "--training.local_batch_size",
            str(4 // world), "--parallelism.mode", mode, *extra, "--job.dump_folder", tmp, "--job.name", job]


def _worker(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.tensor import DTensor

    from trainer.trainer import Trainer

    out = {}
    for job in JOBS:
        tr = Trainer(load_config("llama3_debug", job_args(job, tmp, world), world_size=world))
        out[job] = tr.train()
        assert tr.model.training  # back in train mode after validation
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in tr.model.named_parameters()}
        out[job + "_weights"] = full if rank == 0 else None
    return out


@functools.lru_cache(maxsize=None)
def two_rank_jobs() -> tuple[Path, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="autotitan-validation-"))
    text = (ROOT / "data" / "corpus.txt").read_text()
    (tmp / "val.txt").write_text(text[-4000:])  # its own data: text the training order may also hold
    res = run_distributed(_worker, 2, str(tmp), timeout=300)
    return tmp, res[0]


@pytest.fixture(scope="module")
def jobs():
    tmp, res = two_rank_jobs()
    yield tmp, res
    shutil.rmtree(tmp, ignore_errors=True)


def _logged(tmp: Path, job: str) -> dict:
    return json.loads((tmp / job / "losses.json").read_text())


def _one_rank_validation(tmp: Path, job: str, weights: dict) -> float:
    """The validation loss of `weights` evaluated by one process (no mesh, the plain model)."""
    from trainer.trainer import Trainer

    tr = Trainer(load_config("llama3_debug", [*job_args(job, str(tmp), 1), "--parallelism.mode", "manual",
                                              "--job.name", job + "_ref"], world_size=1))
    tr.model.load_state_dict(weights)
    return tr.validator.run(tr.model, tr.parallelizer, tr.seq_len)[0]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["manual_val", "auto_val"])
def test_validation_equals_one_rank_evaluation(jobs, job):
    tmp, res = jobs
    val = {int(k): v for k, v in _logged(tmp, job)["validation"].items()}
    assert sorted(val) == [1, 2]
    ref = _one_rank_validation(tmp, job, res[job + "_weights"])
    print(f"{job}: validation loss 2 ranks {val[2]:.7f}, 1 rank {ref:.7f}, rel diff {abs(val[2] - ref) / ref:.1e}")
    assert math.isclose(val[2], ref, rel_tol=RTOL)
    assert val[1] != val[2]  # the weights of step 1 and step 2 are evaluated, not a number kept


@pytest.mark.slow
@pytest.mark.parametrize("on, off", [("manual_val", "manual_off"), ("auto_val", "auto_never")])
def test_validation_does_not_perturb_training(jobs, on, off):
    _, res = jobs
    assert sorted(res[on]) == [1, 2]
    print(f"{on} vs {off}: training losses {res[on]} vs {res[off]}")
    assert res[on] == res[off]  # the step after a validation trains exactly as without it
    for name, w in res[on + "_weights"].items():
        assert (w == res[off + "_weights"][name]).all(), name


def test_held_back_split_is_logged_and_excluded(cfg_factory):
    from trainer.trainer import Trainer

    small = ["--model.n_layers", "1", "--training.steps", "0"]
    plain = Trainer(cfg_factory(extra=small, job="plain"))
    held = Trainer(cfg_factory(extra=[*small, *VAL], job="held"))
    b, s = 4, 32
    assert len(held.validator.tokens) == 2 * b * s + 1  # validation.steps global batches of windows
    assert len(held.dataloader.dataset) == len(plain.dataloader.dataset) - 2 * b
    # the held-back windows are the corpus's last ones: none of them is a training window
    last = held.dataloader.dataset.tokens
    assert len(last) + len(held.validator.tokens) - 1 == len(plain.dataloader.dataset.tokens)
    assert "held back from training" in held.validator.source


@pytest.mark.parametrize("key, value, words", [
    ("freq", "0", "must be >= 1"), ("steps", "0", "must be >= 1"), ("data", "/no/such/val.txt", "no such file")])
def test_bad_settings_are_config_errors(tmp_path, key, value, words):
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", ["--validation.enable", "true", f"--validation.{key}", value,
                                     "--job.dump_folder", str(tmp_path)], world_size=1)
    assert f"'validation.{key}' = " in str(e.value) and value in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("text, words", [("", "empty file; remove it from validation.data"),
                                         ("too short", "fewer than one global batch")])
def test_empty_validation_data_is_a_config_error(cfg_factory, tmp_path, text, words):
    from trainer.trainer import Trainer

    path = tmp_path / "val.txt"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        Trainer(cfg_factory(extra=["--model.n_layers", "1", *VAL, "--validation.data", str(path)]))
    assert f"'validation.data' = '{path}'" in str(e.value) and words in str(e.value)


def test_streamed_corpus_needs_validation_data(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", [*VAL, "--data.streaming", "true", "--data.shuffle", "false",
                                     "--job.dump_folder", str(tmp_path)], world_size=1)
    assert "'validation.data' = ''" in str(e.value) and "streaming" in str(e.value)


def test_console_and_tensorboard(tmp_path):
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.config import Metrics
    from trainer.metrics import MetricsLogger

    m = MetricsLogger(Metrics(enable_tensorboard=True, hardware="h100"), tmp_path, rank=0, world_size=1,
                      flops_per_token=1.0, compute_dtype="float32", device=__import__("torch").device("cpu"))
    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logging.getLogger("autotitan").addHandler(handler)
    try:
        m.log_validation(3, 2.0, math.exp(2.0), 256)
    finally:
        logging.getLogger("autotitan").removeHandler(handler)
        m.close()
    assert lines == ["step 3 | validation loss 2.0000 | perplexity 7.39 | 256 tokens"]
    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    assert [(e.step, e.value) for e in ev.Scalars("validation/loss")] == [(3, 2.0)]
    assert math.isclose(ev.Scalars("validation/perplexity")[0].value, math.exp(2.0), rel_tol=1e-6)
    assert json.loads((tmp_path / "losses.json").read_text())["validation"] == {"3": 2.0}
