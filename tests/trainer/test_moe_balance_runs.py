"""Aux-loss-free balancing in whole jobs (issue 53): with the bias updates on, EP 2 on 2 gloo ranks
trains as 1 rank (losses rtol 1e-5, every layer's final expert bias equal: the update is the sign
of the token counts summed over the ranks, so equal routing gives equal biases), and the bias is in
the DCP checkpoint, so a resumed job ends bit for bit where the uninterrupted one does.
The imbalance the bias removes is measured by scripts/bench_moe_balance.py."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import run_distributed
from torch.distributed.tensor import DTensor
from trainer_helpers import make_config

from trainer.checkpoint_files import read_metadata
from trainer.config import load_config
from trainer.moe_balance import moe_layers
from trainer.trainer import Trainer

COEFF = "0.01"  # large enough that the bias changes the routing within the few steps
# 4 steps of a global batch of 4 sequences: 1 rank x 4, or 2 ranks x 2
EP_JOB = ["--training.seq_len", "32", "--training.global_batch_size", "4", "--training.steps", "4",
          "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
          "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "2e-3", "--model.load_balance_coeff", COEFF]


def _biases(model: torch.nn.Module) -> list[torch.Tensor]:
    full = [m.expert_bias.full_tensor() if isinstance(m.expert_bias, DTensor) else m.expert_bias for m in
            moe_layers(model)]
    return [b.detach().clone() for b in full]


def _ep_job(world: int, tmp: str, local_batch: int, extra: list) -> dict:
    cfg = load_config("deepseek_v3_debug", [*EP_JOB, "--training.local_batch_size", str(local_batch), *extra,
                                            "--job.dump_folder", tmp, "--job.name", f"world{world}"],
                      world_size=world)
    tr = Trainer(cfg)
    losses = tr.train()
    experts = [m.experts.w1 for m in moe_layers(tr.model)]
    local = [(w.to_local() if isinstance(w, DTensor) else w).shape[0] for w in experts]
    return {"losses": losses, "biases": _biases(tr.model), "micro": tr.micro_batches, "local_experts": local}


def _ep_ranks(rank: int, world: int, tmp: str) -> dict:
    torch.set_num_threads(1)
    return _ep_job(world, tmp, 2, ["--parallelism.expert_parallel_degree", "2"])


@pytest.mark.slow
def test_ep2_with_bias_updates_equals_one_rank(tmp_path):
    ref = _ep_job(1, str(tmp_path), 4, [])
    got = run_distributed(_ep_ranks, 2, str(tmp_path), timeout=300)
    print(f"1 rank: losses {ref['losses']}; EP 2: {got[0]['losses']}")
    assert ref["micro"] == got[0]["micro"] == 1 and sorted(ref["losses"]) == [1, 2, 3, 4]
    assert ref["local_experts"] == [8, 8] and got[0]["local_experts"] == got[1]["local_experts"] == [4, 4]  # EP 2
    for r in got:
        assert sorted(r["losses"]) == [1, 2, 3, 4]
        for step, loss in ref["losses"].items():
            assert math.isclose(r["losses"][step], loss, rel_tol=1e-5), (step, r["losses"][step], loss)
        assert len(r["biases"]) == len(ref["biases"]) == 2
        for layer, (b, want) in enumerate(zip(r["biases"], ref["biases"])):
            assert torch.equal(b, want), (layer, b, want)
    assert all(b.any() for b in ref["biases"])  # the updates ran (4 steps of +-0.01 or 0 each)


def test_bias_is_checkpointed_and_resume_is_bit_identical(tmp_path):
    split = ["--lr_scheduler.decay_steps", "4", "--model.load_balance_coeff", COEFF]
    full_tr = Trainer(make_config(tmp_path, "deepseek_v3_debug", ["--training.steps", "4", *split], job="full"))
    full = full_tr.train()
    ck = [*split, "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    first = Trainer(make_config(tmp_path, "deepseek_v3_debug", ["--training.steps", "2", *ck], job="split")).train()
    keys = read_metadata(tmp_path / "split" / "checkpoints" / "step-2").state_dict_metadata
    assert {"model.layers.1.moe.expert_bias", "model.layers.2.moe.expert_bias"} <= set(keys), sorted(keys)
    resumed_tr = Trainer(make_config(tmp_path, "deepseek_v3_debug", ["--training.steps", "4", *ck], job="split"))
    second = resumed_tr.train()
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    assert {**first, **second} == full  # bitwise equal in fp32
    want, got = _biases(full_tr.model), _biases(resumed_tr.model)
    assert len(want) == 2 and all(b.any() for b in want)
    for b, w in zip(got, want):
        assert torch.equal(b, w), (b, w)
