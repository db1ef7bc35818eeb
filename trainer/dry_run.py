"""Dry run on a fake world: does this config fit, and what does it communicate?

    python train.py --config llama3_8b --dry-run --world-size 32

No GPU and no real memory: a fake process group of ``world_size`` ranks
(``parallel._torch.fake_world``), the model built on ``meta``, the configured manual
recipe applied on the fake mesh (``parallel.recipes.apply_recipe``), then ``to_empty``
under ``FakeTensorMode`` and one forward + backward on a fake batch of
``[training] local_batch_size x seq_len`` tokens. Measured for the simulated rank (rank 0;
the manual recipes are symmetric, so every rank sees the same numbers up to uneven
shards):

* parameter / gradient / optimizer-state bytes of the local shards
  (AdamW: two states per parameter, in the master dtype);
* activation memory: bytes of the tensors created by the forward that are still alive when
  it ends (what backward will read; activation checkpointing shrinks it), and the peak of
  all tensors created during forward + backward (activations, all-gathered parameters,
  gradients, temporaries), tracked per storage by a dispatch mode;
* DDP (``dp_replicate`` alone): DDP's reducer cannot be built on fake tensors, so it is
  simulated (``parallel.recipes.ddp.simulate_ddp``): torch's bucket assignment, the
  reducer's flat bucket buffers (counted as "DDP buckets" in the peak) and one all-reduce
  per bucket once its gradients are accumulated;
* the collectives issued: count and bytes per kind and per mesh axis. Bytes are the
  per-rank buffer of the collective: all-gather -> gathered output, reduce-scatter ->
  unreduced input, all-reduce -> the tensor, all-to-all -> the input.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from models import build_model, cross_entropy_loss
from parallel import _torch as T
from parallel.measure import MemoryTracker
from parallel.mesh import CP, DP_REPLICATE, PP, TP, axis_size, build_mesh, submesh
from parallel.precision import dtype_of
from parallel.recipes import RecipeError, apply_recipe, is_ddp_mesh
from parallel.recipes.cp import cp_shard_batch
from parallel.recipes.ddp import simulate_ddp
from parallel.recipes.tp import loss_parallel_context, register_partial_grad_hooks

from .config import ConfigError, JobConfig
from .device import CPU
from .dry_run_pp import PipelineRank, pipeline_fwd_bwd, pipeline_rank
from .tokenizer import tokenizer_vocab

__all__ = ["CollectiveCounter", "DryRunReport", "dry_run", "format_report", "main"]


# ----------------------------------------------------------------------------- collectives
OP_KINDS = {  # collective op name -> the report's kind
    # functional collectives (DTensor redistributions, CP/TP)
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
    # c10d ops (FSDP2, dist.* calls)
    "allgather_": "all_gather", "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "broadcast_": "broadcast",
    "allgather_coalesced_": "all_gather", "shard_dim_alltoall": "all_to_all",
}


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in T.tree_flatten(x)[0] if isinstance(t, torch.Tensor))


class CollectiveCounter(CommDebugMode):
    """torch's CommDebugMode, extended with what it lacks for the report: it counts each
    collective per op only, so this adds the bytes and the mesh axis of every one it counts.

    ``axis_of_group`` maps a process-group name to a mesh-axis label (see
    :func:`group_axis_names`); unknown groups are labelled by their size.
    """

    def __init__(self, axis_of_group: dict[str, str]):
        super().__init__()
        self.axis_of_group = axis_of_group
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() != before:  # CommDebugMode counted a collective
            name = T.op_name(func)
            kind = OP_KINDS.get(name, name.rstrip("_"))
            key = (kind, self._axis(args))
            self.counts[key] += 1
            self.bytes[key] += _collective_bytes(func.namespace, kind, args, out)
        return out

    def _axis(self, args: Any) -> str:
        for a in T.tree_flatten(args)[0]:
            if isinstance(a, str) and a in self.axis_of_group:  # functional collectives: group name
                return self.axis_of_group[a]
            if isinstance(a, torch.ScriptObject):  # c10d ops box their ProcessGroup
                try:
                    a = dist.ProcessGroup.unbox(a)
                except RuntimeError:  # another script object (e.g. a ReduceOp)
                    continue
            if isinstance(a, dist.ProcessGroup):
                return self.axis_of_group.get(a.group_name, f"group[{a.size()}]")
        return "?"


def _collective_bytes(namespace: str, kind: str, args: Any, out: Any) -> int:
    """The per-rank buffer: all-gather -> gathered output, reduce-scatter -> unreduced
    input, all-reduce / broadcast -> the tensor, all-to-all -> the input."""
    if namespace != "c10d":  # functional: (input, ...) -> output
        return _nbytes(out) if kind == "all_gather" else _nbytes(args[0])
    if kind in ("reduce_scatter", "all_to_all"):  # c10d: (output(s), input(s), ...)
        return _nbytes(args[1])
    return _nbytes(args[0])  # all_gather: gathered output(s); all_reduce / broadcast: the tensors


def group_axis_names(model: torch.nn.Module, root_mesh: DeviceMesh) -> dict[str, str]:
    """Process-group name -> mesh-axis label, from the root mesh and every mesh of the
    model's DTensor parameters. A group that is a whole root axis gets that axis name; a
    flattened/borrowed one gets its own name (``dp_shard_cp``, ``ep``, ``dp_shard_mod_ep``)."""
    meshes = [root_mesh] + [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    out: dict[str, str] = {}
    seen = set()
    for mesh in meshes:
        if id(mesh) in seen or mesh.mesh_dim_names is None:
            continue
        seen.add(id(mesh))
        for i, name in enumerate(mesh.mesh_dim_names):
            out.setdefault(mesh.get_group(i).group_name, name)
    return out


# ----------------------------------------------------------------------------- report
@dataclass
class DryRunReport:
    world_size: int
    mesh: str
    model: str
    tokens: tuple[int, int]
    param_bytes: int = 0
    grad_bytes: int = 0
    optim_bytes: int = 0
    buffer_bytes: int = 0  # DDP's gradient buckets (the reducer's flat buffers)
    activation_bytes: int = 0  # alive at the end of forward
    peak_fwd_bwd_bytes: int = 0
    collectives: dict = field(default_factory=dict)  # (kind, axis) -> (count, bytes)
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def total_peak_bytes(self) -> int:
        """Parameters + optimizer states + the forward/backward peak (which includes the
        gradients created by the pass) + DDP's bucket buffers."""
        return self.param_bytes + self.optim_bytes + self.peak_fwd_bwd_bytes + self.buffer_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:8.2f} GiB"


