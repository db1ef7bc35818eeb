"""Routed experts between our stacked layout and Hugging Face's one tensor per expert.

Ours (models/moe.py): ``layers.{i}.moe.experts.w1`` / ``w3`` ``[E, hidden, dim]`` and ``w2``
``[E, dim, hidden]``, stacked so that grouped matmuls run all experts at once and expert
parallelism shards dim 0. HF checkpoints (Qwen3-MoE's, and other hub MoE checkpoints that
store ``mlp.experts.{j}``) keep ``model.layers.{i}.mlp.experts.{j}.gate_proj`` / ``up_proj``
``.weight [hidden, dim]`` and ``down_proj.weight [dim, hidden]``: slice ``j`` of ours, the
same matrix (no transpose). Pure names and views; the file side is trainer/hf_checkpoint.py.
"""

from __future__ import annotations

import re

import torch

__all__ = ["is_stacked_experts", "expert_hf_key", "expert_hf_keys", "split_experts", "stack_experts"]

_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_PROJ_INV = {v: k for k, v in _PROJ.items()}
_OURS_RE = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w[123])$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")


def is_stacked_experts(key: str) -> bool:
    """Whether our parameter ``key`` holds every expert of a layer (one HF tensor per slice)."""
    return _OURS_RE.match(key) is not None


def expert_hf_key(key: str, j: int) -> str:
    """HF name of expert ``j`` of our stacked ``key`` (``layers.0.moe.experts.w1``, 3 ->
    ``model.layers.0.mlp.experts.3.gate_proj.weight``)."""
    m = _OURS_RE.match(key)
    if m is None:
        raise KeyError(f"{key!r} is not a stacked experts parameter")
    return f"model.layers.{m.group(1)}.mlp.experts.{j}.{_PROJ[m.group(2)]}.weight"


def expert_hf_keys(key: str, n_experts: int) -> list[str]:
    """HF names of all ``n_experts`` slices of our stacked ``key``, in expert order."""
    return [expert_hf_key(key, j) for j in range(n_experts)]


def split_experts(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """{HF name: slice} of our stacked full tensor ``t`` (views, no copy)."""
    return {k: t[j] for j, k in enumerate(expert_hf_keys(key, t.shape[0]))}


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF per-expert tensors -> {our stacked name: tensor}; other names pass through unchanged.
    A layer whose experts are not numbered 0..E-1 without gaps raises KeyError."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        m = _HF_RE.match(k)
        if m is None:
            out[k] = t
            continue
        groups.setdefault(f"layers.{m.group(1)}.moe.experts.{_PROJ_INV[m.group(3)]}", {})[int(m.group(2))] = t
    for key, by_j in groups.items():
        if sorted(by_j) != list(range(len(by_j))):
            missing = sorted(set(range(max(by_j) + 1)) - set(by_j))
            raise KeyError(f"experts of {key!r} are not numbered 0..{max(by_j)}: missing {missing[:3]}")
        out[key] = torch.stack([by_j[j] for j in range(len(by_j))])
    return out
