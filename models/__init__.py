"""Model registry: name -> ModelSpec(model class, args class, flavors).

Usage::

    model = build_model("llama3", "debug", device="meta", vocab_size=256)
    model.to_empty(device="cpu"); torch.manual_seed(0); model.init_weights()

``build_model`` never runs ``nn.Module`` default initialisers: the module is always
constructed on the meta device; for a real device it is then ``to_empty``-ed and
``init_weights()`` is called, so ``torch.manual_seed(s); build_model(..., device="cpu")``
equals a meta build followed by ``to_empty`` + ``torch.manual_seed(s)`` + ``init_weights``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, DeepSeekV3Model
from .llama3 import LLAMA3_FLAVORS, Llama3Args, Llama3Model
from .qwen3 import QWEN3_FLAVORS, Qwen3Args, Qwen3Model
from .qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeArgs, Qwen3MoeModel

__all__ = [
    "ModelSpec",
    "MODEL_SPECS",
    "get_model_spec",
    "build_model",
    "meta_copy",
    "model_args",
    "cross_entropy_loss",
    "transformer_blocks",
]


@dataclass
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, Any]


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama3": ModelSpec("llama3", Llama3Model, Llama3Args, LLAMA3_FLAVORS),
    "qwen3": ModelSpec("qwen3", Qwen3Model, Qwen3Args, QWEN3_FLAVORS),
    "deepseek_v3": ModelSpec("deepseek_v3", DeepSeekV3Model, DeepSeekV3Args, DEEPSEEK_V3_FLAVORS),
    "qwen3_moe": ModelSpec("qwen3_moe", Qwen3MoeModel, Qwen3MoeArgs, QWEN3_MOE_FLAVORS),
}


ARG_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim", "max_seq_len", "n_dense_layers",
            "inter_dim", "moe_inter_dim", "n_routed_experts", "n_shared_experts", "n_activated_experts")
"""The model arguments a job (`[model]`) or a sweep axis may set over a flavor's; each family
checks which of them it takes."""


def get_model_spec(name: str) -> ModelSpec:
    """Look up a model family; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return MODEL_SPECS[name]
    except KeyError:
        raise ValueError(
            f"unknown model name {name!r}; known models: {sorted(MODEL_SPECS)}"
        ) from None


def model_args(name: str, flavor: str, **arg_overrides: Any) -> Any:
    """The (copied) args dataclass of ``name/flavor`` with ``arg_overrides`` applied."""
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise ValueError(
            f"unknown flavor {flavor!r} for model {name!r}; known flavors: {list(spec.flavors)}"
        )
    args = spec.flavors[flavor]
    fields = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(arg_overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown {name} argument(s) {unknown}; valid fields: {sorted(fields)}"
        )
    if hasattr(args, "override"):
        return args.override(**arg_overrides)
    return dataclasses.replace(args, **arg_overrides)


def build_model(
    name: str, flavor: str, *, device: torch.device | str = "meta", **arg_overrides: Any
) -> nn.Module:
    """Build ``name/flavor``. On ``meta`` the weights are uninitialised; on any other
    device the model is materialised and ``init_weights()`` is called (uses the global RNG).
    """
    spec = get_model_spec(name)
    args = model_args(name, flavor, **arg_overrides)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes and
    dtypes, without copying the weights (real ones, or a dry run's fake ones, which
    `.to("meta")` of a copy cannot swap: fake tensors carry weak references). Tied weights
    stay tied; buffers lose their values, as a meta build's have none."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all ``B*S`` tokens, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model (``model.layers``, see ``DecoderBase``): the units that
    FSDP shards, activation checkpointing wraps and ``compile`` compiles one by one."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):  # a pipeline stage's blocks, keyed by their index in the model
        return list(layers.values())
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no 'layers' ModuleList of transformer blocks")
    return list(layers)
