"""Tensor parallel (Megatron column/row split) with optional sequence parallel.

Public DTensor API only (``parallelize_module`` + parallel styles). Per transformer block::

    attention_norm, ffn_norm        SequenceParallel          (SP: activations Shard(1) = seq)
    attention                       PrepareModuleInput        Shard(1) -> Replicate (all-gather)
    attention.{wq,wk,wv}            ColwiseParallel           (local heads; the model views
                                                               with -1 heads)
    attention.{q_norm,k_norm}       SequenceParallel(dim=2)   (Qwen3: weights replicated,
                                                               heads sharded, grads reduced)
    attention.wo                    RowwiseParallel           -> Shard(1) (reduce-scatter)
    feed_forward                    PrepareModuleInput        Shard(1) -> Replicate
    feed_forward.{w1,w3} / w2       Colwise / Rowwise         -> Shard(1)

and for the model: ``tok_embeddings`` RowwiseParallel (vocab-sharded table, output
Shard(1)), ``norm`` SequenceParallel, ``output`` ColwiseParallel (vocab-parallel logits,
``Shard(-1)`` DTensor when loss parallel is on). Without sequence parallel the norms are
plain replicated modules and block boundaries are Replicate.

DeepSeek-V3 (MLA) dense parts: ``wq``/``wq_b`` and ``wkv_b`` colwise (heads), ``wo``
rowwise; the low-rank ``wq_a``/``wkv_a`` and their norms stay replicated; dense
``feed_forward`` as above; MoE layers (``moe``) are left to the EP recipe and see
replicated (all-gathered) inputs.

Loss parallel: the logits stay vocab-sharded; the trainer computes the loss *and* calls
``backward`` inside :func:`loss_parallel_context` (a no-op for models without it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from models import transformer_blocks

from .errors import RecipeError

__all__ = ["apply_tp", "validate_tp", "loss_parallel_context", "uses_loss_parallel", "loss_value"]

_LOSS_PARALLEL_ATTR = "_autotitan_loss_parallel"


def validate_tp(model_args: Any, tp: int) -> None:
    """Raise :class:`RecipeError` when ``tp`` does not divide a dimension the recipe shards:
    attention heads (and kv heads), the dense FFN hidden size, the vocabulary."""
    if tp <= 1:
        return
    for name in ("n_heads", "n_kv_heads", "ffn_hidden_dim", "inter_dim", "vocab_size"):
        val = getattr(model_args, name, None)
        if val and val % tp:
            raise RecipeError("tensor_parallel_degree", tp, f"does not divide the model's {name} = {val}; "
                              f"choose a degree that divides it")


def _block_plan(block: nn.Module, sp: bool) -> dict:
    seq = Shard(1) if sp else Replicate()
    plan: dict = {}
    if sp:
        plan["attention_norm"] = SequenceParallel()
        if hasattr(block, "ffn_norm"):
            plan["ffn_norm"] = SequenceParallel()
    attn = block.attention
    # attention(x, cos, sin): only the first input is an activation
    # MLA's replicated low-rank projections (wq_a, wkv_a) are plain Linears: give the
    # module a local tensor (one all-reduce per colwise projection in backward)
    plan["attention"] = _first_input(attn, seq, local=hasattr(attn, "wkv_a"))
    if hasattr(attn, "wkv_a"):  # DeepSeek-V3 MLA: shard heads of wq/wq_b and wkv_b
        plan["attention.wq_b" if getattr(attn, "wq_b", None) is not None else "attention.wq"] = ColwiseParallel()
        plan["attention.wkv_b"] = ColwiseParallel()
    else:
        for n in ("wq", "wk", "wv"):
            plan[f"attention.{n}"] = ColwiseParallel()
        if getattr(attn, "q_norm", None) is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["attention.wo"] = RowwiseParallel(output_layouts=seq)
    ff = getattr(block, "feed_forward", None)
    if ff is not None:
        plan["feed_forward"] = _first_input(ff, seq)
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w3"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
    elif getattr(block, "moe", None) is not None and sp:
        # MoE under TP+SP: replicated compute on the all-gathered sequence, output re-sharded
        # (the local slice of a replicated tensor: no communication forward).
        n = _n_required_inputs(block.moe)
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(seq,) + (None,) * (n - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (n - 1), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
    return plan


def _n_required_inputs(module: nn.Module) -> int:
    """Number of positional inputs without defaults of ``module.forward`` (>= 1)."""
    ps = inspect.signature(module.forward).parameters.values()
    return max(1, sum(1 for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      and p.default is p.empty))


def _first_input(module: nn.Module, seq, local: bool = False) -> PrepareModuleInput:
    """Redistribute the first (activation) input from ``seq`` to Replicate; others untouched.

    The module receives a Replicate *DTensor* (``use_local_output=False``): the Partial
    input-gradients of its colwise projections then add up as one DTensor and leave
    through a single reduce-scatter (SP) / all-reduce, instead of one all-reduce per
    projection."""
    n = _n_required_inputs(module)
    return PrepareModuleInput(input_layouts=(seq,) + (None,) * (n - 1),
                              desired_input_layouts=(Replicate(),) + (None,) * (n - 1),
                              use_local_output=local)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
             loss_parallel: bool = True) -> nn.Module:
    """Apply TP(+SP) in place on ``tp_mesh`` (1-D); returns the model."""
    tp = tp_mesh.size()
    if tp == 1:
        return model
    validate_tp(model.args, tp)
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sp:
        top["norm"] = SequenceParallel()
    top = {name: style for name, style in top.items() if getattr(model, name, None) is not None}  # a pipeline stage
    parallelize_module(model, tp_mesh, top)
    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, _block_plan(block, sp))
        attn = block.attention
        if hasattr(attn, "wkv_a"):
            attn.wkv_a.register_forward_hook(functools.partial(
                _mla_shared_rope_grad_hook, tp_mesh=tp_mesh, kv_lora_rank=attn.kv_lora_rank))
    if not any(p.is_meta for p in model.parameters()):
        # on meta, hooks would not survive to_empty: call register_partial_grad_hooks after it
        register_partial_grad_hooks(model)
    setattr(model, _LOSS_PARALLEL_ATTR, bool(loss_parallel))
    return model


def register_partial_grad_hooks(model: nn.Module) -> None:
    """Replicated weights fed by sharded activations (SP norms, Qwen3 q/k norms) get Partial
    gradients: reduce them once, when they are produced, so optimizer and clipping see
    Replicate grads. Idempotent. :func:`apply_tp` calls it unless the model is on ``meta``; then call it
    after ``to_empty``. FSDP replaces the parameters and handles Partial itself."""
    for h in getattr(model, "_autotitan_tp_hooks", []):
        h.remove()
    handles = []
    for p in model.parameters():
        if isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements):
            handles.append(p.register_post_accumulate_grad_hook(_replicate_partial_grad))
    model._autotitan_tp_hooks = handles


def _replicate_partial_grad(p) -> None:
    g = p.grad
    if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
        p.grad = g.redistribute(g.device_mesh, [Replicate()] * g.device_mesh.ndim)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient of the columns ``[start:]``
    over the tp mesh (expressed as a Partial -> Replicate DTensor redistribution)."""

    @staticmethod
    def forward(ctx, y, tp_mesh, start):
        ctx.tp_mesh, ctx.start = tp_mesh, start
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        head, tail = g[..., :ctx.start], g[..., ctx.start:].contiguous()
        tail = DTensor.from_local(tail, ctx.tp_mesh, [Partial()], run_check=False)
        tail = tail.redistribute(ctx.tp_mesh, [Replicate()]).to_local()
        return torch.cat([head, tail], dim=-1), None, None


def _mla_shared_rope_grad_hook(module, args, out, *, tp_mesh, kv_lora_rank):
    """MLA: ``wkv_a`` yields ``[latent | k_rope]``; ``k_rope`` is shared by all heads, so
    with heads sharded each rank only sees its heads' share of its gradient. (The latent
    part is complete: ``wkv_b``'s colwise input already all-reduces it.)"""
    return _SumGradOverTP.apply(out, tp_mesh, kv_lora_rank)


def uses_loss_parallel(model: nn.Module) -> bool:
    """True when :func:`apply_tp` left the logits vocab-sharded (the loss must be parallel too)."""
    return bool(getattr(model, _LOSS_PARALLEL_ATTR, False))


def loss_parallel_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """Context manager the trainer wraps around loss computation **and** ``backward``."""
    return loss_parallel() if uses_loss_parallel(model) else contextlib.nullcontext()


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """A plain tensor for logging (a loss-parallel loss is a Replicate DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
