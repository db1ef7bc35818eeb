"""The one module that touches private torch APIs (written against torch 2.13).

Everything else imports these names from here, so a torch upgrade is fixed in this file
(`tests/test_layering.py` fails when another module uses a `torch._…` name or a private
attribute of a torch object). Public torch APIs (`torch.distributed.tensor`, DeviceMesh,
FSDP2, DCP, …) are imported directly where they are used, not through this module.

It also registers what torch lacks for the planner: a sharding rule and a FLOP formula
for the CPU flash-attention ops, and the "fake" process-group backend for planning on
fake meshes (without importing `torch.testing`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch._aot_autograd.fx_utils import (
    get_all_output_and_tangent_nodes,
    get_named_buffer_nodes,
    get_param_and_grad_nodes,
    get_plain_input_and_grad_nodes,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._functorch.partitioners import default_partition
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed._functional_collectives import (
    all_gather_single,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops._embedding_ops import _MaskPartial as MaskPartial
from torch.distributed.tensor._ops.single_dim_strategy import (
    _ShardingPlaceholder as ShardingPlaceholder,
)
from torch.distributed.tensor._ops.single_dim_strategy import (
    _SingleDimStrategyInfo as SingleDimStrategyInfo,
)
from torch.distributed.tensor._ops.single_dim_strategy import register_single_dim_strategy
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    get_proxy_slot,
    make_fx,
    track_tensor_tree,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry, register_flop_formula

# torch 2.13 names that older torches (the GPU image's 2.11) lack: the same behaviour under
# their older names, so the trainer also runs on a GPU machine's own torch.
try:
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
except ImportError:  # torch < 2.13: a device clash is a plain RuntimeError
    FakeTensorDeviceMismatchError = RuntimeError  # type: ignore[misc,assignment]
try:
    from torch.distributed._functional_collectives import all_gather_single_autograd
except ImportError:  # torch < 2.13: the autograd all-gather had its older name
    from torch.distributed._functional_collectives import (  # type: ignore[no-redef]
        all_gather_tensor_autograd as all_gather_single_autograd,
    )

from parallel._torch_attention import (  # the attention half of the adapter, re-exported
    CPU_ATTENTION_BWD,
    CPU_ATTENTION_FWD,
    CPU_ATTENTION_OPS,
    CPU_ATTENTION_PACKETS,
    CUDA_ATTENTION_OPS,
    FUSED_ATTENTION_BACKWARD,
    FUSED_ATTENTION_CAUSAL_ARG,
    attention_bwd_flops,
    attention_bwd_rule,
    attention_fwd_flops,
    attention_fwd_rule,
    cpu_attention,
    fused_kernel,
    lowers_attention,
    run_lowered,
)
from parallel._torch_checkpoint import SafeFileSystemReader, UnsafeCheckpoint  # noqa: F401 (re-exported)
from parallel._torch_memory import (  # the memory half of the adapter, re-exported
    cpu_allocator_report_flag,
    dump_cuda_memory_snapshot,
    profiler_allocations,
    record_cuda_memory_history,
)

__all__ = [
    "FAKE_BACKEND", "FAKE_DEVICE", "autograd_device", "enable_fake_cuda",
    "all_gather_single", "all_gather_single_autograd", "all_to_all_single_autograd", "wait_tensor",
    "BufferAOTInput", "DTensorSpec", "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor",
    "FakeTensorDeviceMismatchError", "FakeTensorMode", "GradAOTOutput", "MaskPartial",
    "OpOverload", "OpOverloadPacket", "OpSchema", "OpSpec", "OpStrategy", "ParamAOTInput", "PlainAOTInput",
    "PlainAOTOutput", "RuntimeSchemaInfo", "ShardingPlaceholder", "SingleDimStrategyInfo", "StridedShard",
    "TangentAOTInput", "TensorMeta", "TorchDispatchMode", "TupleStrategy", "aot_export_joint_with_descriptors",
    "clear_sharding_caches", "compile_errors_fall_back", "storage_id", "expand_to_full_mesh_op_strategy", "fake_world",
    "flatten_mesh", "foreach_mul_",
    "foreach_norm", "get_all_output_and_tangent_nodes", "get_named_buffer_nodes", "get_param_and_grad_nodes",
    "get_plain_input_and_grad_nodes", "is_fake", "op_name", "returns_a_view", "written_arguments",
    "partition_joint", "partition_value",
    "autograd_enabled", "real_tensors", "register_planner_ops", "register_region_strategy", "trace_fake",
    "sequence_nr", "sharding_propagator", "active_tracer", "traced_node", "bind_traced", "untraced",
    "local_tensor", "dtensor_on", "generate_code", "no_modes", "meta_storage", "fake_view", "tree_flatten",
    "tree_map", "tree_unflatten",
    "unflatten_mesh",
    "CPU_ATTENTION_BWD", "CPU_ATTENTION_FWD", "dump_cuda_memory_snapshot", "record_cuda_memory_history",
    "cpu_allocator_report_flag", "profiler_allocations", "cpu_attention", "fused_kernel", "run_lowered",
    "CPU_ATTENTION_OPS", "CUDA_ATTENTION_OPS", "FUSED_ATTENTION_CAUSAL_ARG", "FUSED_ATTENTION_BACKWARD",
    "lowers_attention",
]

aten = torch.ops.aten


FAKE_DEVICE = "cpu"
"""Device type of fake tensors and fake meshes for planning, where no device is needed. A
GPU job's graphs are built on a fake "cuda" mesh (dry runs); see `autograd_device`."""


