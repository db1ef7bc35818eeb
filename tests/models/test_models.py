"""Fast CPU tests for models/: registry, parameter counts, init, forward/backward, seams."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models.moe as moe_mod
from models import (
    MODEL_SPECS,
    build_model,
    cross_entropy_loss,
    get_model_spec,
    model_args,
    transformer_blocks,
)
from models.layers import SDPA, apply_rope, rope_tables
from parallel import _torch as T  # the one place for private torch APIs (FakeTensorMode)

# Published total parameter counts (tests require ±2 %).
PUBLISHED = {
    ("llama3", "8B"): 8.03e9,
    ("llama3", "70B"): 70.6e9,
    ("llama3", "405B"): 405.85e9,  # LLaMA 3.1 405B (HF's count: 405,853,388,800)
    ("qwen3", "32B"): 32.8e9,
    ("deepseek_v3", "16B"): 15.7e9,
    ("qwen3_moe", "30B-A3B"): 30.5e9,
    ("qwen3_moe", "235B-A22B"): 235e9,
    ("deepseek_v3", "671B"): 671e9,  # without the MTP module (HF counts 685B with it)
}
ALL_FLAVORS = [(n, f) for n, s in MODEL_SPECS.items() for f in s.flavors]
DEBUG = ["llama3", "qwen3", "deepseek_v3", "qwen3_moe"]
MOE = ("deepseek_v3", "qwen3_moe")


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _tokens(b: int = 2, s: int = 32, seed: int = 123) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, s), generator=g)


def _cpu_model(name: str, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(name, "debug", device="cpu", **kw)


# ---------------------------------------------------------------- registry / counts


def test_registry_names_and_flavors():
    assert set(MODEL_SPECS) == {"llama3", "qwen3", "deepseek_v3", "qwen3_moe"}
    assert set(get_model_spec("llama3").flavors) == {"debug", "8B", "70B", "405B"}
    assert set(get_model_spec("qwen3").flavors) == {"debug", "32B"}
    assert set(get_model_spec("deepseek_v3").flavors) == {"debug", "16B", "671B"}
    assert set(get_model_spec("qwen3_moe").flavors) == {"debug", "30B-A3B", "235B-A22B"}
    with pytest.raises(ValueError, match="llama3"):
        get_model_spec("gpt5")
    with pytest.raises(ValueError, match="8B"):
        build_model("llama3", "13B")
    with pytest.raises(ValueError, match="not_a_field"):
        build_model("llama3", "debug", not_a_field=1)


@pytest.mark.parametrize("name,flavor", ALL_FLAVORS)
def test_meta_build_and_param_count(name, flavor):
    m = build_model(name, flavor, device="meta")
    assert all(p.is_meta for p in m.parameters())
    n = _numel(m)
    assert n == m.args.num_params()  # the analytic count used by flops_per_token
    for field in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
        assert hasattr(m.args, field)
    if flavor == "debug":
        assert 1e6 < n < 1e7 and m.args.vocab_size == 256
    else:
        published = PUBLISHED[(name, flavor)]
        assert abs(n - published) / published < 0.02, (name, flavor, n)


def test_transformer_blocks():
    m = build_model("deepseek_v3", "debug")
    blocks = transformer_blocks(m)
    assert blocks == list(m.layers) and len(blocks) == m.args.n_layers
    with pytest.raises(ValueError, match="no 'layers'"):
        transformer_blocks(nn.Linear(2, 2))


def test_overrides_and_derived_head_dim():
    args = model_args("llama3", "debug", dim=512, vocab_size=1000)
    assert args.head_dim == 64 and args.vocab_size == 1000
    assert model_args("qwen3", "debug", dim=512).head_dim == 64  # explicit, kept
    # the registry's flavor objects are not mutated
    assert get_model_spec("llama3").flavors["debug"].dim == 256


def test_flops_per_token():
    a = model_args("llama3", "8B")
    emb = a.vocab_size * a.dim
    expect = 6 * (a.num_params() - emb) + 12 * a.n_layers * a.n_heads * a.head_dim * 4096
    assert a.flops_per_token(4096) == pytest.approx(expect)
    d = model_args("deepseek_v3", "16B")
    assert d.active_params() < d.num_params() / 4  # only 6 of 64 experts count
    assert 2.2e9 < d.active_params() < 2.7e9  # V2-Lite: ~2.4B active (incl. output)
    # Qwen3-MoE: the published "A3B" / "A22B" counts include the embedding
    for flavor, active in (("30B-A3B", 3.3e9), ("235B-A22B", 22e9)):
        q = model_args("qwen3_moe", flavor)
        assert abs(q.active_params(exclude_embedding=False) - active) / active < 0.02, (flavor, q.active_params())
        attn = 12 * q.n_layers * q.n_heads * q.head_dim * 4096
        assert q.flops_per_token(4096) == pytest.approx(6 * q.active_params() + attn)


# ---------------------------------------------------------------- FQNs / structure


def test_llama_fqns():
    m = build_model("llama3", "debug")
    names = {n for n, _ in m.named_parameters()}
    for fqn in [
        "tok_embeddings.weight", "norm.weight", "output.weight",
        "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
        *(f"layers.3.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")),
        *(f"layers.3.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")),
    ]:
        assert fqn in names, fqn
    assert isinstance(m.layers[0].attention.sdpa, SDPA)
    assert all(b.is_meta for b in m.buffers())
    assert {n for n, _ in m.named_buffers()} == {"rope.cos", "rope.sin"}
    assert "rope.cos" not in m.state_dict()  # non-persistent


def test_qwen3_qk_norm():
    m = build_model("qwen3", "debug")
    a = m.args
    assert a.head_dim != a.dim // a.n_heads
    attn = m.layers[0].attention
    assert attn.q_norm.weight.shape == (a.head_dim,) and attn.k_norm.weight.shape == (a.head_dim,)
    assert attn.wq.weight.shape == (a.n_heads * a.head_dim, a.dim)
    assert build_model("llama3", "debug").layers[0].attention.q_norm is None


def test_deepseek_structure():
    m = build_model("deepseek_v3", "debug")
    a = m.args
    assert a.n_dense_layers == 1
    assert hasattr(m.layers[0], "feed_forward") and not hasattr(m.layers[0], "moe")
    for layer in list(m.layers)[1:]:
        assert hasattr(layer, "moe") and not hasattr(layer, "feed_forward")
        e = layer.moe.experts
        assert e.w1.shape == (a.n_routed_experts, a.moe_inter_dim, a.dim)
        assert e.w2.shape == (a.n_routed_experts, a.dim, a.moe_inter_dim)
        assert e.w3.shape == e.w1.shape
        assert isinstance(layer.moe.router.gate, nn.Linear)
        assert layer.moe.shared_experts is not None
    attn = m.layers[0].attention
    assert hasattr(attn, "wq") and not hasattr(attn, "wq_a")  # q_lora_rank 0
    for w in ("wkv_a", "kv_norm", "wkv_b", "wo", "sdpa"):
        assert hasattr(attn, w)
    lora = build_model("deepseek_v3", "debug", q_lora_rank=32).layers[0].attention
    assert hasattr(lora, "wq_a") and hasattr(lora, "q_norm") and not hasattr(lora, "wq")
    big = build_model("deepseek_v3", "16B")
    assert [hasattr(layer, "moe") for layer in big.layers] == [False] + [True] * 26


def test_qwen3_moe_structure():
    """Every layer is MoE (no dense FFN, no shared expert), Qwen3's q/k norms, normalised top-k."""
    m = build_model("qwen3_moe", "debug")
    a = m.args
    for layer in m.layers:
        assert not hasattr(layer, "feed_forward") and layer.moe.shared_experts is None
        assert layer.moe.experts.w1.shape == (a.n_routed_experts, a.moe_inter_dim, a.dim)
        assert layer.moe.experts.w2.shape == (a.n_routed_experts, a.dim, a.moe_inter_dim)
        r = layer.moe.router
        assert r.route_norm and r.route_scale == 1.0 and r.top_k == a.n_activated_experts == 2
        assert layer.attention.q_norm.weight.shape == (a.head_dim,)
    big = model_args("qwen3_moe", "235B-A22B")
    assert (big.dim, big.n_layers, big.n_heads, big.n_kv_heads, big.head_dim, big.moe_inter_dim,
            big.n_routed_experts, big.n_activated_experts) == (4096, 94, 64, 4, 128, 1536, 128, 8)
    with pytest.raises(ValueError, match="ffn_hidden_dim = 512"):
        model_args("qwen3_moe", "debug", ffn_hidden_dim=512)
    with pytest.raises(ValueError, match="n_activated_experts = 9"):
        model_args("qwen3_moe", "debug", n_activated_experts=9)


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", DEBUG)
def test_debug_forward_backward(name):
    kw = {"q_lora_rank": 32} if name == "deepseek_v3" else {}
    m = _cpu_model(name, **kw)
    tokens = _tokens()
    logits = m(tokens)
    assert logits.shape == (2, 32, 256) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    loss = cross_entropy_loss(logits[:, :-1], tokens[:, 1:])
    assert loss.dim() == 0 and 4.0 < loss.item() < 8.0  # ~ln(256) at init
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    zero = [n for n, p in m.named_parameters() if not p.grad.any()]
    assert not zero, zero
    # every routed expert got tokens: each expert's slice of w1/w2/w3 has a non-zero gradient
    experts = {n: p.grad.flatten(1).abs().amax(1) for n, p in m.named_parameters() if ".moe.experts." in n}
    assert bool(experts) == (name in MOE)
    for n, per_expert in experts.items():
        assert (per_expert > 0).all(), (n, per_expert)