def format_report(r: DryRunReport) -> str:
    lines = [
        f"dry run: {r.model} on a fake world of {r.world_size} ranks, mesh {r.mesh}, "
        f"local batch {r.tokens[0]} x {r.tokens[1]} tokens ({r.seconds:.1f} s)",
        "per rank (simulated rank 0; the manual recipes are symmetric):",
        f"  parameters          {_gib(r.param_bytes)}",
        f"  gradients           {_gib(r.grad_bytes)}",
        f"  optimizer states    {_gib(r.optim_bytes)}   (AdamW exp_avg + exp_avg_sq)",
        *([f"  DDP buckets         {_gib(r.buffer_bytes)}   (the reducer's flat gradient buffers)"]
          if r.buffer_bytes else []),
        f"  activations         {_gib(r.activation_bytes)}   (alive at the end of forward)",
        f"  peak fwd+bwd        {_gib(r.peak_fwd_bwd_bytes)}   (activations + gathered params + grads + temporaries)",
        f"  estimated peak      {_gib(r.total_peak_bytes)}   (parameters + optimizer + peak fwd+bwd"
        f"{' + DDP buckets' if r.buffer_bytes else ''})",
        "  collectives (one forward + backward):",
        f"    {'kind':<15}{'mesh axis':<18}{'count':>7}{'bytes':>16}",
    ]
    for (kind, axis), (cnt, nb) in sorted(r.collectives.items()):
        lines.append(f"    {kind:<15}{axis:<18}{cnt:>7}{nb / 2**20:>13.1f} MiB")
    if not r.collectives:
        lines.append("    (none)")
    tot_c = sum(c for c, _ in r.collectives.values())
    tot_b = sum(b for _, b in r.collectives.values())
    lines.append(f"    {'total':<33}{tot_c:>7}{tot_b / 2**20:>13.1f} MiB")
    for n in r.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def _local_nbytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _explain_data_dependence(cfg: JobConfig) -> Iterator[None]:
    try:
        yield
    except Exception as e:  # noqa: BLE001 - FakeTensor's DataDependentOutputException
        if type(e).__name__ != "DataDependentOutputException":
            raise
        raise ConfigError(
            f"{cfg.source}: the dry run hit an op whose output depends on tensor values "
            f"({e}); fake tensors have none. For MoE models the fp32 expert loop needs the "
            f"routing counts: run the dry run with --training.mixed_precision_param bfloat16 "
            f"(grouped matmuls, traceable)") from None


