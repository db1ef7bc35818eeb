"""DeepSeek-V3's routing and balancing in a job: the expert bias moves after each optimizer step by the
token counts summed over all ranks; [model] routing the shape cannot take is one config error; a job
starts from a transformers DeepseekV3ForCausalLM (its routing and YaRN over the flavor's) and exports
back to it."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from trainer_helpers import make_config

from models.moe import MoE
from trainer.config import ConfigError
from trainer.moe_balance import balance_experts
from trainer.trainer import Trainer

V3_ROUTING = ["--model.score_func", "sigmoid", "--model.n_expert_groups", "4", "--model.n_limited_groups", "2",
              "--model.route_norm", "true", "--model.route_scale", "2.5"]


def test_job_moves_the_expert_bias_after_each_step(tmp_path):
    coeff = 1e-3
    cfg = make_config(tmp_path, "deepseek_v3_debug", ["--training.steps", "2", *V3_ROUTING,
                                                      "--model.load_balance_coeff", str(coeff)])
    tr = Trainer(cfg)
    losses = tr.train()
    assert sorted(losses) == [1, 2]
    layers = [m for m in tr.model.modules() if isinstance(m, MoE)]
    assert len(layers) == 2
    for m in layers:
        steps = m.expert_bias / coeff  # two updates of +-coeff (or 0) each
        assert m.expert_bias.any() and torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 2
        assert not m.tokens_per_expert.any()  # counted, used, restarted
    assert "layers.1.moe.expert_bias" in tr.model.state_dict()  # lands in the DCP checkpoints


def _two_ranks(rank: int, world: int) -> list:
    torch.manual_seed(0)
    moe = MoE(8, 4, 4, 2, load_balance_coeff=0.5)
    moe.init_weights(0.02)
    moe.tokens_per_expert.copy_(torch.tensor([[6, 0, 2, 0], [0, 6, 0, 2]][rank]))  # summed: [6, 6, 2, 2]
    balance_experts(moe)
    return moe.expert_bias.tolist()


@pytest.mark.slow
def test_counts_are_summed_over_the_ranks():
    out = run_distributed(_two_ranks, 2, timeout=120)
    assert out[0] == out[1] == [-0.5, -0.5, 0.5, 0.5]  # by the sum (mean 4), not by each rank's own counts


@pytest.mark.parametrize("extra,named", [
    (["--model.n_expert_groups", "3"], "'model.n_expert_groups' = 3: must divide n_routed_experts = 8"),
    (["--model.n_expert_groups", "4", "--model.n_limited_groups", "5"], "'model.n_limited_groups' = 5: groups kept"),
    (["--model.n_expert_groups", "4", "--model.n_limited_groups", "1", "--model.n_activated_experts", "3"],
     "'model.n_activated_experts' = 3: must be between 1 and the 2 experts of the kept groups"),
    (["--model.load_balance_coeff", "0.001", "--parallelism.mode", "auto"], "'parallelism.mode' = 'auto': "
     "load_balance_coeff = 0.001"),
])
def test_bad_routing_is_one_config_error(tmp_path, extra, named):
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, "deepseek_v3_debug", extra)
    assert named in str(e.value) and "deepseek_v3_debug.toml" in str(e.value)


def test_softmax_routing_with_an_hf_export_fails_before_training(tmp_path):
    cfg = make_config(tmp_path, "deepseek_v3_debug", ["--training.steps", "1", "--checkpoint.last_save_in_hf", "true",
                                                      "--model.score_func", "softmax"])
    with pytest.raises(ConfigError, match="last_save_in_hf' = true: score_func = 'softmax'"):
        Trainer(cfg)


# ------------------------------------------------------------------ a job from transformers' weights

transformers = pytest.importorskip("transformers")
HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
          n_group=4, topk_group=3, first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True,
          q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
          max_position_embeddings=2048, initializer_range=0.1,
          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                           "mscale": 1.0, "mscale_all_dim": 1.0})
SHAPE = ["--model.n_layers", "3", "--model.dim", "64", "--model.n_heads", "4", "--model.inter_dim", "128",
         "--model.moe_inter_dim", "32", "--model.q_lora_rank", "32"]
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))


def test_job_from_transformers_deepseek_v3_and_back(tmp_path):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF)).eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    hf.save_pretrained(tmp_path / "hf")
    start = ["--training.steps", "1", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
             "--checkpoint.initial_load_in_hf", "true", *SHAPE]
    with pytest.raises(ConfigError, match="e_score_correction_bias is not zero.*set model.load_balance_coeff = 0"):
        Trainer(make_config(tmp_path, "deepseek_v3_debug", start, job="no_bias")).start()
    cfg = make_config(tmp_path, "deepseek_v3_debug", [*start, "--model.load_balance_coeff", "0.001",
                                                      "--checkpoint.last_save_in_hf", "true"])
    tr = Trainer(cfg)
    a = tr.model_args  # the checkpoint's routing and YaRN over the debug flavor's (2 groups kept, x 2.5, no YaRN)
    assert (a.score_func, a.n_limited_groups, a.route_scale, a.rope_scaling_factor) == ("sigmoid", 3, 1.5, 4.0)
    tr.start()
    with torch.no_grad():
        assert (tr.model(TOKENS) - hf(TOKENS).logits).abs().max().item() <= 1e-5
    tr.model.train()
    while tr.step < 1:
        tr.next_step()
    tr._save_hf()
    tr.model.eval()
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step-1-hf").eval()
    with torch.no_grad():
        ours, theirs = tr.model(TOKENS), back(TOKENS).logits
        assert (ours - theirs).abs().max().item() <= 1e-5
        assert (theirs - hf(TOKENS).logits).abs().max().item() > 1e-4  # trained, not the start
    bias = back.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, tr.model.layers[1].moe.expert_bias)


def _fsdp_job(rank: int, world: int, tmp: str, extra: list) -> dict:
    tr = Trainer(make_config(tmp, "deepseek_v3_debug", extra, job="fsdp"))
    tr.start()
    sharded = [n for n, p in tr.model.named_parameters() if p.to_local().shape != p.shape]  # FSDP: dim 0
    with torch.no_grad():
        start = tr.model(TOKENS)
    tr.model.train()
    while tr.step < 1:
        tr.next_step()
    tr._save_hf()
    tr.model.eval()
    with torch.no_grad():
        trained = tr.model(TOKENS)
    return {"start": start, "trained": trained, "sharded": sharded}


@pytest.mark.slow
def test_two_ranks_read_their_shards_of_the_transformed_tensors(tmp_path):
    """FSDP on 2 ranks: each rank cuts its shard (dim 0) of the stacked experts and of the RoPE-permuted
    q rows, transformed whole first; the logits are transformers', the gathered export loads back."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF)).eval()
    hf.save_pretrained(tmp_path / "hf")
    extra = ["--training.steps", "1", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
             "--checkpoint.initial_load_in_hf", "true", "--checkpoint.last_save_in_hf", "true",
             "--model.load_balance_coeff", "0.001", *SHAPE]
    out = run_distributed(_fsdp_job, 2, str(tmp_path), extra, timeout=300)
    assert "layers.1.attention.wq_b.weight" in out[0]["sharded"] and "layers.1.moe.experts.w1" in out[0]["sharded"]
    with torch.no_grad():
        ref = hf(TOKENS).logits
    for r in out:
        assert (r["start"] - ref).abs().max().item() <= 1e-5
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "fsdp" / "checkpoints" / "step-1-hf").eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - out[0]["trained"]).abs().max().item() <= 1e-5
