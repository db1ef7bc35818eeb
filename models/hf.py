"""Hugging Face checkpoints: config translation and parameter-name maps (LLaMA 3, Qwen3, Qwen3-MoE;
DeepSeek-V3 in models/hf_deepseek_v3.py, whose experts and RoPE rows are transformed).

Pure functions, no file I/O: `trainer/hf_checkpoint.py` and `scripts/convert_hf.py` read
and write the folders. No q/k permutation is needed: our RoPE (`models/layers.py`) is the
rotate-half form with real cos/sin tables, i.e. HF's layout (HF's own conversion script
permutes Meta's interleaved checkpoints into this layout), so ``wq``/``wk`` are copied as
they are. Tied embeddings (``tie_word_embeddings``) are untied on the way in: ``output``
starts as a copy of ``tok_embeddings`` and trains on its own, so an export always writes
``lm_head.weight`` and ``tie_word_embeddings = false``. Qwen3-MoE's experts are one HF tensor
each and one stacked parameter of ours per layer and projection: models/hf_experts.py.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from . import hf_deepseek_v3 as dsv3
from .hf_base import HFConfigError, HFTensors, rope_config
from .hf_experts import expert_hf_keys, is_stacked_experts
from .llama3 import Llama3Args
from .qwen3 import Qwen3Args
from .qwen3_moe import Qwen3MoeArgs

__all__ = ["HF_ARCHITECTURES", "HFConfigError", "HFTensors", "args_from_hf_config", "hf_config_from_args",
           "to_hf_key", "from_hf_key", "hf_state_keys", "hf_tensor_map", "hf_skipped"]

HF_ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "llama3", "Qwen3ForCausalLM": "qwen3",
                                    "Qwen3MoeForCausalLM": "qwen3_moe", dsv3.ARCH: "deepseek_v3"}
"""HF ``architectures[0]`` -> our model name."""
_MODEL_TYPE = {"llama3": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
               "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}
_ARGS_CLS = {"llama3": Llama3Args, "qwen3": Qwen3Args, "qwen3_moe": Qwen3MoeArgs}


# ours -> HF, per block (after "layers.{i}.") and outside the blocks
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",  # Qwen3-MoE; its experts: models/hf_experts.py
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}
_OURS_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf_key(key: str) -> str:
    """Our parameter name -> HF's (``layers.0.attention.wq.weight`` -> ``model.layers.0.self_attn.q_proj.weight``)."""
    if key in _TOP:
        return _TOP[key]
    m = _OURS_RE.match(key)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter {key!r}")


def from_hf_key(key: str) -> str:
    """HF's parameter name -> ours (inverse of `to_hf_key`)."""
    if key in _TOP_INV:
        return _TOP_INV[key]
    m = _HF_RE.match(key)
    if m and m.group(2) in _BLOCK_INV:
        return f"layers.{m.group(1)}.{_BLOCK_INV[m.group(2)]}"
    raise KeyError(f"no parameter of ours for Hugging Face tensor {key!r}")


def hf_state_keys(keys: list[str]) -> dict[str, str]:
    """{our key: HF key} for our state-dict keys (buffers have no HF name and are skipped)."""
    out = {}
    for k in keys:
        try:
            out[k] = to_hf_key(k)
        except KeyError:
            continue
    return out