def _parallel_model(cfg: JobConfig, mesh: DeviceMesh, notes: list[str]) -> torch.nn.Module | PipelineRank:
    """The model on meta, in the master dtype, with the configured recipe applied (a pipeline:
    the simulated rank's stages); a degree that does not fit is a ConfigError naming the key."""
    vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else tokenizer_vocab(cfg)
    overrides = {"vocab_size": vocab} if vocab > 0 else {}
    overrides.update(cfg.model.arg_overrides())
    model = build_model(cfg.model.name, cfg.model.flavor, device="meta", **overrides)
    if vocab <= 0:
        notes.append(f"vocab_size = {model.args.vocab_size} (the flavor's; the byte tokenizer would use 256)")
    if cfg.training.dtype != "float32":
        model = model.to(dtype_of(cfg.training.dtype))
    try:
        if axis_size(mesh, PP) > 1:
            return pipeline_rank(model, mesh, cfg)
        return apply_recipe(model, mesh, cfg, ddp=False)  # DDP: simulated after materialising
    except RecipeError as e:
        raise ConfigError(f"{cfg.source}: {e}") from None


def _materialize(model: torch.nn.Module, uses_tp: bool) -> None:
    """Fake storage for the (local shards of the) parameters and buffers."""
    model.to_empty(device=T.FAKE_DEVICE)
    if uses_tp:
        register_partial_grad_hooks(model)  # to_empty dropped the autograd hooks
    with torch.no_grad():
        for b in model.buffers():  # RoPE tables: any finite values will do
            b.zero_()


def _fwd_bwd(cfg: JobConfig, model: torch.nn.Module, mesh: DeviceMesh, report: DryRunReport) -> None:
    """One forward + backward on a fake batch, measuring memory and collectives into ``report``."""
    t = cfg.training
    seq = max(t.seq_lens())  # with a seq_len_schedule: the longest length, the peak a run must fit
    tokens = torch.zeros(t.local_batch_size, seq, dtype=torch.long)
    labels = torch.zeros(t.local_batch_size, seq, dtype=torch.long)
    positions = None
    if CP in (mesh.mesh_dim_names or ()):
        tokens, labels, positions = cp_shard_batch(tokens, labels, mesh, CP)
    report.tokens = (tokens.shape[0], tokens.shape[1])
    mem, comm = MemoryTracker(), CollectiveCounter(group_axis_names(model, mesh))
    mem.exclude([list(model.parameters()), list(model.buffers()), tokens, labels])  # exist already
    with warnings.catch_warnings(), mem, comm, _explain_data_dependence(cfg), loss_parallel_context(model):
        # CommDebugMode hooks every module (its ModTracker); torch then warns about those hooks
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        logits = model(tokens) if positions is None else model(tokens, positions)
        loss = cross_entropy_loss(logits, labels)
        del logits
        report.activation_bytes = mem.current
        loss.backward()
    del loss
    report.peak_fwd_bwd_bytes = mem.peak
    report.collectives = {k: (comm.counts[k], comm.bytes[k]) for k in comm.counts}
    params = list(model.parameters())
    report.param_bytes = sum(_local_nbytes(p) for p in params)
    report.grad_bytes = sum(_local_nbytes(p.grad) for p in params if p.grad is not None)
    report.optim_bytes = 2 * report.param_bytes  # AdamW: exp_avg + exp_avg_sq


