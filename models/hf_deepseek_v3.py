"""DeepSeek-V3 <-> Hugging Face ``DeepseekV3ForCausalLM``: config translation and tensor map.

Where it differs from the one-to-one names of LLaMA 3 and Qwen3 (models/hf.py):

* Experts: HF stores each routed expert on its own (``mlp.experts.{j}.{gate,up,down}_proj``);
  ours are stacked ``[E, ...]`` (``moe.experts.w1/w3/w2``): stacked on load, split on export.
* RoPE layout: with ``rope_interleave`` (transformers' default, DeepSeek's checkpoints) the
  rotary dims of q (each head's last ``qk_rope_head_dim`` rows of ``q_proj``/``q_b_proj``) and
  of the shared k (the last rows of ``kv_a_proj_with_mqa``) are stored as pairs (x0, x1),
  (x2, x3), ... that one frequency rotates; transformers rotates them so and returns them
  de-interleaved. Our rotate-half form rotates halves, so those rows are permuted
  [0, 2, 4, ..., 1, 3, 5, ...] on load (inverted on export): q and k, and the logits, are
  transformers'. Without ``rope_interleave`` the rows are copied.
* Routing: transformers' DeepSeek-V3 router always scores with sigmoid, adds
  ``e_score_correction_bias`` for the choice, limits the choice to ``topk_group`` of ``n_group``
  groups (a group scores its two best experts), then normalises (``norm_topk_prob``) and
  scales (``routed_scaling_factor``): our options with ``score_func = "sigmoid"``. A config
  that says otherwise (``scoring_func``, ``topk_method``) is refused, as is the export of a
  softmax-routed model; nothing is approximated. ``e_score_correction_bias`` is our
  ``moe.expert_bias``; a model without one (``load_balance_coeff`` unset) exports zeros and
  loads only zeros.
* Multi-token prediction is not implemented: the MTP layer of a checkpoint
  (``model.layers.{num_hidden_layers}...``) is skipped on load and not written.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch

from .deepseek_v3 import DeepSeekV3Args
from .hf_base import HFConfigError, HFTensors, rope_config
from .layers import ArgError

ARCH, MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"

# ours -> HF, per block (after "layers.{i}." / "model.layers.{i}.")
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
_ROPE_ROWS = ("attention.wq.weight", "attention.wq_b.weight", "attention.wkv_a.weight")
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_OURS_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# [model] arguments a job started from a checkpoint takes from its config (what it computes, not shapes)
OVERRIDE_KEYS = ("score_func", "route_norm", "route_scale", "n_expert_groups", "n_limited_groups",
                 "rope_scaling_factor", "rope_original_max_seq_len", "rope_beta_fast", "rope_beta_slow",
                 "rope_mscale", "rope_mscale_all_dim")
# our argument -> the HF config key it comes from (to name it in errors)
_HF_KEY = {"n_routed_experts": "n_routed_experts", "n_activated_experts": "num_experts_per_tok",
           "n_expert_groups": "n_group", "n_limited_groups": "topk_group", "route_scale": "routed_scaling_factor",
           "q_lora_rank": "q_lora_rank", "rope_scaling_factor": "rope_parameters.factor",
           "rope_original_max_seq_len": "rope_parameters.original_max_position_embeddings"}


# ---------------------------------------------------------------------------------- config


def unsupported(cfg: dict[str, Any]) -> list[str]:
    """The options of a DeepSeek-V3 config our model does not compute as transformers does."""
    out = []
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key, ok) != ok:
            out.append(f"{key} = {cfg[key]!r} (transformers' DeepseekV3 routes by {ok!r} whatever this says; "
                       f"only {ok!r})")
    if cfg.get("moe_layer_freq", 1) != 1:
        out.append(f"moe_layer_freq = {cfg['moe_layer_freq']!r} (only 1)")
    if cfg.get("num_key_value_heads") not in (None, cfg.get("num_attention_heads")):
        out.append(f"num_key_value_heads = {cfg['num_key_value_heads']!r} (MLA: only num_attention_heads)")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        out.append(f"quantization_config ({method!r}: dequantize the checkpoint to bf16/fp32 first)")
    _, rs = rope_config(cfg)
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "yarn":
            out.append(f"rope_parameters.rope_type = {kind!r} (only 'yarn' or 'default')")
        for key, ok in (("truncate", True), ("partial_rotary_factor", 1.0), ("attention_factor", None)):
            if rs.get(key, ok) != ok:
                out.append(f"rope_parameters.{key} = {rs[key]!r} (only {ok!r})")
    return out


def _yarn_args(cfg: dict[str, Any]) -> dict[str, Any]:
    _, rs = rope_config(cfg)
    if not rs:
        return {}
    orig = int(rs["original_max_position_embeddings"])
    factor = rs.get("factor") or cfg["max_position_embeddings"] / orig
    return dict(rope_scaling_factor=float(factor), rope_original_max_seq_len=orig,
                rope_beta_fast=float(rs.get("beta_fast") or 32), rope_beta_slow=float(rs.get("beta_slow") or 1),
                rope_mscale=float(rs.get("mscale") or 0.0), rope_mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0))


def args_from_hf(cfg: dict[str, Any]) -> DeepSeekV3Args:
    """Our args from a ``DeepseekV3ForCausalLM`` config (already checked by `unsupported`);
    routing the shape cannot take raises `HFConfigError` naming the HF key."""
    kw: dict[str, Any] = dict(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_dense_layers=cfg.get("first_k_dense_replace", 0),
        n_heads=cfg["num_attention_heads"], vocab_size=cfg["vocab_size"], inter_dim=cfg["intermediate_size"],
        moe_inter_dim=cfg["moe_intermediate_size"], n_routed_experts=cfg["n_routed_experts"],
        n_shared_experts=cfg.get("n_shared_experts") or 0, n_activated_experts=cfg["num_experts_per_tok"],
        route_scale=float(cfg.get("routed_scaling_factor", 1.0)), route_norm=bool(cfg.get("norm_topk_prob", False)),
        score_func="sigmoid", n_expert_groups=cfg.get("n_group") or 1, n_limited_groups=cfg.get("topk_group") or 1,
        load_balance_coeff=0.0, q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"], norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_config(cfg)[0],
        max_seq_len=cfg.get("max_position_embeddings", 4096), **_yarn_args(cfg))
    try:
        return DeepSeekV3Args(**kw)
    except ArgError as e:
        key = _HF_KEY.get(e.keys[0], e.keys[0])
        raise HFConfigError(f"{key} = {e.value!r}: our {e}; not a routing our DeepSeek-V3 can compute") from None


def hf_config(args: DeepSeekV3Args, base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A ``DeepseekV3ForCausalLM`` config for our args (``base``'s other entries kept)."""
    if args.score_func != "sigmoid":
        raise HFConfigError(f"score_func = {args.score_func!r}: transformers' DeepseekV3ForCausalLM routes by sigmoid "
                            "scores, so its logits would differ; only a model with score_func = 'sigmoid' exports")
    cfg = {k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "rope_theta", "quantization_config")}
    cfg.update(
        architectures=[ARCH], model_type=MODEL_TYPE, vocab_size=args.vocab_size, hidden_size=args.dim,
        intermediate_size=args.inter_dim, moe_intermediate_size=args.moe_inter_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads, n_shared_experts=args.n_shared_experts,
        n_routed_experts=args.n_routed_experts, routed_scaling_factor=args.route_scale,
        kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank or None, qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim, qk_nope_head_dim=args.qk_nope_head_dim, n_group=args.n_expert_groups,
        topk_group=args.n_limited_groups, num_experts_per_tok=args.n_activated_experts,
        first_k_dense_replace=args.n_dense_layers, norm_topk_prob=args.route_norm, scoring_func="sigmoid",
        topk_method="noaux_tc", hidden_act="silu", max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps, tie_word_embeddings=False, attention_bias=False,
        rope_interleave=cfg.get("rope_interleave", True), num_nextn_predict_layers=0)
    rope: dict[str, Any] = {"rope_theta": args.rope_theta, "rope_type": "default"}
    if args.rope_scaling_factor:
        rope.update(rope_type="yarn", factor=args.rope_scaling_factor,
                    original_max_position_embeddings=args.rope_original_max_seq_len, beta_fast=args.rope_beta_fast,
                    beta_slow=args.rope_beta_slow, mscale=args.rope_mscale, mscale_all_dim=args.rope_mscale_all_dim)
    cfg["rope_parameters"] = rope
    return cfg


