"""Activation checkpointing (AC) of transformer blocks, full or selective (SAC).

Part of the parallel layer (it used to live in the trainer): :func:`parallel.recipes.apply_recipe`
applies it to the model's blocks, the trainer's ``[activation_checkpoint]`` section picks
``mode`` and ``selective_ac_option``:

* ``"none"``      -- keep every activation.
* ``"full"``      -- keep only each block's input; recompute the block in backward.
* ``"selective"`` with ``selective_ac_option``:
    - an integer ``N`` (or its string) -- full AC on every N-th block (blocks 0, N, 2N, ...);
    - ``"op"`` -- per-op SAC inside every block with torch's SAC API
      (``create_selective_checkpoint_contexts``): save the outputs of attention and of
      every other matmul (and of reduce-scatters / max), recompute the rest
      (norms, activations, elementwise ops, all-gathers).

The block's ``forward`` is replaced by a non-reentrant ``torch.utils.checkpoint`` call of
the original one on the same module object, so parameter names (FQNs), FSDP/TP hooks and
``state_dict`` are unchanged. Apply before FSDP (as :func:`parallel.recipes.apply_recipe`
does). Results are bit-identical to ``mode = "none"`` (no dropout, no RNG in the models).
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models import transformer_blocks
from parallel import _torch as T

__all__ = ["AC_CHOICES", "apply_ac", "block_policies", "sac_policy_context", "SAC_SAVE_OPS",
           "recompute_parameter_views", "tag_recomputation"]

aten = torch.ops.aten


def _save_ops() -> set:
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.max.default}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"):
        op = getattr(aten, name, None)
        if op is not None:
            ops.add(op.default)
    for ns in ("_c10d_functional",):
        rs = getattr(getattr(torch.ops, ns), "reduce_scatter_tensor", None)
        if rs is not None:
            ops.add(rs.default)
    return ops


SAC_SAVE_OPS = _save_ops()
_MM_OPS = {aten.mm.default, aten.addmm.default}


def _policy(counts):
    def policy(ctx, func, *args, **kwargs):
        if func in _MM_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            # save every other matmul output (odd ones), recompute the even ones
            return (CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        if func in SAC_SAVE_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def sac_policy_context() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: per-op SAC policy.
    A fresh matmul counter per call keeps forward and recompute in step."""
    return create_selective_checkpoint_contexts(_policy(defaultdict(int)))


