"""Expert parallel (EP) for MoE layers: experts sharded over the ``ep`` mesh axis, tokens
sent to their experts and back with all-to-all (works on gloo).

Reusable core (the ``local_map`` contract for MoE dispatch will wrap it):

:func:`expert_parallel_dispatch` ``(x_sorted, num_tokens_per_expert, expert_fn, mesh, axis) -> y_sorted``

* ``x_sorted [N, dim]``: this rank's routed token copies, sorted by *global* expert id;
* ``num_tokens_per_expert [E]``: how many rows of ``x_sorted`` go to each global expert;
* ``expert_fn(x, counts_local) -> y``: runs this rank's ``E / ep`` local experts on rows
  sorted by local expert id (``counts_local [E/ep]``);
* returns ``y_sorted [N, dim_out]`` in the same row order as ``x_sorted``.

Steps: (1) all-to-all the per-expert counts, (2) all-to-all the token rows with split sizes
(rows for experts ``[r*E/ep, (r+1)*E/ep)`` go to ep rank ``r``), (3) regroup the received
rows (source-rank major) into local-expert-major order, (4) run the local experts,
(5) undo (3) and (2). Router, top-k weighting and shared experts stay outside: they run
on every rank's own tokens, so the dispatch is a drop-in for a grouped-experts call.
Global expert ``g`` lives on ep rank ``g // (E/ep)`` as local expert ``g % (E/ep)``,
i.e. the expert weights ``[E, ...]`` are ``Shard(0)`` over the ep axis.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from parallel import _torch as T

__all__ = ["all_to_all_single_autograd", "expert_parallel_dispatch", "ep_dispatch_tokens",
           "ep_combine_tokens", "validate_ep", "validate_ep_model", "build_ep_meshes", "apply_ep",
           "experts_fsdp_filter"]


class _AllToAllSingle(torch.autograd.Function):
    """Differentiable ``dist.all_to_all_single`` on dim 0 with split sizes (public c10d API)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        gin = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(gin, grad, output_split_sizes=ctx.in_splits,
                               input_split_sizes=ctx.out_splits, group=ctx.group)
        return gin, None, None, None


def all_to_all_single_autograd(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                               group) -> torch.Tensor:
    """All-to-all rows of ``x``: send ``in_splits[r]`` rows to rank ``r``, receive ``out_splits[r]``."""
    return _AllToAllSingle.apply(x, list(out_splits), list(in_splits), group)


def validate_ep(num_experts: int, ep_size: int) -> None:
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(f"expert_parallel_degree={ep_size} does not divide the number of "
                         f"experts ({num_experts})")


def validate_ep_model(model_args, ep_size: int) -> None:
    """``ValueError`` unless the model has routed experts and ``ep_size`` divides their number."""
    n = getattr(model_args, "n_routed_experts", 0)
    if not n:
        raise ValueError(f"expert_parallel_degree={ep_size} but the model has no routed experts")
    validate_ep(n, ep_size)


def _ep_group(mesh: DeviceMesh, axis: Optional[str]):
    sub = mesh if axis is None or mesh.mesh_dim_names is None or (
        mesh.ndim == 1 and mesh.mesh_dim_names[0] == axis) else mesh[axis]
    return sub, sub.get_group(), sub.size()


def _regroup_index(counts: torch.Tensor) -> torch.Tensor:
    """``counts [ep, E_loc]`` of received rows (source-rank major); return the permutation
    that sorts the rows local-expert major (``rows[idx]`` is expert-major)."""
    ep, e_loc = counts.shape
    starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).view(ep, e_loc)
    seg_starts = starts.t().reshape(-1)  # expert-major order of segments
    seg_lens = counts.t().reshape(-1)
    total = int(seg_lens.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=counts.device)
    seg_offsets = seg_lens.cumsum(0) - seg_lens
    seg_id = torch.repeat_interleave(torch.arange(seg_lens.numel(), device=counts.device), seg_lens)
    within = torch.arange(total, device=counts.device) - seg_offsets[seg_id]
    return seg_starts[seg_id] + within


