"""Single-process training: loss falls, LR schedule, clipping, metrics outputs."""

import math

import pytest
import torch
from trainer_helpers import read_losses

from trainer.optim import WarmupDecay, clip_grad_norm_, total_grad_norm
from trainer.trainer import Trainer


@pytest.mark.parametrize("name", ["llama3_debug", "qwen3_debug", "deepseek_v3_debug",
                                  pytest.param("qwen3_moe_debug", marks=pytest.mark.slow)])
def test_debug_model_loss_falls_over_30_steps(cfg_factory, tmp_path, name):
    cfg = cfg_factory(name, ["--training.steps", "30", "--metrics.log_freq", "10"])
    logged = Trainer(cfg).train()
    assert sorted(logged) == [1, 10, 20, 30]
    assert math.isfinite(logged[30])
    assert logged[1] > 5.0  # ~ln(256) = 5.55 at init
    assert logged[30] < logged[1] - 1.5, logged
    assert read_losses(tmp_path) == logged


def test_deterministic_given_seed(cfg_factory):
    a = Trainer(cfg_factory(extra=["--training.steps", "3"], job="a")).train()
    b = Trainer(cfg_factory(extra=["--training.steps", "3"], job="b")).train()
    c = Trainer(cfg_factory(extra=["--training.steps", "3", "--job.seed", "1"], job="c")).train()
    assert a == b
    assert a != c


def test_bf16_autocast_single_rank_matches_plain_autocast(cfg_factory):
    """The trainer's bf16 path is torch.autocast around the same model and loss: its losses
    equal a hand-written loop with the same cast policy to ~1e-3."""
    from models import build_model, cross_entropy_loss

    cfg = cfg_factory(extra=["--training.steps", "3", "--training.mixed_precision_param", "bfloat16",
                             "--training.max_norm", "0"])
    tr = Trainer(cfg)
    logged = tr.train()
    torch.manual_seed(cfg.job.seed)
    model = build_model("llama3", "debug", device="cpu", vocab_size=tr.tokenizer.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
                            eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, tr.lr_scheduler.lr_lambdas[0])
    data = iter(Trainer(cfg_factory(extra=["--training.steps", "3"], job="data")).dataloader)
    for step in (1, 2, 3):
        tokens, labels = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cross_entropy_loss(model(tokens), labels)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        assert abs(loss.item() - logged[step]) <= 1e-3 * loss.item(), (step, loss.item(), logged[step])


def test_warmup_then_decay():
    f = WarmupDecay(warmup_steps=4, decay_steps=10, decay="linear", min_lr_factor=0.1)
    assert f(0) == pytest.approx(0.2) and f(3) == pytest.approx(0.8) and f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5) and f(14) == pytest.approx(0.1)
    assert f(100) == pytest.approx(0.1)
    c = WarmupDecay(0, 10, "cosine", 0.0)
    assert c(0) == 1.0 and c(5) == pytest.approx(0.5) and c(10) == pytest.approx(0.0)
    assert WarmupDecay(2, 10, "none", 0.0)(50) == 1.0


def test_clip_grad_norm_plain_tensors():
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    ps[0].grad = torch.tensor([3.0, 0.0, 0.0])
    ps[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert total_grad_norm(ps).item() == pytest.approx(5.0)
    assert total_grad_norm(ps, float("inf")).item() == pytest.approx(4.0)
    n = clip_grad_norm_(ps, 1.0)
    assert n.item() == pytest.approx(5.0)
    assert total_grad_norm(ps).item() == pytest.approx(1.0, rel=1e-5)


def test_metrics_and_tensorboard(cfg_factory, tmp_path):
    import io
    import logging
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger("autotitan").addHandler(handler)
    try:
        cfg = cfg_factory(extra=["--training.steps", "2", "--metrics.enable_tensorboard", "true"])
        Trainer(cfg).train()
    finally:
        logging.getLogger("autotitan").removeHandler(handler)
    line = [ln for ln in buf.getvalue().splitlines() if ln.startswith("step 2 |")][0]
    for field in ("loss", "grad_norm", "lr", "tok/s", "mfu", "mem"):
        assert f"| {field} " in line, line
    tb = list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert tb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb[0].parent))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for t in ("train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s",
              "train/mfu_pct", "train/memory_gib"):
        assert t in tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