def dry_run(job_config: JobConfig, world_size: int) -> DryRunReport:
    """Build, parallelize and run one fwd+bwd of ``job_config`` on a fake world."""
    t0 = time.time()
    cfg = job_config
    if cfg.parallelism.mode != "manual":
        raise ConfigError(f"{cfg.source}: 'parallelism.mode' = {cfg.parallelism.mode!r}: --dry-run simulates "
                          f'the manual recipes; set --parallelism.mode manual (or plan with scripts/plan.py)')
    with T.fake_world(world_size):
        mesh = build_mesh(cfg.parallelism.degrees, world_size, T.FAKE_DEVICE)
        names = tuple(mesh.mesh_dim_names or ())
        report = DryRunReport(world_size=world_size, mesh=" x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)),
                              model=f"{cfg.model.name}/{cfg.model.flavor}", tokens=(0, 0))
        if cfg.job.device != CPU:
            report.notes.append(f"job.device = {cfg.job.device!r}: the manual recipes run on fake CPU tensors "
                                "(FSDP2's streams and autograd need a CUDA runtime); auto mode's dry run fakes CUDA")
        model = _parallel_model(cfg, mesh, report.notes)
        if isinstance(model, PipelineRank):
            _pipeline(cfg, model, mesh, report)
            report.seconds = time.time() - t0
            return report
        with T.FakeTensorMode(allow_non_fake_inputs=True):
            _materialize(model, uses_tp=TP in names)
            if is_ddp_mesh(mesh):
                buckets = simulate_ddp(model, submesh(mesh, DP_REPLICATE))
                report.buffer_bytes = sum(_local_nbytes(b) for b in buckets)
                report.notes.append(f"DDP simulated: {len(buckets)} gradient buckets (torch's assignment, "
                                    "backward order approximated by the reverse parameter order)")
            _fwd_bwd(cfg, model, mesh, report)
        del model
    report.seconds = time.time() - t0
    return report


def _pipeline(cfg: JobConfig, run: PipelineRank, mesh: DeviceMesh, report: DryRunReport) -> None:
    """A pipeline's simulated rank (trainer/dry_run_pp.py): its stages' microbatch through
    forward + backward, on fake tensors; the pipeline's point-to-point traffic as ``send/recv`` on ``pp``."""
    model = run.model
    with T.FakeTensorMode(allow_non_fake_inputs=True):
        _materialize(model, uses_tp=TP in (mesh.mesh_dim_names or ()))
        mem, comm = MemoryTracker(), CollectiveCounter(group_axis_names(model, mesh))
        mem.exclude([list(model.parameters()), list(model.buffers())])
        got = pipeline_fwd_bwd(cfg, run, mesh, model.args.dim, mem, comm, lambda: _explain_data_dependence(cfg))
        params = list(model.parameters())
        report.param_bytes = sum(_local_nbytes(p) for p in params)
        report.grad_bytes = sum(_local_nbytes(p.grad) for p in params if p.grad is not None)
    report.optim_bytes = 2 * report.param_bytes
    report.tokens = (cfg.training.local_batch_size, max(cfg.training.seq_lens()) // axis_size(mesh, CP))
    report.activation_bytes, report.peak_fwd_bwd_bytes = got["activation_bytes"], got["peak"]
    report.collectives = {k: (comm.counts[k], comm.bytes[k]) for k in comm.counts}
    report.collectives[("send/recv", PP)] = got["p2p"]
    report.notes += got["notes"]


def main(job_config: JobConfig, world_size: int) -> int:
    """Entry point of ``train.py --dry-run --world-size N``: print the report."""
    print(format_report(dry_run(job_config, world_size)), flush=True)
    return 0