def override_args(args: DeepSeekV3Args) -> dict[str, Any]:
    """The arguments a job started from this checkpoint takes over its flavor's (`OVERRIDE_KEYS`)."""
    return {k: getattr(args, k) for k in OVERRIDE_KEYS}


def skipped(key: str, cfg: dict[str, Any]) -> bool:
    """An HF tensor our model has no use for: the MTP layer(s) after the last decoder layer."""
    m = _HF_LAYER_RE.match(key)
    return bool(m) and int(m.group(1)) >= cfg["num_hidden_layers"]


# ---------------------------------------------------------------------------------- tensors


def _rope_order(n: int) -> torch.Tensor:
    """Interleaved pairs -> halves: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _permute_rope_rows(w: torch.Tensor, block: int, rope: int, order: torch.Tensor) -> torch.Tensor:
    """``w [n * block, in]`` with each block's last ``rope`` rows reordered by ``order``."""
    v = w.reshape(-1, block, w.shape[-1])
    rows = torch.cat([torch.arange(block - rope), block - rope + order])
    return v[:, rows].reshape(w.shape)


def _rope_entry(hf_key: str, shape: tuple[int, ...], block: int, rope: int) -> HFTensors:
    order = _rope_order(rope)
    back = torch.argsort(order)
    return HFTensors((hf_key,), (shape,), join=lambda ts: _permute_rope_rows(ts[0], block, rope, order),
                     split=lambda t: [_permute_rope_rows(t, block, rope, back)])