class EPDispatchState:
    """What :func:`ep_combine_tokens` needs to undo :func:`ep_dispatch_tokens`."""

    __slots__ = ("group", "send_splits", "recv_splits", "inv")

    def __init__(self, group, send_splits, recv_splits, inv):
        self.group, self.send_splits, self.recv_splits, self.inv = group, send_splits, recv_splits, inv


def ep_dispatch_tokens(x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor, group,
                       ep: int) -> tuple[torch.Tensor, torch.Tensor, EPDispatchState]:
    """First half of the dispatch: returns ``(x_local, counts_local, state)`` where
    ``x_local`` holds the rows for this rank's experts sorted by local expert."""
    E = num_tokens_per_expert.numel()
    validate_ep(E, ep)
    e_loc = E // ep
    if _is_fake(num_tokens_per_expert):
        return _balanced_dispatch(x_sorted, group, ep, e_loc)
    counts = num_tokens_per_expert.detach().to(torch.long).contiguous()
    if int(counts.sum()) != x_sorted.shape[0]:
        raise ValueError(f"EP dispatch: {x_sorted.shape[0]} rows but the counts sum to "
                         f"{int(counts.sum())} (padding rows are not supported)")
    # (1) counts: recv[s, j] = rows source rank s sends to my local expert j
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    recv = recv.view(ep, e_loc)
    send_splits = counts.view(ep, e_loc).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    # (2) tokens out, (3) regroup source-major -> expert-major
    x_recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)
    idx = _regroup_index(recv)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return x_recv.index_select(0, idx), recv.sum(0), EPDispatchState(group, send_splits, recv_splits, inv)


def _is_fake(t: torch.Tensor) -> bool:
    from parallel._torch import FakeTensor

    return isinstance(t, FakeTensor)