@pytest.mark.parametrize("name", DEBUG)
def test_init_deterministic_and_meta_matches_cpu(name):
    a = _cpu_model(name, seed=7)
    b = _cpu_model(name, seed=7)
    c = build_model(name, "debug", device="meta")
    c.to_empty(device="cpu")
    torch.manual_seed(7)
    c.init_weights()
    sa, sb, sc = (dict(list(x.named_parameters()) + list(x.named_buffers())) for x in (a, b, c))
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
        assert torch.equal(sa[k], sc[k]), k
    d = _cpu_model(name, seed=8)
    assert not torch.equal(a.output.weight, d.output.weight)
    tokens = _tokens()
    assert torch.equal(a(tokens), c(tokens))


@pytest.mark.parametrize("name", DEBUG)
def test_causal_and_positions(name):
    m = _cpu_model(name)
    t = _tokens(1, 16)
    base = m(t)
    t2 = t.clone()
    t2[0, 10] = (t2[0, 10] + 1) % 256
    out = m(t2)
    assert torch.allclose(base[:, :10], out[:, :10], atol=1e-5)
    assert not torch.allclose(base[:, 10:], out[:, 10:])
    assert torch.allclose(m(t, torch.arange(16)), base, atol=1e-6)
    assert not torch.allclose(m(t, torch.arange(16) + 5), base)