def _experts_entry(prefix: str, name: str, shape: tuple[int, ...]) -> HFTensors:
    keys = tuple(f"{prefix}mlp.experts.{j}.{name}.weight" for j in range(shape[0]))
    return HFTensors(keys, (tuple(shape[1:]),) * shape[0], join=lambda ts: torch.stack(ts),
                     split=lambda t: list(t.unbind(0)))


def _zero_bias(ts: list[torch.Tensor], key: str) -> torch.Tensor:
    if ts[1].any():
        raise HFConfigError(f"{key} is not zero, but our model has no expert bias (load_balance_coeff unset): set "
                            "model.load_balance_coeff = 0 (keep the bias as loaded) or > 0 (train it)")
    return ts[0]


def _gate_with_zero_bias(prefix: str, shape: tuple[int, ...]) -> HFTensors:
    """Our router gate when the model has no expert bias: HF's bias must be (and is written) zero."""
    bias = f"{prefix}mlp.gate.e_score_correction_bias"
    return HFTensors((f"{prefix}mlp.gate.weight", bias), (shape, (shape[0],)), join=lambda ts: _zero_bias(ts, bias),
                     split=lambda t: [t, torch.zeros(t.shape[0], dtype=t.dtype)])


def tensor_map(args: DeepSeekV3Args, shapes: dict[str, tuple[int, ...]], interleaved: bool = True
               ) -> dict[str, HFTensors]:
    """{our key: its HF tensors} for our state dict's {key: shape}; ``interleaved``: the HF
    config's ``rope_interleave`` (see the module doc)."""
    out: dict[str, HFTensors] = {}
    for key, shape in shapes.items():
        shape = tuple(shape)
        if key in _TOP:
            out[key] = HFTensors((_TOP[key],), (shape,))
            continue
        m = _OURS_RE.match(key)
        if not m:
            continue
        layer, rest = m.groups()
        prefix = f"model.layers.{layer}."
        if rest in _EXPERTS:
            out[key] = _experts_entry(prefix, _EXPERTS[rest], shape)
        elif rest == "moe.router.gate.weight" and f"layers.{layer}.moe.expert_bias" not in shapes:
            out[key] = _gate_with_zero_bias(prefix, shape)
        elif rest in _ROPE_ROWS and interleaved:
            kv = rest == "attention.wkv_a.weight"
            block = shape[0] if kv else args.qk_head_dim
            out[key] = _rope_entry(prefix + _BLOCK[rest], shape, block, args.qk_rope_head_dim)
        elif rest in _BLOCK:
            out[key] = HFTensors((prefix + _BLOCK[rest],), (shape,))
    return out


def with_optional_keys(args: DeepSeekV3Args, present: set[str]) -> DeepSeekV3Args:
    """``args`` without an expert bias when a checkpoint of ours has none (``present``: its keys)."""
    if args.load_balance_coeff is not None and not any(k.endswith(".moe.expert_bias") for k in present):
        return dataclasses.replace(args, load_balance_coeff=None)
    return args