_FAKE_CUDA_GUARD = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
bool register_noop_cuda_guard() {
  using c10::DeviceType;
  if (c10::impl::device_guard_impl_registry[static_cast<size_t>(DeviceType::CUDA)].load() != nullptr) return false;
  static c10::impl::DeviceGuardImplRegistrar registrar(
      DeviceType::CUDA, new c10::impl::NoOpDeviceGuardImpl<DeviceType::CUDA>());
  return true;
}
"""


def enable_fake_cuda() -> None:
    """Let fake CUDA tensors run every op in a CPU-only torch build (the dry run of a GPU job).

    Such a build links no CUDA device guard, and the dispatcher asks for one around many
    ops (embedding, index ops): "PyTorch is not linked with support for cuda devices". This
    registers torch's own no-op guard for CUDA (what torch's PR 163016 does for CPU-only
    builds), compiled once with a C++ compiler (~30 s, cached by torch.utils.cpp_extension).
    Autograd on fake CUDA still needs a CUDA runtime: see `autograd_device`."""
    global _fake_cuda
    if _fake_cuda or torch.backends.cuda.is_built():
        return
    from torch.utils.cpp_extension import load_inline

    module = load_inline("autotitan_noop_cuda_guard", cpp_sources=_FAKE_CUDA_GUARD,
                         functions=["register_noop_cuda_guard"], extra_cflags=["-O1"])
    module.register_noop_cuda_guard()
    _fake_cuda = True


_fake_cuda = False


def autograd_device(device_type: str) -> str:
    """The device AOTAutograd traces a joint graph of a `device_type` job on: that device,
    except CUDA in a CPU-only torch build. There autograd on a fake CUDA tensor aborts the
    process in C++ (no CUDA device guard is linked: measured on 2.13.0+cpu), so the joint
    graph is traced on fake CPU tensors and the runtime puts every value of the graphs it
    builds on the job's device (runtime/device.py); every later stage runs on CUDA."""
    if device_type == "cuda" and not torch.backends.cuda.is_built():
        return "cpu"
    return device_type

foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_


# ---------------------------------------------------------------------------
# small accessors of private attributes
# ---------------------------------------------------------------------------


def op_name(op: Any) -> str:
    """Short name of an ATen OpOverload ("mm", "_to_copy") or packet."""
    if isinstance(op, OpOverload):
        return op._opname
    if isinstance(op, OpOverloadPacket):
        return op._qualified_op_name.split("::")[-1]
    return getattr(op, "__name__", str(op))


