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
* the collectives issued: count and bytes per kind and per mesh axis. Bytes are the
  per-rank buffer of the collective: all-gather -> gathered output, reduce-scatter ->
  unreduced input, all-reduce -> the tensor, all-to-all -> the input.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from parallel._torch import TorchDispatchMode, tree_flatten

__all__ = ["MemoryTracker", "CollectiveTracker", "DryRunReport", "dry_run", "format_report", "main"]


# ----------------------------------------------------------------------------- memory
class MemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storages created by ops run under this mode, and their peak.

    Works on real, meta and fake tensors (it reads ``untyped_storage().nbytes()``; a
    DTensor counts its local shard); views share their base's storage and are counted
    once; a storage is released when its last reference dies. Storages resized in place
    (FSDP2 frees and re-allocates its unsharded parameters with ``storage.resize_``,
    which no dispatch mode sees; they come from ``empty``-like ops) are re-measured at
    every op, so the peak is exact at op granularity. Tensors that existed before entering (parameters, inputs) are not counted.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, counted bytes]
        self._watch: dict[int, list] = {}  # resizable storages (outputs of empty-like ops)
        self.current = 0
        self.peak = 0

    def _add(self, t: torch.Tensor, watch: bool) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # storage-less subclasses
            return
        key = id(st)
        if key in self._live:
            return

        def _free(_ref, key=key, self_ref=weakref.ref(self)):
            me = self_ref()
            if me is not None:
                entry = me._live.pop(key, None)
                me._watch.pop(key, None)
                if entry is not None:
                    me.current -= entry[1]

        n = st.nbytes()
        entry = [weakref.ref(st, _free), n]
        self._live[key] = entry
        if watch:
            self._watch[key] = entry
        self.current += n

    def _refresh(self) -> None:
        """Re-measure the storages that can be resized in place (FSDP2's buffers come
        from ``empty``-like ops); compute outputs keep their size for life."""
        for entry in self._watch.values():
            st = entry[0]()
            if st is not None:
                n = st.nbytes()
                if n != entry[1]:
                    self.current += n - entry[1]
                    entry[1] = n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops + collectives first
        out = func(*args, **(kwargs or {}))
        watch = "empty" in func._opname
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, watch)
        self._refresh()
        if self.current > self.peak:
            self.peak = self.current
        return out


# ----------------------------------------------------------------------------- collectives
_KINDS = {
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
}


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


class CollectiveTracker(TorchDispatchMode):
    """Count and size the collectives issued under this mode, per kind and per mesh axis.

    ``axis_of_group`` maps a process-group name to a mesh-axis label (see
    :func:`group_axis_names`); unknown groups are labelled by their size.
    """

    def __init__(self, axis_of_group: dict[str, str]):
        super().__init__()
        self.axis_of_group = axis_of_group
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def _axis(self, args) -> str:
        for a in tree_flatten(args)[0]:
            name = None
            if isinstance(a, str) and a in self.axis_of_group:
                return self.axis_of_group[a]
            if isinstance(a, torch.ScriptObject):  # c10d ops box their ProcessGroup
                try:
                    a = dist.ProcessGroup.unbox(a)
                except Exception:  # noqa: BLE001 - another script object (e.g. a ReduceOp)
                    continue
            if a is not None and not isinstance(a, (torch.Tensor, str, int, float, bool)):
                name = getattr(a, "group_name", None)
                if name in self.axis_of_group:
                    return self.axis_of_group[name]
                if name is not None:
                    try:
                        return f"group[{len(dist.get_process_group_ranks(a))}]"
                    except Exception:  # noqa: BLE001
                        return "group[?]"
        return "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops + collectives first
        out = func(*args, **(kwargs or {}))
        ns = func.namespace
        if ns in ("_c10d_functional", "c10d_functional", "c10d", "_c10d_functional_autograd"):
            kind = _KINDS.get(func._opname)
            if kind is not None:
                axis = self._axis(args)
                if ns != "c10d":  # functional: (input, ...) -> output
                    nb = _nbytes(out) if kind == "all_gather" else _nbytes(args[0])
                elif kind in ("reduce_scatter", "all_to_all"):  # c10d: (output(s), input(s), ...)
                    nb = _nbytes(args[1])
                else:  # all_gather: gathered output(s); all_reduce / broadcast: the tensors
                    nb = _nbytes(args[0])
                self.counts[(kind, axis)] += 1
                self.bytes[(kind, axis)] += nb
        return out