def _checkpointed_forward(orig_forward, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():
        return orig_forward(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(orig_forward, *args, use_reentrant=False, preserve_rng_state=False,
                      **extra, **kwargs)


def _wrap(block: nn.Module, context_fn=None) -> None:
    if getattr(block, "_ac_wrapped", False):
        return
    orig = block.forward  # bound method of the class' forward
    block.forward = functools.partial(_checkpointed_forward, orig, context_fn)
    block._ac_wrapped = True


def apply_ac(model: nn.Module, mode: str = "full", selective_ac_option: str | int = "op") -> nn.Module:
    """Checkpoint the model's transformer blocks in place per ``mode`` (see the module
    docstring); returns the model. Apply before FSDP so the wrapped forward is sharded."""
    if mode == "none":
        return model
    blocks = transformer_blocks(model)
    if mode == "full":
        for b in blocks:
            _wrap(b)
        return model
    if mode != "selective":
        raise ValueError(f"activation_checkpoint.mode must be none|full|selective, got {mode!r}")
    opt = str(selective_ac_option)
    if opt == "op":
        for b in blocks:
            _wrap(b, sac_policy_context)
        return model
    if not opt.isdigit() or int(opt) < 1:
        raise ValueError("activation_checkpoint.selective_ac_option must be 'op' or a positive "
                         f"integer as a string, got {opt!r}")
    every = int(opt)
    for i, b in enumerate(blocks):
        if i % every == 0:
            _wrap(b)
    return model


# ---------------------------------------------------------------------------
# The same policies on a traced joint graph (auto mode): recompute tags for the partitioner
# ---------------------------------------------------------------------------


def _seeded(n: Any) -> bool:
    """Random ops (attention's dropout slot counts, even at p = 0) and their tuple outputs."""
    if n.target is operator.getitem:
        n = n.args[0]
    return torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


_PARAMETER_VIEWS = {"t", "transpose", "view", "_unsafe_view", "reshape", "_to_copy", "permute", "expand",
                    "unsqueeze", "squeeze", "detach", "alias"}


def recompute_parameter_views(forward_nodes: list[Any], params: set[str], block_of: dict[str, int]) -> int:
    """Tag the forward's views of parameters (a transposed weight, a cast one) for
    recomputation, so the backward takes them from the sharded parameter again instead of
    keeping the gathered copy from the forward: FSDP's reshard after forward. Tags already
    set (MUST_SAVE by an AC policy) are kept. Returns the number of nodes tagged."""
    derived, tagged = set(params), 0
    for n in forward_nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if T.op_name(n.target) not in _PARAMETER_VIEWS or not all(a.name in derived for a in n.all_input_nodes):
            continue
        derived.add(n.name)
        if n.meta.get("recompute") != CheckpointPolicy.MUST_SAVE:
            n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            n.meta["ac_graph_id"] = block_of.get(n.name, -1)
            tagged += 1
    return tagged


AC_CHOICES = ("none", "op", "full")
"""Activation checkpointing of one transformer block on the joint graph: keep every activation
("none"), per-op SAC as the "op" policy above ("op"), or keep only the block's input and
recompute the whole block ("full")."""


def block_policies(mode: str, selective_ac_option: str | int, n_blocks: int) -> tuple[str, ...]:
    """The `AC_CHOICES` entry of each of `n_blocks` blocks under the job's `mode` and
    `selective_ac_option` (every N-th block: "full" on blocks 0, N, 2N, ..., "none" elsewhere)."""
    if mode in ("none", "full"):
        return (mode,) * n_blocks
    opt = str(selective_ac_option)
    if mode != "selective" or not (opt == "op" or (opt.isdigit() and int(opt) >= 1)):
        raise ValueError(f"activation checkpointing mode {mode!r} with option {opt!r}: use mode none|full|"
                         "selective, and with selective the option 'op' or a positive integer N")
    if opt == "op":
        return ("op",) * n_blocks
    return tuple("full" if i % int(opt) == 0 else "none" for i in range(n_blocks))


def _op_policy(n: Any, mm_count: dict[int, int], b: int) -> Any:
    """Per-op SAC of one node of block `b`: every other matmul and the attention outputs saved."""
    if n.target in _MM_OPS:
        mm_count[b] += 1
        return CheckpointPolicy.MUST_SAVE if mm_count[b] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
    if n.target in SAC_SAVE_OPS or (n.target is operator.getitem and n.args[0].target in SAC_SAVE_OPS):
        return CheckpointPolicy.MUST_SAVE  # attention outputs (and their getitems)
    return CheckpointPolicy.PREFER_RECOMPUTE


def tag_recomputation(forward_nodes: list[Any], block_of: dict[str, int], policies: Sequence[str]) -> int:
    """Tag the forward nodes of a joint graph for torch's partitioner, block by block.

    `block_of`: node name -> transformer block index (nodes outside blocks are never
    recomputed); `policies[i]`: block i's `AC_CHOICES` entry (`block_policies` maps the job's
    settings). "full" recomputes every op of the block, so only its inputs are saved; "op"
    saves attention outputs and every other matmul of the block (a counter per block) and
    recomputes the rest, as the eager policy above does; "none" tags nothing. Each block is its
    own region (`ac_graph_id`), so values crossing blocks are saved. Returns the number of
    nodes tagged for recomputation.
    """
    bad = [p for p in policies if p not in AC_CHOICES]
    if bad:
        raise ValueError(f"activation checkpointing choices {bad}: use one of {', '.join(AC_CHOICES)}")
    for n in forward_nodes:  # a graph may be tagged again with another policy
        n.meta.pop("recompute", None)
        n.meta.pop("ac_graph_id", None)
    mm_count: dict[int, int] = defaultdict(int)
    tagged = 0
    for n in forward_nodes:
        b = block_of.get(n.name)
        if b is None or n.op != "call_function":
            continue
        if b >= len(policies):
            raise ValueError(f"block {b} has no activation checkpointing choice ({len(policies)} given)")
        if policies[b] == "none":
            continue
        policy = _op_policy(n, mm_count, b) if policies[b] == "op" else CheckpointPolicy.PREFER_RECOMPUTE
        if _seeded(n):  # the partitioner would thread RNG state through a recomputed random op
            policy = CheckpointPolicy.MUST_SAVE
        n.meta["recompute"] = policy
        n.meta["ac_graph_id"] = b
        tagged += policy == CheckpointPolicy.PREFER_RECOMPUTE
    return tagged
