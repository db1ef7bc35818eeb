"""The one place that touches private torch APIs (torch 2.13).

Everything else in the project imports these names from here, so a torch upgrade
only has to be fixed in this file. It also registers what torch lacks for the
planner: a sharding rule and a FLOP formula for the CPU flash-attention ops.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._functorch._aot_autograd.descriptors import (  # noqa: F401
    AOTInput,
    AOTOutput,
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._collective_utils import redistribute_cost  # noqa: F401
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._op_schema import (  # noqa: F401
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops.single_dim_strategy import (  # noqa: F401
    _ShardingPlaceholder,
    _SingleDimStrategyInfo,
    register_single_dim_strategy,
)
from torch.distributed.tensor._ops.utils import (  # noqa: F401
    expand_to_full_mesh_op_strategy,
    is_tensor_shardable,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
from torch.distributed.tensor.placement_types import (  # noqa: F401
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

try:  # vocab-parallel embedding placement (a Partial subclass)
    from torch.distributed.tensor._ops._embedding_ops import _MaskPartial  # noqa: F401
except ImportError:  # pragma: no cover - location moved between versions
    _MaskPartial = Partial  # type: ignore[misc,assignment]

aten = torch.ops.aten

CPU_ATTENTION_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_ATTENTION_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def sharding_propagator() -> Any:
    """DTensor's global sharding propagator (rules registry)."""
    return DTensor._op_dispatcher.sharding_propagator


def clear_sharding_caches() -> None:
    """Drop DTensor's propagation caches after (re)registering a rule."""
    prop = sharding_propagator()
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        fn = getattr(prop, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


# ---------------------------------------------------------------------------
# Fake world for planning without hardware
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake default process group of `world_size` ranks (rank 0) for planning.

    Re-entrant: if a default group of the same size already exists it is reused and
    left alone on exit. Meshes built inside must use device_type "cpu".
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"a process group of size {dist.get_world_size()} is already initialised; "
                f"cannot open a fake world of size {world_size}"
            )
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# CPU flash attention: sharding rule + FLOP formula
# ---------------------------------------------------------------------------

_registered = False
_lock = threading.Lock()


def _attention_fwd_rule(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
    # outputs (out [B,H,S,D], logsumexp [B,H,S]); inputs (q, k, v [, attn_mask])
    n_in = 3 + (1 if isinstance(kwargs_schema.get("attn_mask"), TensorMeta) else 0)
    rules = []
    for d in (0, 1):  # batch, heads; sequence sharding needs a context-parallel contract
        rules.append([_ShardingPlaceholder(d)] * (2 + n_in))
    return rules


def _attention_bwd_rule(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
    # outputs (grad_q, grad_k, grad_v); inputs (grad_out, q, k, v, out, logsumexp [, attn_mask])
    n_in = 6 + (1 if isinstance(kwargs_schema.get("attn_mask"), TensorMeta) else 0)
    return [[_ShardingPlaceholder(d)] * (3 + n_in) for d in (0, 1)]


def _attention_fwd_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    # Same convention as torch's GPU flash formula (causal masking not discounted).
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _attention_bwd_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def register_planner_ops() -> None:
    """Register our sharding rules and FLOP formulas (idempotent).

    DTensor ships no rule for the CPU flash-attention ops and FlopCounterMode counts
    them as zero, so both are registered here: batch (dim 0) or head (dim 1) sharding
    of every input and output, and torch's SDPA FLOP count.
    """
    global _registered
    with _lock:
        if _registered:
            return
        prop = sharding_propagator()
        for op, rule in ((CPU_ATTENTION_FWD, _attention_fwd_rule), (CPU_ATTENTION_BWD, _attention_bwd_rule)):
            if op not in prop.op_single_dim_strategy_funcs and op not in prop.op_strategy_funcs:
                register_single_dim_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=4 if op is CPU_ATTENTION_FWD else 6, static_kwargkey=["scale"]))(rule)
        from torch.utils.flop_counter import flop_registry

        packets = (
            (aten._scaled_dot_product_flash_attention_for_cpu, _attention_fwd_flops),
            (aten._scaled_dot_product_flash_attention_for_cpu_backward, _attention_bwd_flops),
        )
        for packet, formula in packets:
            if packet not in flop_registry:
                register_flop_formula(packet, get_raw=True)(formula)
        clear_sharding_caches()
        _registered = True


# ---------------------------------------------------------------------------
# cost-model helper block (owner: parallel/auto/cost). DTensor's own redistribution
# plan, used by tests/parallel/auto/test_cost*.py to check that cost/comm.py decomposes
# src -> dst placements the way DTensor's redistribute does.
# ---------------------------------------------------------------------------
from torch.distributed.tensor._redistribute import (  # noqa: E402,F401
    _gen_transform_infos_non_cached as gen_transform_infos,
)


# ---------------------------------------------------------------------------
# Private torch APIs used outside the planner (trainer, recipes, cost model). They are
# re-exported here so that a torch upgrade touches this file only.
# ---------------------------------------------------------------------------
from torch._ops import OpOverload, OpOverloadPacket  # noqa: E402,F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten  # noqa: E402,F401

foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A 1-D mesh over all axes of ``mesh`` (torch 2.13 has no public flatten)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """Split axis ``dim`` of ``mesh`` into named axes of ``sizes`` (no public API in 2.13)."""
    return mesh._unflatten(dim, sizes, names)