def test_rope_rotate_half_is_relative():
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rope(q, cos[i : i + 1], sin[i : i + 1])
        kj = apply_rope(k, cos[j : j + 1], sin[j : j + 1])
        return (qi * kj).sum()

    assert torch.allclose(score(3, 1), score(12, 10), atol=1e-5)


def test_sdpa_seam_replaceable():
    m = _cpu_model("llama3")
    calls = []

    class Spy(SDPA):
        def forward(self, q, k, v):
            calls.append(q.shape)
            return super().forward(q, k, v)

    ref = m(_tokens())
    for layer in m.layers:
        layer.attention.sdpa = Spy()
    assert torch.equal(m(_tokens()), ref)
    assert calls and calls[0] == (2, 8, 32, 32)


# ---------------------------------------------------------------- MoE


def _naive_choice(r, s: torch.Tensor) -> list[int]:
    """One token's experts by the router's rules, in plain Python: the best ``top_k`` among the
    experts of the ``n_limited_groups`` groups with the best two-expert sums."""
    per = r.num_experts // r.n_groups
    groups = [sorted(s[g * per:(g + 1) * per].tolist(), reverse=True) for g in range(r.n_groups)]
    kept = sorted(range(r.n_groups), key=lambda g: -(groups[g][0] + (groups[g][1] if per > 1 else 0)))
    allowed = [i for i in range(r.num_experts) if i // per in kept[:r.n_limited_groups]]
    return sorted(allowed, key=lambda i: -s[i].item())[:r.top_k]


def _naive_moe(moe, x):
    """Per-token reference: sum_k weight_k * expert_k(x) + shared(x), the router's options by hand."""
    r = moe.router
    xf = x.reshape(-1, x.shape[-1])
    logits = r.gate(xf).float()
    scores = F.softmax(logits, dim=-1) if r.score_func == "softmax" else torch.sigmoid(logits)
    e = moe.experts
    out = torch.zeros_like(xf)
    for t in range(xf.shape[0]):
        sel = _naive_choice(r, scores[t])
        w = scores[t, sel]
        w = (w / w.sum() if r.route_norm else w) * r.route_scale
        for j, i in enumerate(sel):
            h = F.silu(e.w1[i] @ xf[t]) * (e.w3[i] @ xf[t])
            out[t] += w[j] * (e.w2[i] @ h)
    shared = moe.shared_experts(xf) if moe.shared_experts is not None else 0
    return (out + shared).reshape(x.shape)


@pytest.mark.parametrize(("name", "layer", "routing"), [
    ("deepseek_v3", 1, {}),
    ("deepseek_v3", 1, {"score_func": "softmax", "n_expert_groups": 1, "n_limited_groups": 1, "route_norm": False,
                        "route_scale": 1.0}),
    ("qwen3_moe", 0, {}),
])
def test_moe_matches_naive_reference(name, layer, routing):
    """DeepSeek-V3 debug's routing (sigmoid, 4 groups keeping 2, normalised, x 2.5), plain softmax
    top-k, and Qwen3-MoE's (softmax, top-k renormalised, no shared expert)."""
    moe = _cpu_model(name, **routing).layers[layer].moe
    x = torch.randn(2, 8, 256)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x), atol=1e-5, rtol=1e-4)