def _balanced_dispatch(x_sorted, group, ep: int, e_loc: int):
    """Fake tensors (dry run / planning) have no routing data: assume perfectly balanced
    routing (``N/ep`` rows to every rank, ``N/E`` per expert) and keep the row order."""
    n = x_sorted.shape[0]
    splits = [n // ep + (1 if r < n % ep else 0) for r in range(ep)]
    # every rank is assumed to send the same splits, so rank r receives splits[r] from each
    me = dist.get_rank(group)
    recv_splits = [splits[me]] * ep
    x_recv = all_to_all_single_autograd(x_sorted, recv_splits, splits, group)
    m = x_recv.shape[0]
    counts_local = torch.full((e_loc,), m // e_loc, dtype=torch.long, device=x_sorted.device)
    counts_local[: m % e_loc] += 1
    inv = torch.arange(m, device=x_sorted.device)
    return x_recv, counts_local, EPDispatchState(group, splits, recv_splits, inv)


def ep_combine_tokens(y_local: torch.Tensor, state: EPDispatchState) -> torch.Tensor:
    """Second half: undo the regroup and send the expert outputs back to their source rank."""
    y_recv = y_local.index_select(0, state.inv)
    return all_to_all_single_autograd(y_recv, state.send_splits, state.recv_splits, state.group)


def expert_parallel_dispatch(x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                             expert_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             mesh: DeviceMesh, axis: Optional[str] = "ep") -> torch.Tensor:
    """Send expert-sorted rows to the ep rank owning each expert, run ``expert_fn`` there,
    and bring the results back in the original row order (differentiable w.r.t. ``x_sorted``
    and whatever ``expert_fn`` uses). See the module docstring for the contract."""
    sub, group, ep = _ep_group(mesh, axis)
    validate_ep(num_tokens_per_expert.numel(), ep)
    if ep == 1:
        return expert_fn(x_sorted, num_tokens_per_expert)
    x_local, counts_local, state = ep_dispatch_tokens(x_sorted, num_tokens_per_expert, group, ep)
    return ep_combine_tokens(expert_fn(x_local, counts_local), state)


# ----------------------------------------------------------------------------- recipe
def build_ep_meshes(mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """``(experts_dp_mesh, ep_mesh)`` borrowed from the data axes ``dp_shard x cp``.

    The flattened ``dp_shard_cp`` axis (size D) is unflattened into
    ``(dp_shard_mod_ep = D/ep, ep)``: ep groups are consecutive ranks of the data axis.
    Expert weights are ``Shard(0)`` on ``ep``; FSDP shards them further over
    ``dp_shard_mod_ep`` (with ``dp_replicate`` in front for HSDP).
    """
    from .hsdp import flatten_axes

    names = tuple(mesh.mesh_dim_names or ())
    axes = [a for a in ("dp_shard", "cp") if a in names]
    if not axes:
        raise ValueError(f"expert_parallel_degree={ep} needs a dp_shard or cp axis to borrow "
                         f"ranks from; mesh axes are {names}")
    flat = flatten_axes(mesh, axes, "dp_shard_cp")
    D = flat.size()
    if D % ep:
        raise ValueError(f"expert_parallel_degree={ep} must divide data_parallel_shard_degree x "
                         f"context_parallel_degree = {D}")
    two_d = T.unflatten_mesh(flat, 0, (D // ep, ep), ("dp_shard_mod_ep", "ep"))
    if "dp_replicate" in names:
        raise ValueError("expert parallel together with data_parallel_replicate_degree > 1 "
                         "(HSDP) is not supported by the manual recipes")
    return two_d["dp_shard_mod_ep"], two_d["ep"]


def _pre_hook(module, args):
    x, counts = args[0], args[1]
    x_local, counts_local, state = ep_dispatch_tokens(x, counts, module._ep_group, module._ep_size)
    module._ep_state = state
    return (x_local, counts_local) + tuple(args[2:])


def _post_hook(module, args, out):
    state, module._ep_state = module._ep_state, None
    return ep_combine_tokens(out, state)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """EP recipe: shard every ``moe.experts.{w1,w2,w3}`` as ``Shard(0)`` DTensors on
    ``ep_mesh`` (FQNs unchanged, so checkpoints stay consistent) and wrap the experts'
    forward (the narrow seam of models/moe.py) with the all-to-all dispatch/combine.
    Router and shared experts are untouched: they run on each rank's own tokens."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    if ep == 1:
        return model
    n = 0
    for name, mod in model.named_modules():
        if not name.endswith("moe.experts"):
            continue
        validate_ep(mod.w1.shape[0], ep)
        for pn in ("w1", "w2", "w3"):
            p = getattr(mod, pn)
            mod.register_parameter(pn, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]),
                                                    requires_grad=p.requires_grad))
        mod._ep_group, mod._ep_size = ep_mesh.get_group(), ep
        mod.register_forward_pre_hook(_pre_hook)
        mod.register_forward_hook(_post_hook)
        n += 1
    if n == 0:
        raise ValueError("expert_parallel_degree > 1 but the model has no 'moe.experts' modules")
    return model


def experts_fsdp_filter(experts_dp_mesh: DeviceMesh, grad_divide_factor: int):
    """A ``module_filter`` for :func:`parallel.recipes.hsdp.apply_hsdp`: ``fully_shard`` the
    EP-sharded experts of a block over ``experts_dp_mesh`` before the block itself, dividing
    their gradients by the *whole* data-parallel size (the all-to-all backward already
    summed the contributions of the ep ranks)."""
    from torch.distributed.fsdp import fully_shard

    def fn(block: nn.Module, dp_mesh: DeviceMesh, policy) -> None:
        moe = getattr(block, "moe", None)
        if moe is None or not hasattr(moe.experts, "_ep_group"):
            return
        fully_shard(moe.experts, mesh=experts_dp_mesh, mp_policy=policy)
        moe.experts.set_gradient_divide_factor(float(grad_divide_factor))
        if experts_dp_mesh.size() > 1:
            # SUM + explicit scaling instead of PREMUL_SUM (not available on gloo). Not on a
            # 1-rank mesh: there torch 2.13 FSDP would divide twice (copy / factor, then
            # the post-divide).
            moe.experts.set_force_sum_reduction_for_comms(True)

    return fn
