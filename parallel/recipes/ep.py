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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from parallel import _torch as T
from parallel.mesh import (
    CP,
    DP_REPLICATE,
    DP_SHARD,
    DP_SHARD_CP,
    DP_SHARD_MOD_EP,
    EP,
    axis_names,
    axis_size,
    flatten_axes,
    submesh,
)

from .errors import RecipeError

__all__ = ["expert_parallel_dispatch", "ep_dispatch_tokens", "ep_combine_tokens", "validate_ep",
           "validate_ep_model", "validate_ep_mesh", "build_ep_meshes", "apply_ep", "experts_fsdp_filter"]

_KEY = "expert_parallel_degree"


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all rows of ``x``: send ``in_splits[r]`` rows to rank ``r``, receive ``out_splits[r]``.
    Torch's differentiable functional collective (the backward is the reverse all-to-all; it
    also traces into graphs); works on gloo and on the fake process group."""
    out = T.all_to_all_single_autograd(x.contiguous(), list(out_splits), list(in_splits), group)
    return T.wait_tensor(out)


def validate_ep(num_experts: int, ep_size: int) -> None:
    """``RecipeError`` unless ``ep_size`` divides the number of routed experts."""
    if ep_size < 1 or num_experts % ep_size != 0:
        raise RecipeError(_KEY, ep_size, f"does not divide the number of routed experts ({num_experts}); "
                          f"choose a divisor of {num_experts}")


def validate_ep_model(model_args: Any, ep_size: int) -> None:
    """``RecipeError`` unless the model has routed experts and ``ep_size`` divides their number."""
    n = getattr(model_args, "n_routed_experts", 0)
    if not n:
        raise RecipeError(_KEY, ep_size, "the model has no routed experts; set it to 1")
    validate_ep(n, ep_size)


def validate_ep_mesh(mesh: DeviceMesh, ep_size: int) -> None:
    """``RecipeError`` unless ``dp_shard x cp`` of ``mesh`` has room for ``ep_size`` ranks and
    there is no ``dp_replicate`` axis (EP with HSDP is not written)."""
    names = axis_names(mesh)
    if DP_REPLICATE in names:
        raise RecipeError(_KEY, ep_size, "expert parallel with data_parallel_replicate_degree > 1 (HSDP) is "
                          "not supported by the recipes; set data_parallel_replicate_degree = 1 and "
                          "borrow the ep ranks from data_parallel_shard_degree")
    borrowed = axis_size(mesh, DP_SHARD) * axis_size(mesh, CP)
    if borrowed % ep_size:
        raise RecipeError(_KEY, ep_size, f"must divide data_parallel_shard_degree x context_parallel_degree "
                          f"= {borrowed} (expert parallel borrows those ranks); change either degree")


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


@dataclass(slots=True)
class EPDispatchState:
    """What :func:`ep_combine_tokens` needs to undo :func:`ep_dispatch_tokens`."""

    group: dist.ProcessGroup
    send_splits: list[int]
    recv_splits: list[int]
    inv: torch.Tensor


def ep_dispatch_tokens(x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor, group: dist.ProcessGroup,
                       ep: int) -> tuple[torch.Tensor, torch.Tensor, EPDispatchState]:
    """First half of the dispatch: returns ``(x_local, counts_local, state)`` where
    ``x_local`` holds the rows for this rank's experts sorted by local expert."""
    E = num_tokens_per_expert.numel()
    validate_ep(E, ep)
    e_loc = E // ep
    if T.is_fake(num_tokens_per_expert):
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
    x_recv = _all_to_all(x_sorted, recv_splits, send_splits, group)
    idx = _regroup_index(recv)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return x_recv.index_select(0, idx), recv.sum(0), EPDispatchState(group, send_splits, recv_splits, inv)