def _max_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference relative to the reference's largest magnitude."""
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def test_moe_bf16_grouped_mm_path_matches_loop():
    """bf16 grouped matmuls equal the bf16 expert loop (same casts) to 1e-3 of the output
    scale, and the fp32 computation on the same bf16 values to bf16 rounding (1e-2)."""
    moe = _cpu_model("deepseek_v3").layers[1].moe.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 256, generator=g).to(torch.bfloat16)
    assert moe_mod._can_grouped_mm(x, moe.experts.w1, moe.experts.w2)
    y_ref = copy.deepcopy(moe).float()(x.float())
    assert _max_rel(moe(x), y_ref) < 1e-2
    xs = torch.randn(10, 256, generator=g).to(torch.bfloat16)
    counts = torch.tensor([2, 0, 3, 0, 0, 0, 0, 1])  # 4 padding rows
    e = moe.experts
    a = moe_mod._experts_grouped_mm(xs, counts, e.w1, e.w2, e.w3)
    b = moe_mod._experts_loop(xs, counts, e.w1, e.w2, e.w3)
    c = moe_mod._experts_loop(xs.float(), counts, e.w1.float(), e.w2.float(), e.w3.float())
    assert _max_rel(a, b) < 1e-3 and _max_rel(a, c) < 1e-2
    assert (a[6:] == 0).all() and (b[6:] == 0).all()