def group_axis_names(model: torch.nn.Module, root_mesh) -> dict[str, str]:
    """Process-group name -> mesh-axis label, from every mesh reachable from ``model``
    (DTensor parameters' meshes, the CP attention's mesh) and the root mesh. A group
    that is a whole root axis gets that axis name; a flattened/borrowed one gets its own
    name (``dp_shard_cp``, ``ep``, ``dp_shard_mod_ep``)."""
    from torch.distributed.tensor import DTensor

    meshes = [root_mesh]
    for p in model.parameters():
        if isinstance(p, DTensor):
            meshes.append(p.device_mesh)
    for m in model.modules():
        for attr in ("cp_mesh",):
            if hasattr(m, attr):
                meshes.append(getattr(m, attr))
    out: dict[str, str] = {}
    seen = set()
    for mesh in meshes:
        if id(mesh) in seen or mesh.mesh_dim_names is None:
            continue
        seen.add(id(mesh))
        for i, name in enumerate(mesh.mesh_dim_names):
            g = mesh.get_group(i)
            out.setdefault(g.group_name, name)
    for m in model.modules():
        g = getattr(m, "_ep_group", None)
        if g is not None:
            out.setdefault(g.group_name, "ep")
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
    activation_bytes: int = 0  # alive at the end of forward
    peak_fwd_bwd_bytes: int = 0
    collectives: dict = field(default_factory=dict)  # (kind, axis) -> (count, bytes)
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def total_peak_bytes(self) -> int:
        """Parameters + optimizer states + the forward/backward peak (which includes the
        gradients created by the pass)."""
        return self.param_bytes + self.optim_bytes + self.peak_fwd_bwd_bytes


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
        f"  activations         {_gib(r.activation_bytes)}   (alive at the end of forward)",
        f"  peak fwd+bwd        {_gib(r.peak_fwd_bwd_bytes)}   (activations + gathered params + grads + temporaries)",
        f"  estimated peak      {_gib(r.total_peak_bytes)}   (parameters + optimizer + peak fwd+bwd)",
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
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _explain_data_dependence(cfg):
    try:
        yield
    except Exception as e:  # noqa: BLE001 - FakeTensor's DataDependentOutputException
        if type(e).__name__ != "DataDependentOutputException":
            raise
        raise ValueError(
            f"{cfg.source}: the dry run hit an op whose output depends on tensor values "
            f"({e}); fake tensors have none. For MoE models the fp32 expert loop needs the "
            f"routing counts: run the dry run with --training.mixed_precision_param bfloat16 "
            f"(grouped matmuls, traceable)") from None


def dry_run(job_config, world_size: int) -> DryRunReport:
    """Build, parallelize and run one fwd+bwd of ``job_config`` on a fake world."""
    from models import build_model, cross_entropy_loss
    from parallel._torch import FakeTensorMode, fake_world
    from parallel.mesh import build_mesh
    from parallel.recipes import apply_recipe
    from parallel.recipes.tp import loss_parallel_context, register_partial_grad_hooks

    t0 = time.time()
    cfg, t = job_config, job_config.training
    if cfg.parallelism.mode != "manual":
        raise ValueError("--dry-run simulates the manual recipes ([parallelism] mode = \"manual\")")
    notes = []
    overrides = {}
    if cfg.model.vocab_size > 0:
        overrides["vocab_size"] = cfg.model.vocab_size
    with fake_world(world_size):
        mesh = build_mesh(cfg.parallelism, world_size, "cpu")
        model = build_model(cfg.model.name, cfg.model.flavor, device="meta", **overrides)
        if getattr(model.args, "max_seq_len", t.seq_len) < t.seq_len:
            model = build_model(cfg.model.name, cfg.model.flavor, device="meta",
                                max_seq_len=t.seq_len, **overrides)
        if cfg.model.vocab_size <= 0:
            notes.append(f"vocab_size = {model.args.vocab_size} (the flavor's; the byte "
                         f"tokenizer would use 256)")
        if t.dtype != "float32":
            model = model.to(getattr(torch, t.dtype))
        model = apply_recipe(model, mesh, cfg)
        names = tuple(mesh.mesh_dim_names or ())
        uses_tp = "tp" in names
        axis_names = group_axis_names(model, mesh)
        mesh_desc = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
        cp = mesh["cp"].size() if "cp" in names else 1
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            model.to_empty(device="cpu")
            if uses_tp:
                register_partial_grad_hooks(model)  # to_empty dropped the autograd hooks
            with torch.no_grad():
                for b in model.buffers():  # RoPE tables: any finite values will do
                    b.zero_()
            tokens = torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.long)
            labels = torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.long)
            positions = None
            if cp > 1:
                from parallel.recipes.cp import cp_shard_batch

                tokens, labels, positions = cp_shard_batch(tokens, labels, mesh, "cp")
            mem, comm = MemoryTracker(), CollectiveTracker(axis_names)
            with mem, comm, _explain_data_dependence(cfg):
                with loss_parallel_context(model):
                    logits = model(tokens) if positions is None else model(tokens, positions)
                    loss = cross_entropy_loss(logits, labels)
                    del logits
                    act = mem.current
                    loss.backward()
            params = list(model.parameters())
            pb = sum(_local_nbytes(p) for p in params)
            gb = sum(_local_nbytes(p.grad) for p in params if p.grad is not None)
            report = DryRunReport(
                world_size=world_size, mesh=mesh_desc, model=f"{cfg.model.name}/{cfg.model.flavor}",
                tokens=(tokens.shape[0], tokens.shape[1]), param_bytes=pb, grad_bytes=gb,
                optim_bytes=2 * pb, activation_bytes=act, peak_fwd_bwd_bytes=mem.peak,
                collectives={k: (comm.counts[k], comm.bytes[k]) for k in comm.counts},
                notes=notes)
            del loss, params
        del fake_mode
    report.seconds = time.time() - t0
    return report


def main(job_config, world_size: int) -> int:
    """Entry point of ``train.py --dry-run --world-size N``: print the report."""
    print(format_report(dry_run(job_config, world_size)), flush=True)
    return 0