def _balanced_dispatch(x_sorted: torch.Tensor, group: dist.ProcessGroup, ep: int,
                       e_loc: int) -> tuple[torch.Tensor, torch.Tensor, EPDispatchState]:
    """Fake tensors (dry run / planning) have no routing data: assume perfectly balanced
    routing (``N/ep`` rows to every rank, ``N/E`` per expert) and keep the row order."""
    n = x_sorted.shape[0]
    splits = [n // ep + (1 if r < n % ep else 0) for r in range(ep)]
    # every rank is assumed to send the same splits, so rank r receives splits[r] from each
    me = dist.get_rank(group)
    recv_splits = [splits[me]] * ep
    x_recv = _all_to_all(x_sorted, recv_splits, splits, group)
    m = x_recv.shape[0]
    counts_local = torch.full((e_loc,), m // e_loc, dtype=torch.long, device=x_sorted.device)
    counts_local[: m % e_loc] += 1
    inv = torch.arange(m, device=x_sorted.device)
    return x_recv, counts_local, EPDispatchState(group, splits, recv_splits, inv)


def ep_combine_tokens(y_local: torch.Tensor, state: EPDispatchState) -> torch.Tensor:
    """Second half: undo the regroup and send the expert outputs back to their source rank."""
    y_recv = y_local.index_select(0, state.inv)
    return _all_to_all(y_recv, state.send_splits, state.recv_splits, state.group)


def expert_parallel_dispatch(x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                             expert_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             mesh: DeviceMesh, axis: str | None = EP) -> torch.Tensor:
    """Send expert-sorted rows to the ep rank owning each expert, run ``expert_fn`` there,
    and bring the results back in the original row order (differentiable w.r.t. ``x_sorted``
    and whatever ``expert_fn`` uses). See the module docstring for the contract."""
    ep_mesh = submesh(mesh, axis)
    group, ep = ep_mesh.get_group(), ep_mesh.size()
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
    ``dp_shard_mod_ep``.
    """
    validate_ep_mesh(mesh, ep)
    flat = flatten_axes(mesh, (DP_SHARD, CP), DP_SHARD_CP)
    d = flat.size()
    two_d = T.unflatten_mesh(flat, 0, (d // ep, ep), (DP_SHARD_MOD_EP, EP))
    return two_d[DP_SHARD_MOD_EP], two_d[EP]


@dataclass
class _ExpertsHooks:
    """The forward hooks of one EP-sharded experts module: dispatch its input rows to the
    ranks owning their experts, combine the outputs back (the state spans one call)."""

    group: dist.ProcessGroup
    ep: int
    state: EPDispatchState | None = None

    def pre(self, module: nn.Module, args: tuple) -> tuple:
        x_local, counts_local, self.state = ep_dispatch_tokens(args[0], args[1], self.group, self.ep)
        return (x_local, counts_local) + tuple(args[2:])

    def post(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        state, self.state = self.state, None
        return ep_combine_tokens(out, state)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """EP recipe: shard every ``moe.experts.{w1,w2,w3}`` as ``Shard(0)`` DTensors on
    ``ep_mesh`` (FQNs unchanged, so checkpoints stay consistent) and wrap the experts'
    forward (the narrow seam of models/moe.py) with the all-to-all dispatch/combine.
    Router and shared experts are untouched: they run on each rank's own tokens."""
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
        model.get_submodule(name[: -len(".experts")]).experts_seam = True  # dispatch goes through the hooks
        hooks = _ExpertsHooks(ep_mesh.get_group(), ep)
        mod.register_forward_pre_hook(hooks.pre)
        mod.register_forward_hook(hooks.post)
        n += 1
    if n == 0:
        raise RecipeError(_KEY, ep, "the model has no 'moe.experts' modules to shard; set it to 1")
    return model


def experts_fsdp_filter(experts_dp_mesh: DeviceMesh,
                        grad_divide_factor: int) -> Callable[[nn.Module, DeviceMesh, MixedPrecisionPolicy], None]:
    """A ``pre_shard`` hook for :func:`parallel.recipes.fsdp.apply_fsdp`: ``fully_shard`` the
    EP-sharded experts of a block over ``experts_dp_mesh`` before the block itself, dividing
    their gradients by the *whole* data-parallel size (the all-to-all backward already
    summed the contributions of the ep ranks)."""

    def fn(block: nn.Module, dp_mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
        moe = getattr(block, "moe", None)
        if moe is None or not isinstance(moe.experts.w1, DTensor):  # dense block, or experts not EP-sharded
            return
        fully_shard(moe.experts, mesh=experts_dp_mesh, mp_policy=policy)
        moe.experts.set_gradient_divide_factor(float(grad_divide_factor))
        if experts_dp_mesh.size() > 1:
            # SUM + explicit scaling instead of PREMUL_SUM (not available on gloo). Not on a
            # 1-rank mesh: there torch 2.13 FSDP would divide twice (copy / factor, then
            # the post-divide).
            moe.experts.set_force_sum_reduction_for_comms(True)

    return fn