def test_expert_loop_backward_writes_each_weight_gradient_once():
    """The fp32 expert loop's backward: one full-size buffer per expert weight (autograd's
    stack of the experts' gradients), equal to a per-expert reference, not one zeroed
    [E, ...] buffer per expert added up (E fills and adds of the whole weight: 25 % of the
    loop's time at the debug DeepSeek-V3 shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(2)
    n_exp, dim, hidden = 4, 8, 16
    w = [torch.randn(n_exp, hidden, dim, generator=g).requires_grad_(),
         torch.randn(n_exp, dim, hidden, generator=g).requires_grad_(),
         torch.randn(n_exp, hidden, dim, generator=g).requires_grad_()]
    counts = torch.tensor([3, 0, 2, 4])
    xs, gy = torch.randn(11, dim, generator=g), torch.randn(11, dim, generator=g)  # 2 padding rows

    class FullSizeWrites(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = () if func.is_view else out if isinstance(out, (tuple, list)) else (out,)
            self.n += sum(isinstance(o, torch.Tensor) and o.shape == (n_exp, hidden, dim) for o in outs)
            return out

    y = moe_mod._experts_loop(xs, counts, *w)
    with FullSizeWrites() as seen:
        y.backward(gy)
    assert seen.n <= 2, seen.n  # w1's and w3's gradient ([E, hidden, dim]), each written once
    rows = torch.split(xs, [3, 0, 2, 4, 2])
    for e in range(n_exp):
        w1, w2, w3 = (t.detach()[e].requires_grad_() for t in w)
        out = (torch.nn.functional.silu(rows[e] @ w1.T) * (rows[e] @ w3.T)) @ w2.T
        out.backward(torch.split(gy, [3, 0, 2, 4, 2])[e])
        for ref, full in zip((w1, w2, w3), w):
            torch.testing.assert_close(full.grad[e], ref.grad, rtol=1e-6, atol=1e-6)


def test_moe_dispatch_seam_replaceable():
    moe = _cpu_model("deepseek_v3").layers[1].moe
    x = torch.randn(1, 4, 256)
    ref = moe(x)
    seen = {}
    default = moe.dispatch

    def my_dispatch(x_flat, top_scores, selected, counts):
        seen.update(shape=x_flat.shape, counts=counts.clone(), k=selected.shape[1])
        return default(x_flat, top_scores, selected, counts)

    moe.dispatch = my_dispatch
    torch.testing.assert_close(moe(x), ref)
    assert seen["shape"] == (4, 256) and seen["k"] == 2
    assert int(seen["counts"].sum()) == 8 and seen["counts"].shape == (8,)


@pytest.mark.parametrize(
    "name,dtype",
    [("llama3", torch.float32), ("qwen3", torch.float32), ("deepseek_v3", torch.bfloat16),
     ("qwen3_moe", torch.bfloat16)],
)
def test_fake_tensor_materialise_and_backward(name, dtype):
    """The planner's path: meta build -> to_empty under FakeTensorMode -> fwd+bwd.

    MoE under fake tensors needs bf16 (the ``F.grouped_mm`` path); the fp32 expert loop
    calls ``.tolist()`` on the token counts, which needs real data (see models/moe.py).
    """
    m = build_model(name, "debug", device="meta").to(dtype)
    with T.FakeTensorMode(allow_non_fake_inputs=True):
        m.to_empty(device="cpu")
        m.init_weights()
        tokens = torch.randint(0, 256, (2, 64))
        loss = cross_entropy_loss(m(tokens), tokens)
        loss.backward()
        assert all(p.grad is not None for p in m.parameters())