def written_arguments(node: Any) -> list[Any]:
    """The arguments an ATen op node writes into (its schema's `(a!)` arguments)."""
    schema = node.target._schema
    return [node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for i, arg in enumerate(schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]


def returns_a_view(op: OpOverload) -> bool:
    """Whether an ATen op's result may alias one of its inputs (a view or an in-place write)."""
    return any(r.alias_info is not None for r in op._schema.returns)


def sequence_nr() -> int:
    """Autograd's next sequence number (joint-graph nodes carry it as `seq_nr`)."""
    return torch.autograd._get_sequence_nr()


def partition_value(placement: Partial, local: torch.Tensor, mesh: Any, mesh_axis: int) -> torch.Tensor:
    """This rank's share of a replicated value under `placement` (Replicate -> Partial)."""
    return placement._partition_value(local, mesh, mesh_axis)


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Run ops on real tensors inside a trace: every dispatch mode (fake, proxy, functional)
    off, so nothing is recorded in the graph (trace-time constant folding, fold.py)."""
    with unset_fake_temporarily(), _disable_current_modes():
        yield


def trace_fake(fn: Any) -> Any:
    """`make_fx` with fake tensors that keeps real tensors it meets (the plan's lifted
    constants, held whole by every rank) as constants of the traced graph.

    The GraphModule is lazy: its Python code is generated when it is first called or read
    (a graph that is only walked, as the memory estimate's, never pays for it: ~1 s on 22 k
    nodes)."""
    traced = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)

    def trace(*args: Any) -> Any:
        with _use_lazy_graph_module(True):
            return traced(*args)

    return trace


def generate_code(gm: Any) -> None:
    """Regenerate a GraphModule's Python code now (a lazy one, as `trace_fake` and
    `partition_joint` make, would otherwise do it at its first call, which torch.compile
    refuses to trace through)."""
    gm.recompile()
    _LazyGraphModule.force_recompile(gm)


def partition_joint(gm: Any, num_fwd_outputs: int) -> tuple[Any, Any]:
    """Torch's default partition of a joint graph into forward and backward GraphModules.

    The forward returns its outputs then the values the backward reads; nodes keep their
    names. Nodes tagged for recomputation (`meta["recompute"]`, from a SAC policy) are
    recomputed in the backward instead of saved. The two GraphModules are lazy (their code
    is generated when first called or read; the runner only interprets them).
    """
    with _use_lazy_graph_module(True):
        return default_partition(gm, None, num_fwd_outputs=num_fwd_outputs)


def active_tracer() -> Any | None:
    """The tracer of the `make_fx` trace running now (its `.graph` is the graph being built),
    or None outside a trace."""
    mode = get_proxy_mode()
    return mode.tracer if mode is not None else None


def traced_node(t: torch.Tensor, tracer: Any) -> Any | None:
    """The graph node `tracer` recorded for tensor `t` (None: `t` is not traced)."""
    slot = get_proxy_slot(t, tracer, None)
    return slot.proxy.node if slot is not None else None


def bind_traced(t: torch.Tensor, node: Any, tracer: Any) -> None:
    """Make `tracer` treat tensor `t` as the value of `node` (a node added to its graph by hand)."""
    track_tensor_tree(t, torch.fx.Proxy(node, tracer), constant=None, tracer=tracer)


def untraced() -> Any:
    """A context in which tensor ops run (on fake tensors) without being recorded by make_fx."""
    return disable_proxy_modes_tracing()


def no_modes() -> Any:
    """A context with no dispatch mode active (no trace, no fake mode): tensor ops on meta
    tensors run as plain C++ calls."""
    return _disable_current_modes()


def meta_storage(nbytes: int) -> torch.Tensor:
    """A meta tensor owning a new storage of `nbytes` (fake tensors' storages are meta)."""
    return torch.empty((nbytes,), dtype=torch.uint8, device="meta")


def fake_view(mode: Any, storage_of: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A fake tensor with `like`'s dtype, shape, stride, storage offset and device on the
    storage of `storage_of` (a meta or fake tensor); made without dispatch (under `no_modes`),
    ~10 µs instead of ~0.5 ms for the same through FakeTensorMode."""
    elem = torch.empty(0, dtype=like.dtype, device="meta").set_(
        storage_of.untyped_storage(), like.storage_offset(), tuple(like.shape), tuple(like.stride()))
    return FakeTensor(mode, elem, like.device)


def dtensor_on(local: torch.Tensor, mesh: Any, placements: tuple, shape: tuple, stride: tuple) -> Any:
    """A DTensor whose local shard is `local` itself (`DTensor.from_local` wraps a view of it,
    one dispatched op per call)."""
    from torch.distributed.tensor import DTensor

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def local_tensor(x: Any) -> torch.Tensor:
    """A DTensor's local shard itself (`to_local()` under a trace records a view of it)."""
    return x._local_tensor


def storage_id(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (the StorageImpl): views share their base's; fake
    tensors' too, so a traced graph's values can be grouped by the memory they hold."""
    return t.untyped_storage()._cdata


def compile_errors_fall_back(enabled: bool) -> None:
    """Make torch.compile run a frame eagerly (with a logged warning) when compiling it fails."""
    torch._dynamo.config.suppress_errors = enabled


def is_fake(t: Any) -> bool:
    """True for FakeTensors (planning, dry runs): they carry shapes but no values."""
    return isinstance(t, FakeTensor)


def process_group(name: str) -> Any:
    """The ProcessGroup registered under `name` (functional collectives name their groups)."""
    return dist.distributed_c10d._resolve_process_group(name)


def sharding_propagator() -> Any:
    """DTensor's global sharding propagator (the rules registry)."""
    return DTensor._op_dispatcher.sharding_propagator


@contextlib.contextmanager
def planned_strategy(op: Any, spec: Any) -> Iterator[None]:
    """DTensor's sharding propagation of `op` offered the plan's strategy `spec` alone.

    Run on inputs already at the plan's placements, DTensor would pick that strategy anyway,
    but it first expands every strategy over the whole mesh and prices each (0.7 s for one
    op on a 4-D mesh); with one candidate it takes it, and still rewrites shape arguments
    to local ones and wraps the outputs as it always does. The result joins DTensor's
    propagation cache for those input placements: a valid strategy, the plan's."""
    prop = sharding_propagator()
    single = prop.op_single_dim_strategy_funcs.pop(op, None)
    funcs = prop.op_strategy_funcs
    before = funcs.get(op)
    only = OpSpec(spec.output_specs, input_specs=spec.input_specs,
                  redistribute_cost=[[0.0] for _ in spec.input_specs or ()])
    funcs[op] = lambda _schema: OpStrategy([only])
    try:
        yield
    finally:
        if before is None:
            funcs.pop(op, None)
        else:
            funcs[op] = before
        if single is not None:
            prop.op_single_dim_strategy_funcs[op] = single


def clear_sharding_caches() -> None:
    """Drop DTensor's propagation caches after (re)registering a rule."""
    prop = sharding_propagator()
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        fn = getattr(prop, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own
    if native is not None:
        native()


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A 1-D mesh over all axes of `mesh` (torch 2.13 has no public flatten)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """Split axis `dim` of `mesh` into named axes of `sizes` (no public API in 2.13)."""
    return mesh._unflatten(dim, sizes, names)


def replicate(module: Any, **kwargs: Any) -> Any:
    """torch's composable DDP (`torch.distributed._composable.replicate`): the module keeps
    its class and parameter names (checkpoints, compiled blocks); DDP is built at the first
    forward. No public equivalent in 2.13 besides wrapping in `DistributedDataParallel`."""
    from torch.distributed._composable.replicate import replicate as _replicate

    return _replicate(module, **kwargs)


def ddp_of(module: Any) -> Any:
    """The `DistributedDataParallel` a `replicate`d module runs (None before its first forward)."""
    from torch.distributed._composable.replicate import replicate as _replicate

    state = _replicate.state(module)
    ref = getattr(state, "_ddp_weakref", None) if state is not None else None
    return ref() if ref is not None else None


def ddp_buckets(params: list, bucket_bytes: int) -> list[list[int]]:
    """DDP's gradient buckets (indices into `params`, in the order given) as its reducer
    rebuilds them after the first step: torch's own assignment, a small first bucket
    (`dist._DEFAULT_FIRST_BUCKET_BYTES`), then `bucket_bytes` each."""
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, bucket_bytes]
    indices, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    return [list(b) for b in indices]


# ---------------------------------------------------------------------------
# Fake world for planning without hardware
# ---------------------------------------------------------------------------

FAKE_BACKEND = "fake"


def _register_fake_backend() -> None:
    """The "fake" c10d backend: collectives that hallucinate results (no communication)."""
    if FAKE_BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return

    def create(common_opts: Any, backend_opts: Any) -> Any:
        return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)

    dist.Backend.register_backend(FAKE_BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake default process group of `world_size` ranks (this process is rank 0).

    Re-entrant: a default group of the same size is reused and left alone on exit.
    Meshes built inside may be "cpu" or "cuda" (fake CUDA tensors: a GPU job's graphs).
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"a process group of size {dist.get_world_size()} is already initialised; "
                               f"cannot open a fake world of size {world_size}")
        yield
        return
    _register_fake_backend()
    dist.init_process_group(FAKE_BACKEND, store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# CPU flash attention: sharding rule + FLOP formula (parallel/_torch_attention.py)
# ---------------------------------------------------------------------------

_registered = False
_lock = threading.Lock()


def register_planner_ops() -> None:
    """Register our sharding rules and FLOP formulas (idempotent).

    DTensor ships no rule for the CPU flash-attention ops and FlopCounterMode counts
    them as zero, so both are registered here: batch (dim 0) or head (dim 1) sharding
    of every input and output, and torch's SDPA FLOP count. The functional `aten.copy`
    gets DTensor's rule of `copy_`.
    """
    global _registered
    with _lock:
        if _registered:
            return
        prop = sharding_propagator()
        rules = ((CPU_ATTENTION_FWD, attention_fwd_rule, 4), (CPU_ATTENTION_BWD, attention_bwd_rule, 6))
        for op, rule, static_argnum in rules:
            if op not in prop.op_single_dim_strategy_funcs and op not in prop.op_strategy_funcs:
                info = RuntimeSchemaInfo(static_argnum=static_argnum, static_kwargkey=["scale"])
                register_single_dim_strategy(op, schema_info=info)(rule)
        for packet, formula in zip(CPU_ATTENTION_PACKETS, (attention_fwd_flops, attention_bwd_flops)):
            if packet not in flop_registry:
                register_flop_formula(packet, get_raw=True)(formula)
        _alias_rule(prop, aten.copy.default, aten.copy_.default)
        clear_sharding_caches()
        _registered = True


def _alias_rule(prop: Any, op: Any, like: Any) -> None:
    """Give `op` DTensor's own single-dim rule of `like` (same semantics, no rule of its own).

    The functional `aten.copy` (what AOTAutograd makes of `x.copy_(y)` and `x[i] = y`) has
    none in torch 2.13; its in-place twin `copy_` has the pointwise one (Partial preserved).
    """
    if op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs:
        return
    if like in prop.op_single_dim_strategy_funcs:
        prop.op_single_dim_strategy_funcs[op] = prop.op_single_dim_strategy_funcs[like]
        info = prop.op_to_schema_info_for_single_dim_strategy.get(like)
        if info is not None:
            prop.op_to_schema_info_for_single_dim_strategy[op] = info


def register_region_strategy(op: Any, rule: Any, static_argnum: int) -> None:
    """DTensor single-dim strategy of a local_map region's op (parallel/auto/regions/):
    `rule(op, args_schema, kwargs_schema)` lists its declared per-axis options."""
    prop = sharding_propagator()
    prop.op_single_dim_strategy_funcs.pop(op, None)
    register_single_dim_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=static_argnum))(rule)
    clear_sharding_caches()


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Grad mode with the autograd dispatch keys un-excluded: a custom op's kernel called from
    a compiled graph (or a dispatch mode) runs below autograd, where nothing would record."""
    keys = [torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView]
    with contextlib.ExitStack() as stack:
        for k in keys:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(k, False))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        yield


_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"  # torch's private module's logger
_SEQUENTIAL_WARNING = "While redistributing from"  # its warning: N collectives, one per mesh axis


class _SequentialRedistributeNote:
    """Logger filter: drops DTensor's warning that a redistribution runs one collective per
    mesh axis (torch warns once per mesh and axes: dozens of times on a planning run, as
    every sweep point and memory estimate has its own meshes) and says it once per process."""

    def __init__(self) -> None:
        self.said = False

    def filter(self, record: Any) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_SEQUENTIAL_WARNING)):
            return True
        if not self.said:
            self.said = True
            import logging

            args = record.args if isinstance(record.args, tuple) and len(record.args) >= 4 else None
            what = f"{args[2]} sequential {args[3]}s, e.g. {args[0]} -> {args[1]}" if args else "several collectives"
            logging.getLogger("parallel.auto").info(
                "a redistribution over several mesh axes runs one collective per axis (%s); DTensor would use one "
                "collective on a flattened mesh (said once per process; torch's own warning is dropped)", what)
        return False


def quiet_sequential_redistribute_warnings() -> None:
    """Install :class:`_SequentialRedistributeNote` on torch's redistribute logger (idempotent)."""
    import logging

    lg = logging.getLogger(_REDISTRIBUTE_LOGGER)
    if not any(isinstance(f, _SequentialRedistributeNote) for f in lg.filters):
        lg.addFilter(_SequentialRedistributeNote())