def _arch(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in HF_ARCHITECTURES:
        raise HFConfigError(f"architecture {arch!r} (model_type {cfg.get('model_type')!r}) is not supported; "
                            f"supported: {sorted(HF_ARCHITECTURES)}")
    return HF_ARCHITECTURES[arch]


def _check_supported(cfg: dict[str, Any], arch: str, unsupported: list[str] | None = None) -> None:
    """Options our models do not implement are one error, not silently different logits
    (``unsupported``: those a family's own check found)."""
    unsupported = list(unsupported or [])
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act = {cfg['hidden_act']!r} (only 'silu')")
    for k in ("attention_bias", "mlp_bias"):
        if cfg.get(k):
            unsupported.append(f"{k} = true")
    if arch in ("qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
        unsupported.append("use_sliding_window = true")
    if arch == "qwen3_moe":
        unsupported += _qwen3_moe_unsupported(cfg)
    _, rs = rope_config(cfg)
    if rs and rs.get("rope_type", rs.get("type")) not in ("llama3", "default"):
        unsupported.append(f"rope_scaling type {rs.get('rope_type', rs.get('type'))!r} (only 'llama3')")
    if unsupported:
        raise HFConfigError(f"{', '.join(unsupported)}: not supported by our {arch} model")


def args_from_hf_config(cfg: dict[str, Any]) -> tuple[str, Llama3Args]:
    """(our model name, its args) from an HF ``config.json`` dict; another architecture or an
    option our model lacks raises `HFConfigError`."""
    name = _arch(cfg)
    if name == "deepseek_v3":
        _check_supported({**cfg, "rope_parameters": None, "rope_scaling": None}, name, dsv3.unsupported(cfg))
        return name, dsv3.args_from_hf(cfg)
    _check_supported(cfg, name)
    n_heads = cfg["num_attention_heads"]
    kw: dict[str, Any] = dict(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads, vocab_size=cfg["vocab_size"],
        ffn_hidden_dim=cfg["intermediate_size"] if name != "qwen3_moe" else 0, norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_config(cfg)[0], max_seq_len=cfg.get("max_position_embeddings", 2048),
        qk_norm=name in ("qwen3", "qwen3_moe"))
    if name == "qwen3_moe":
        kw.update(_qwen3_moe_args(cfg))
    rs = rope_config(cfg)[1]
    if rs:
        kw.update(rope_scaling_factor=float(rs["factor"]), rope_low_freq_factor=float(rs["low_freq_factor"]),
                  rope_high_freq_factor=float(rs["high_freq_factor"]),
                  rope_original_max_seq_len=int(rs["original_max_position_embeddings"]))
    return name, _ARGS_CLS[name](**kw)


def hf_config_from_args(name: str, args: Llama3Args, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` dict for our model (``base``: the config it was loaded from,
    whose other entries are kept); always untied (see the module doc)."""
    if name == "deepseek_v3":
        return dsv3.hf_config(args, base)
    if name not in _MODEL_TYPE:
        raise HFConfigError(f"model {name!r} has no Hugging Face export; supported: {sorted(_MODEL_TYPE)}")
    model_type, arch = _MODEL_TYPE[name]
    cfg = dict(base or {})
    cfg.update(
        architectures=[arch], model_type=model_type, hidden_size=args.dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        vocab_size=args.vocab_size, intermediate_size=args.ffn_hidden_dim, rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta, max_position_embeddings=args.max_seq_len, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=False)
    if name == "llama3":
        cfg["mlp_bias"] = False
    if name == "qwen3_moe":
        _qwen3_moe_config(cfg, args, base or {})
    scaling = args.rope_scaling()
    cfg.pop("rope_scaling", None)
    rope: dict[str, Any] = {"rope_theta": args.rope_theta, "rope_type": "default"}
    if scaling is not None:
        rope.update(rope_type="llama3", factor=scaling[0], low_freq_factor=scaling[1], high_freq_factor=scaling[2],
                    original_max_position_embeddings=scaling[3])
    cfg["rope_parameters"] = rope  # transformers 5's form (older ones read rope_theta, rope_scaling)
    return cfg


def args_overrides_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The HF config's non-shape arguments (RoPE base and scaling, norm eps) as overrides of a
    flavor's: a job started from HF weights computes what the checkpoint was trained with."""
    name, args = args_from_hf_config(cfg)
    if name == "deepseek_v3":
        return {"norm_eps": args.norm_eps, "rope_theta": args.rope_theta, **dsv3.override_args(args)}
    keep = ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
            "rope_original_max_seq_len", "route_norm", "n_activated_experts")  # the last two: Qwen3-MoE's routing
    return {k: getattr(args, k) for k in keep if k in {f.name for f in dataclasses.fields(args)}}


# ---------------------------------------------------------------------------------- Qwen3-MoE


def _n_experts(cfg: dict[str, Any]) -> int:
    """Hub configs say ``num_experts``; transformers 5 writes ``num_local_experts`` (its alias)."""
    return int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)


def _qwen3_moe_unsupported(cfg: dict[str, Any]) -> list[str]:
    """Qwen3-MoE options our model lacks: dense layers among the MoE ones, shared experts.
    (``router_aux_loss_coef`` / ``output_router_logits`` only add a training loss: ignored.)"""
    out = []
    if cfg.get("decoder_sparse_step", 1) != 1:
        out.append(f"decoder_sparse_step = {cfg['decoder_sparse_step']!r} (dense layers between MoE layers; "
                   "only 1: every layer MoE)")
    if cfg.get("mlp_only_layers"):
        out.append(f"mlp_only_layers = {cfg['mlp_only_layers']!r} (dense layers; only [])")
    if _n_experts(cfg) <= 0:
        out.append(f"num_experts = {cfg.get('num_experts', cfg.get('num_local_experts'))!r} (no MoE layers; "
                   "a dense checkpoint is Qwen3ForCausalLM)")
    for k in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if cfg.get(k):
            out.append(f"{k} = {cfg[k]!r} (shared experts; Qwen3-MoE has none)")
    return out


def _qwen3_moe_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """Our Qwen3-MoE arguments from the HF config (transformers' default ``norm_topk_prob`` is false)."""
    n, k = _n_experts(cfg), cfg.get("num_experts_per_tok")
    if not isinstance(k, int) or not 0 < k <= n:
        raise HFConfigError(f"num_experts_per_tok = {k!r}: must be an integer in 1..num_experts ({n})")
    return dict(ffn_hidden_dim=0, moe_inter_dim=cfg["moe_intermediate_size"], n_routed_experts=n,
                n_activated_experts=k, route_norm=bool(cfg.get("norm_topk_prob", False)))


def _qwen3_moe_config(cfg: dict[str, Any], args: Qwen3MoeArgs, base: dict[str, Any]) -> None:
    """The MoE entries of an exported config, in place; ``intermediate_size`` (dense layers,
    none here) is the source config's, or left out."""
    cfg.pop("num_local_experts", None)
    cfg.pop("intermediate_size", None)
    if "intermediate_size" in base:
        cfg["intermediate_size"] = base["intermediate_size"]
    cfg.update(num_experts=args.n_routed_experts, num_experts_per_tok=args.n_activated_experts,
               moe_intermediate_size=args.moe_inter_dim, norm_topk_prob=args.route_norm, decoder_sparse_step=1,
               mlp_only_layers=[], use_sliding_window=False)


def hf_tensor_map(name: str, args: Any, shapes: dict[str, tuple[int, ...]],
                  hf_cfg: dict[str, Any] | None = None) -> dict[str, HFTensors]:
    """{our key: its HF tensors} for our state dict's {key: shape} (keys without an HF name,
    such as buffers, left out); ``hf_cfg``: the checkpoint's config (its RoPE layout)."""
    if name == "deepseek_v3":
        return dsv3.tensor_map(args, shapes, bool((hf_cfg or {}).get("rope_interleave", True)))
    names = hf_state_keys([k for k in shapes if not is_stacked_experts(k)])
    out = {k: HFTensors((names[k],), (tuple(shapes[k]),)) for k in names}
    for k, shape in shapes.items():  # Qwen3-MoE: stacked experts <-> one HF tensor per expert
        if is_stacked_experts(k):
            out[k] = HFTensors(tuple(expert_hf_keys(k, shape[0])), (tuple(shape[1:]),) * shape[0],
                               join=torch.stack, split=lambda t: list(t.unbind(0)))
    return out


def hf_skipped(name: str, key: str, hf_cfg: dict[str, Any]) -> bool:
    """An HF tensor our model does not use (DeepSeek-V3's multi-token-prediction layer)."""
    return name == "deepseek_v3" and dsv3.skipped(key, hf_cfg)
