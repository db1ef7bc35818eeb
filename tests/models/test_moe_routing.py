"""DeepSeek-V3's routing options on the MoE layer (models/moe.py): group-limited choice, the expert
bias (choice only, not weights), its update rule, the token counter, the sequence-wise auxiliary loss,
YaRN's tables, and routing a shape cannot take as one error naming the argument."""

from __future__ import annotations

import math

import pytest
import torch

from models import build_model, model_args
from models.layers import ArgError, YaRN, rope_tables
from models.moe import MoE, TokenChoiceTopKRouter, sequence_balance_loss

E, G, KEPT, K = 8, 4, 2, 2


def _router(**kw) -> TokenChoiceTopKRouter:
    torch.manual_seed(0)
    r = TokenChoiceTopKRouter(16, E, K, **kw)
    torch.nn.init.normal_(r.gate.weight, std=1.0)
    return r


def _x(t: int = 64) -> torch.Tensor:
    return torch.randn(t, 16, generator=torch.Generator().manual_seed(1))


def test_group_limited_choice_takes_only_experts_of_the_kept_groups():
    grouped = _router(score_func="sigmoid", n_groups=G, n_limited_groups=KEPT)
    free = _router(score_func="sigmoid")
    x = _x()
    _, selected, _ = grouped(x)
    scores = grouped.scores(x)
    group_scores = scores.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)  # a group: its two best experts
    kept = group_scores.topk(KEPT, dim=-1).indices
    for t in range(x.shape[0]):
        assert set((selected[t] // (E // G)).tolist()) <= set(kept[t].tolist()), t
    # and it matters: the unlimited top-k leaves the kept groups for some tokens
    _, unlimited, _ = free(x)
    outside = [t for t in range(x.shape[0]) if not set((unlimited[t] // (E // G)).tolist()) <= set(kept[t].tolist())]
    assert outside
    assert not torch.equal(selected.sort(-1).values, unlimited.sort(-1).values)


def test_expert_bias_changes_the_choice_not_the_weights():
    r = _router(score_func="sigmoid", route_norm=False)
    x = _x()
    scores = r.scores(x)
    bias = torch.zeros(E)
    bias[5] = 10.0  # far above any score difference: every token picks expert 5
    top, selected, counts = r(x, bias)
    assert (selected == 5).any(dim=-1).all() and counts[5] == x.shape[0]
    torch.testing.assert_close(top, scores.gather(1, selected), rtol=0, atol=0)  # unbiased scores
    top0, selected0, _ = r(x)
    assert not (selected0 == 5).any(dim=-1).all()


def test_route_norm_and_scale():
    x = _x()
    top, _, _ = _router(score_func="sigmoid", route_norm=True, route_scale=2.5)(x)
    torch.testing.assert_close(top.sum(-1), torch.full((x.shape[0],), 2.5))
    raw, _, _ = _router(score_func="sigmoid")(x)
    assert raw.sum(-1).max() < 2.0  # K sigmoid scores, not normalised


def test_expert_bias_update_rule_on_hand_made_counts():
    moe = MoE(16, 8, 4, 2, load_balance_coeff=0.1)
    moe.init_weights(0.02)
    assert "expert_bias" in moe.state_dict() and "tokens_per_expert" not in moe.state_dict()
    assert not any(n.endswith("expert_bias") for n, _ in moe.named_parameters())  # a buffer, no gradient
    moe.tokens_per_expert.copy_(torch.tensor([9, 7, 0, 0]))
    moe.update_expert_bias(torch.tensor([10, 0, 5, 5]))  # mean 5: overloaded, idle, balanced, balanced
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    assert not moe.tokens_per_expert.any()  # the counter restarts
    moe.update_expert_bias(torch.tensor([1, 2, 3, 6]))  # mean 3
    torch.testing.assert_close(moe.expert_bias, torch.tensor([0.0, 0.2, 0.0, -0.1]))
    assert MoE(16, 8, 4, 2).expert_bias is None  # no coefficient: no bias


def test_token_counts_add_up_in_training_forwards_only():
    torch.manual_seed(0)
    moe = MoE(16, 8, E, K, load_balance_coeff=1e-3)
    moe.init_weights(0.02)
    x = torch.randn(2, 5, 16)
    moe.train()
    moe(x)
    moe(x)
    assert moe.tokens_per_expert.sum() == 2 * 2 * 5 * K
    moe.eval()
    moe(x)
    assert moe.tokens_per_expert.sum() == 2 * 2 * 5 * K
    off = MoE(16, 8, E, K, load_balance_coeff=0.0)  # 0: the bias stays as loaded, nothing counted
    off.init_weights(0.02)
    off(x)
    assert not off.tokens_per_expert.any()


def test_sequence_balance_loss_by_hand():
    scores = torch.tensor([[0.6, 0.2, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]])  # one sequence of 2 tokens, rows sum to 1
    selected = torch.tensor([[0], [2]])  # K = 1
    f = torch.tensor([1.0, 0.0, 1.0, 0.0]) * 4 / (1 * 2)
    p = scores.mean(0)
    torch.testing.assert_close(sequence_balance_loss(scores, selected, 1), (f * p).sum())
    # two sequences: the mean of each one's loss
    both = sequence_balance_loss(torch.cat([scores, scores.flip(0)]), torch.cat([selected, selected.flip(0)]), 2)
    torch.testing.assert_close(both, (f * p).sum())


def test_aux_loss_trains_the_router_without_changing_the_output():
    torch.manual_seed(0)
    moe = MoE(16, 8, E, K, score_func="sigmoid", aux_loss_coeff=0.5)
    moe.init_weights(0.02)
    x = torch.randn(2, 6, 16)
    y = moe(x)
    moe.aux_loss_coeff = 0.0
    y0 = moe(x)
    assert torch.equal(y, y0)
    grads = []
    for coeff in (0.5, 0.0):
        moe.aux_loss_coeff = coeff
        moe.zero_grad()
        moe(x).sum().backward()
        grads.append(moe.router.gate.weight.grad.clone())
    assert (grads[0] - grads[1]).abs().max() > 1e-4
    # the difference is the aux loss's own gradient
    moe.zero_grad()
    xf = x.reshape(-1, 16)
    _, selected, _ = moe.router(xf)
    (0.5 * sequence_balance_loss(moe.router.scores(xf), selected, 2)).backward()
    torch.testing.assert_close(grads[0] - grads[1], moe.router.gate.weight.grad, atol=1e-6, rtol=1e-4)


def test_yarn_tables():
    yarn = YaRN(factor=40.0, original_len=4096)
    cos, sin = rope_tables(64, 8, 10000.0, scaling=yarn)
    plain_cos, _ = rope_tables(64, 8, 10000.0)
    assert torch.allclose(cos[:, 0], plain_cos[:, 0])  # the fastest frequency is kept
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2) / 64))
    scaled = yarn.inv_freq(inv, 64, 10000.0)
    torch.testing.assert_close(scaled[-1], inv[-1] / 40)  # the slowest is divided by the factor
    assert yarn.table_scale() == 1.0 and yarn.softmax_scale() == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    attn = build_model("deepseek_v3", "671B").layers[0].attention
    assert attn.q_scale == pytest.approx(1.874, abs=1e-3) and attn.q_lora_rank == 1536


@pytest.mark.parametrize("kw,key", [
    ({"n_expert_groups": 3}, "n_expert_groups"),
    ({"n_expert_groups": 8}, "n_expert_groups"),  # 1 expert per group: a group scores its two best
    ({"n_expert_groups": 4, "n_limited_groups": 5}, "n_limited_groups"),
    ({"n_expert_groups": 4, "n_limited_groups": 1, "n_activated_experts": 3}, "n_activated_experts"),
    ({"score_func": "relu"}, "score_func"),
    ({"route_scale": 0.0}, "route_scale"),
    ({"load_balance_coeff": -1.0}, "load_balance_coeff"),
    ({"rope_scaling_factor": 0.5}, "rope_scaling_factor"),
])
def test_routing_the_shape_cannot_take_is_one_error(kw, key):
    with pytest.raises(ArgError) as e:
        model_args("deepseek_v3", "debug", **kw)
    assert e.value.keys[0] == key and str(e.value).startswith(f"{key} = {kw[key]!r}: ")
