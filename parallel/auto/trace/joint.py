"""Stage 1: nn.Module + global-shaped sample inputs -> JointGraph.

The joint forward+backward ATen graph is traced once under FakeTensorMode (no real
memory, no device) with AOTAutograd's descriptor export, so every placeholder and
output already says what it is (parameter, buffer, user input, tangent, grad of X).
This module turns those descriptors into roles (`NodeRole`: data, with a human label) and
the pairs the planner needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from models import meta_copy
from parallel import _torch as T
from parallel.auto.regions import regions_in, traced_regions
from parallel.auto.trace.attention import SdpaCalls
from parallel.auto.trace.fold import ConstantReads, FoldedRead
from parallel.auto.trace.repeated_blocks import BlockRun, CopyRefused, block_run, copy_repeated_blocks, truncate

log = logging.getLogger(__name__)

_PREFIX = "model."

FWD = "fwd"
BWD = "bwd"

_LAYER_INDEX = re.compile(r"(^|\.)\d+(?=\.|$)")


def layer_prefix(path: str, *, innermost: bool = False) -> str | None:
    """The module path up to a numbered entry ('layers.3' for 'layers.3.attention.wq'):
    the instance of a repeated layer a module or parameter belongs to. The outermost
    numbered entry by default, the innermost one (e.g. an expert) if asked; None outside
    numbered modules."""
    hits = list(_LAYER_INDEX.finditer(path))
    if not hits:
        return None
    m = hits[-1] if innermost else hits[0]
    return path[: m.end()]


PARAM, BUFFER, INPUT, TANGENT, CONSTANT = "param", "buffer", "input", "tangent", "constant"
GRAD_PARAM, GRAD_INPUT, OUTPUT, OTHER = "grad_param", "grad_input", "output", "other"
_LABEL_PREFIX = {PARAM: "param ", BUFFER: "buffer ", INPUT: "input ", TANGENT: "tangent of ", CONSTANT: "constant ",
                 GRAD_PARAM: "grad of param ", GRAD_INPUT: "grad of input ", OUTPUT: "output "}


@dataclass(frozen=True)
class NodeRole:
    """What a placeholder, constant or output of the joint graph is, as data.

    kind: PARAM / BUFFER (of: FQN), INPUT (of: user-input index), TANGENT (of: the output's
    descriptor), CONSTANT (of: attribute name), GRAD_PARAM (of: FQN), GRAD_INPUT (of:
    user-input index), OUTPUT (of: forward output index), OTHER (of: a description).
    """

    kind: str
    of: Any

    def label(self) -> str:
        """The human label ("param layers.0.attention.wq.weight", "grad of input 0", ...)."""
        return f"{_LABEL_PREFIX.get(self.kind, 'output ')}{self.of}"

    def to_json(self) -> dict:
        return {"kind": self.kind, "of": self.of}

    @classmethod
    def from_json(cls, d: dict | None) -> NodeRole | None:
        return cls(d["kind"], d["of"]) if d else None

    @classmethod
    def from_label(cls, label: str) -> NodeRole | None:
        """The role a label was made from (plans saved before roles were recorded)."""
        for kind, pre in sorted(_LABEL_PREFIX.items(), key=lambda kv: -len(kv[1])):
            if label.startswith(pre):
                of = label[len(pre):]
                return cls(kind, int(of) if kind in (INPUT, GRAD_INPUT, OUTPUT) and of.isdigit() else of)
        return None


@dataclass
class OutputSlot:
    """One entry of the joint graph's output tuple.

    kind: "output" (forward output, e.g. the loss), "grad_param", "grad_input".
    of: the forward output index, parameter FQN or user-input index it belongs to.
    node: the fx node producing it (None when the gradient does not exist).
    """

    index: int
    kind: str
    of: Any
    node: fx.Node | None

    @property
    def role(self) -> NodeRole:
        return NodeRole(self.kind, self.of)


@dataclass
class JointGraph:
    """The labelled joint fwd+bwd graph (global shapes; FakeTensor in node.meta['val'])."""

    gm: fx.GraphModule
    fake_mode: Any
    params: dict[str, fx.Node]  # FQN -> placeholder
    buffers: dict[str, fx.Node]  # FQN -> placeholder
    inputs: list[fx.Node]  # user inputs, flattened input_fn() order
    tangents: list[fx.Node]  # tangent placeholders, aligned with `output_tangents`
    slots: list[OutputSlot]  # the output tuple, labelled
    param_grads: dict[str, fx.Node | None]  # FQN -> node producing its gradient
    input_grads: dict[int, fx.Node | None]  # user-input index -> grad node
    output_tangents: list[tuple[int, fx.Node]]  # (forward output index, tangent placeholder)
    roles: dict[str, NodeRole]  # node name -> what it is, for placeholders, constants and outputs
    phase: dict[str, str]  # node name -> "fwd" | "bwd"
    fingerprint: str  # model fingerprint (class + parameter names/shapes/dtypes)
    input_shapes: list[tuple[list[int], str]]
    module_of: dict[str, str] = field(default_factory=dict)  # node name -> innermost module FQN ("" = root)
    trace_seconds: float = 0.0
    param_bytes: dict[str, int] = field(default_factory=dict)
    # lifted constants: get_attr nodes of plain tensor attributes (`torch.tensor(...)` in
    # forward, tables kept as attributes); replicated inputs of the plan
    constants: dict[str, fx.Node] = field(default_factory=dict)
    folded: list[FoldedRead] = field(default_factory=list)  # distinct data-dependent reads folded at trace time
    regions: list[str] = field(default_factory=list)  # local_map regions traced as one node each
    # SDPA calls: the fused kernel of each call shape on the job's device ("flash", "efficient",
    # "flash_cpu"), and one note per call taken through the math path (trace/attention.py)
    attention_kernels: dict[str, str] = field(default_factory=dict)
    attention_notes: list[str] = field(default_factory=list)
    # the device type the joint graph's values and factory ops were traced on (T.autograd_device):
    # the runtime moves what it finds there to the job's device when the two differ
    traced_device: str = T.FAKE_DEVICE
    # the runtime's forward and backward partitions of this graph, per activation-checkpointing
    # policy and device (runtime/runner.py `phase_graphs`): they do not depend on the plan
    phase_graphs: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)
    # the candidates last enumerated on this graph, with the mesh they were made for
    # (strategies.py `mesh_candidates`): the next plan on that same mesh reuses them
    kept_candidates: Any = field(default=None, repr=False, compare=False)
    # peak-memory estimates of plans on this graph, by mesh object, placements and runtime
    # (AutoParallel.estimate_memory): a sweep's budget points that solve to one plan estimate once
    kept_estimates: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def labels(self) -> dict[str, str]:
        """node name -> human label for placeholders, constants and outputs (from `roles`)."""
        return {name: r.label() for name, r in self.roles.items()}

    def summary(self) -> str:
        ops = sum(1 for n in self.gm.graph.nodes if n.op == "call_function")
        nb = sum(1 for n in self.gm.graph.nodes if self.phase.get(n.name) == BWD)
        return (
            f"JointGraph: {len(self.gm.graph.nodes)} nodes ({ops} ops, {nb} backward), "
            f"{len(self.params)} params, {len(self.buffers)} buffers, {len(self.inputs)} inputs, "
            f"{len(self.tangents)} tangents, {len(self.constants)} lifted constants, "
            f"{len(self.folded)} folded reads, traced in {self.trace_seconds:.2f}s"
        )


class _LossModule(nn.Module):
    """Wraps model (+ optional loss function) so the traced output is a scalar loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, *inputs: Any) -> torch.Tensor:
        if self._loss_fn is None:
            return self.model(*inputs)
        return self._loss_fn(self.model, *inputs)


def model_fingerprint(model: nn.Module) -> str:
    """Stable hash of the model class and its parameter/buffer names, shapes, dtypes."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def _fake_copy(model: nn.Module, fake_mode: Any, device: str, run: BlockRun | None) -> nn.Module:
    """A copy of the model whose parameters/buffers are FakeTensors (the user's model is
    untouched), cut to the blocks `run` keeps.

    A raw meta module would trace forward only (every grad output None, silently), so
    meta parameters are materialised as fake CPU tensors with to_empty. The copy starts on
    meta whatever the model holds: a CPU job's model arrives initialised (real weights, or
    fake ones of the dry run's own mode, which another mode's to_empty cannot swap).
    """
    clone = meta_copy(model)
    if run is not None:
        truncate(clone, run)
    with fake_mode:
        clone.to_empty(device=device)
    return clone


def _to_fake(x: Any, fake_mode: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, T.FakeTensor):
        if x.device.type == "meta":
            with fake_mode:
                if x.dtype.is_floating_point:  # a stage's hidden-state input keeps requires_grad
                    return torch.empty(x.shape, dtype=x.dtype, device=device, requires_grad=x.requires_grad)
                return torch.zeros(x.shape, dtype=x.dtype, device=device)
        return fake_mode.from_tensor(x)
    return x


def trace_joint(
    model: nn.Module,
    sample_inputs: tuple[Any, ...] | Callable[[], tuple[Any, ...]],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device: str = T.FAKE_DEVICE,
    regions: tuple[str, ...] = (),
    copy_blocks: bool = True,
    compute_dtype: torch.dtype | None = None,
    stage: bool = False,
) -> JointGraph:
    """Trace model (+ loss_fn(model, *inputs)) into a labelled joint fwd+bwd graph.

    sample_inputs are GLOBAL-shaped (the whole batch), real, meta or fake tensors; they
    are converted to FakeTensors, so nothing is allocated. The traced output must be a
    scalar loss (pass loss_fn when the model returns logits). `device`: the device type
    the plan will run on (its ATen ops differ: CPU and CUDA attention kernels), the
    mesh's own; fake meshes for planning are on the CPU. `regions`: names of declared
    local_map regions whose marked modules are traced as one node each (regions/);
    functions decorated with `regions.region` always are. `copy_blocks`: a model that
    names its repeated blocks is traced with two of the last run and the rest are copied
    (trace/repeated_blocks.py); False traces every block. `compute_dtype`: the dtype the job
    computes in (mixed precision's parameter dtype), which picks a GPU job's attention kernel.
    `stage`: the model is a pipeline stage (parallel/auto/stages.py): its output is a hidden
    state or the logits, not a scalar loss, and an input that requires grad (the previous
    stage's hidden state) gets its gradient in the joint graph.
    """
    T.register_planner_ops()
    t0 = time.perf_counter()
    if callable(sample_inputs):
        sample_inputs = sample_inputs()
    if not isinstance(sample_inputs, tuple):
        sample_inputs = (sample_inputs,)
    run = block_run(model) if copy_blocks else None
    sdpa = SdpaCalls(device, compute_dtype)
    traced = _trace(model, sample_inputs, loss_fn, device, regions, run, sdpa)
    if run is not None:
        try:
            added = copy_repeated_blocks(traced.gm, traced.module_of, run, traced.fake_mode)
            traced.folded += _folded_in_copies(traced.folded, run)
            log.info("trace: %d of %d blocks traced, the other %d copied (%d nodes)",
                     run.kept, run.total, run.total - run.kept, added)
        except CopyRefused as e:
            log.info("trace: blocks not copied (%s); tracing all %d", e, run.total)
            traced = _trace(model, sample_inputs, loss_fn, device, regions, None, sdpa)
    jg = _label(traced.gm, traced.fake_mode)
    jg.module_of = traced.module_of
    jg.folded = traced.folded
    jg.regions = regions_in(traced.gm)
    jg.traced_device = traced.device
    jg.attention_kernels, jg.attention_notes = dict(sdpa.kernels), list(sdpa.notes)
    for note in jg.attention_notes:
        log.warning("trace: %s", note)
    jg.fingerprint = model_fingerprint(model)
    flat = T.tree_flatten(sample_inputs)[0]
    jg.input_shapes = [(list(x.shape), str(x.dtype)) for x in flat if isinstance(x, torch.Tensor)]
    jg.trace_seconds = time.perf_counter() - t0
    _check_loss_and_grads(jg, stage)
    log.info("trace: %s", jg.summary())
    return jg


@dataclass
class _Traced:
    gm: fx.GraphModule
    fake_mode: Any
    module_of: dict[str, str]
    folded: list[FoldedRead]
    device: str


def _trace(model: nn.Module, sample_inputs: tuple, loss_fn: Callable[..., torch.Tensor] | None, device: str,
           regions: tuple[str, ...], run: BlockRun | None, sdpa: SdpaCalls) -> _Traced:
    """AOTAutograd's joint export of a fake copy of the model (cut to `run`'s blocks)."""
    fake_mode = T.FakeTensorMode(allow_non_fake_inputs=True)
    device = T.autograd_device(device)
    fake_model = _fake_copy(model, fake_mode, device, run)
    wrapper = _LossModule(fake_model, loss_fn)
    flat, spec = T.tree_flatten(sample_inputs)
    fake_inputs = T.tree_unflatten([_to_fake(x, fake_mode, device) for x in flat], spec)
    ranges: list[tuple[int, int, str]] = []
    handles = _record_module_ranges(fake_model, ranges)
    reads = ConstantReads(fake_model)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(reads)
            stack.enter_context(sdpa)  # attention as the fused CPU op (or the math path, noted)
            stack.enter_context(traced_regions(fake_model, regions))
            joint = _export(stack, wrapper, tuple(fake_inputs))
    finally:
        for h in handles:
            h.remove()
    gm = joint.graph_module
    # AOTAutograd runs forward twice (metadata, then the graph): distinct reads only
    return _Traced(gm, joint.fake_mode, _assign_modules(gm, ranges), list(dict.fromkeys(reads.folded)), device)


def _folded_in_copies(folded: list[FoldedRead], run: BlockRun) -> list[FoldedRead]:
    """The template block's folded reads, as every copied block would have made them."""
    out = []
    for m in range(run.kept, run.total):
        for r in folded:
            if r.module == run.template or r.module.startswith(run.template + "."):
                out.append(dataclasses.replace(r, module=run.name(m) + r.module[len(run.template):]))
    return out


def _check_loss_and_grads(jg: JointGraph, stage: bool = False) -> None:
    """The planner needs a scalar loss (a pipeline stage: one tensor) and gradients that reach
    the parameters."""
    out_val = jg.slots[0].node.meta.get("val") if jg.slots and jg.slots[0].node is not None else None
    if stage and isinstance(out_val, torch.Tensor):
        pass
    elif out_val is None or not isinstance(out_val, torch.Tensor) or out_val.ndim != 0:
        raise ValueError(
            "the traced forward must return a scalar loss; pass loss_fn(model, *inputs) "
            f"around a model that returns {getattr(out_val, 'shape', out_val)}"
        )
    if jg.params and all(g is None for g in jg.param_grads.values()):
        raise ValueError("no parameter received a gradient: is the loss connected to the parameters?")


def _export(stack: contextlib.ExitStack, wrapper: _LossModule, inputs: tuple) -> Any:
    """AOTAutograd's joint export; a device clash with meta constants becomes a clear error."""
    try:
        return T.aot_export_joint_with_descriptors(stack, wrapper, inputs)
    except T.FakeTensorDeviceMismatchError as e:
        _raise_on_meta_constants(wrapper.model, e)
        raise


def _raise_on_meta_constants(model: nn.Module, cause: Exception) -> None:
    """Plain tensor attributes on the meta device (built with the model on meta) have no
    values anywhere, and meet the fake CPU tensors of the trace: say which ones, and the fix."""
    found = [f"{fqn + '.' if fqn else ''}{k} {tuple(v.shape)}" for fqn, mod in model.named_modules()
             for k, v in vars(mod).items() if isinstance(v, torch.Tensor) and v.device.type == "meta"]
    if found:
        raise ValueError(
            f"the model's plain tensor attribute(s) {', '.join(found)} are on the meta device: a constant that is "
            "not a parameter or buffer gets no values from to_empty/init_weights. Register it as a buffer "
            "(register_buffer(..., persistent=False), set in init_weights) or create it on a real device "
            "(`with torch.device('cpu'):` around it)") from cause


def _record_module_ranges(model: nn.Module, ranges: list[tuple[int, int, str]]) -> list[Any]:
    """Hooks recording the autograd sequence-number range each submodule's forward spans.

    Joint-graph nodes carry `seq_nr` (backward nodes the one of their forward op), so the
    ranges tell which module every node - forward or backward - comes from.
    """
    handles = []
    starts: dict[str, list[int]] = {}
    for fqn, mod in model.named_modules():
        if not fqn:
            continue

        def pre(_m: nn.Module, _a: Any, fqn: str = fqn) -> None:
            starts.setdefault(fqn, []).append(T.sequence_nr())

        def post(_m: nn.Module, _a: Any, _o: Any, fqn: str = fqn) -> None:
            start = starts[fqn].pop()
            ranges.append((start, T.sequence_nr(), fqn))

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


def _assign_modules(gm: fx.GraphModule, ranges: list[tuple[int, int, str]]) -> dict[str, str]:
    """node name -> FQN of the innermost module whose forward produced it (or "")."""
    out: dict[str, str] = {}
    # innermost = shortest range containing the seq_nr
    ordered = sorted(ranges, key=lambda r: r[1] - r[0])
    # ranges nest (module calls), so sort by width and take the first hit
    by_seq: dict[int, str] = {}
    direct: set[str] = set()  # nodes whose module comes from their own seq_nr
    for n in gm.graph.nodes:
        seq = n.meta.get("seq_nr")
        hit = by_seq.get(seq, None) if seq is not None else ""
        if hit is None:
            hit = ""
            for lo, hi, fqn in ordered:
                if lo <= seq < hi:
                    hit = fqn
                    break
            by_seq[seq] = hit
        if not hit:
            # gradient accumulation adds carry no (or a foreign) seq_nr: inherit from an input
            # (the most specific one: the residual stream's grad would drag "norm" along)
            cands = [(a.name in direct, out[a.name].count("."), out[a.name])
                     for a in n.all_input_nodes if out.get(a.name)]
            hit = max(cands)[2] if cands else ""
        else:
            direct.add(n.name)
        if hit:
            out[n.name] = hit
    return out


def _strip(fqn: str) -> str:
    return fqn[len(_PREFIX) :] if fqn.startswith(_PREFIX) else fqn


def _output_slots(gm: fx.GraphModule, roles: dict[str, NodeRole]) -> tuple[list[OutputSlot], dict[Any, int]]:
    """The joint graph's output tuple, slot by slot (positional: torch's helpers key outputs by
    descriptor, the plan and the runtime need positions), and forward output index by descriptor."""
    out_node = gm.graph.output_node()
    out_args = out_node.args[0]
    descs = out_node.meta.get("desc") or [None] * len(out_args)
    slots: list[OutputSlot] = []
    fwd_index: dict[Any, int] = {}
    for i, (val, desc) in enumerate(zip(out_args, descs)):
        node = val if isinstance(val, fx.Node) else None
        g = getattr(desc, "grad_of", None)
        if isinstance(g, T.ParamAOTInput):
            slot = OutputSlot(i, GRAD_PARAM, _strip(g.target), node)
        elif isinstance(g, T.PlainAOTInput):
            slot = OutputSlot(i, GRAD_INPUT, g.idx, node)
        elif isinstance(desc, T.PlainAOTOutput) or (desc is None and i == 0):
            fwd_index[desc] = len(fwd_index)
            slot = OutputSlot(i, OUTPUT, fwd_index[desc], node)
        else:
            slot = OutputSlot(i, OTHER, str(g if g is not None else desc), node)
        slots.append(slot)
        if node is not None:
            roles.setdefault(node.name, slot.role if slot.kind != OTHER else NodeRole(OTHER, str(desc)))
    return slots, fwd_index


def _phases(gm: fx.GraphModule, tangents: list[fx.Node]) -> dict[str, str]:
    """fwd / bwd per node: the partitioner's tag, else inherited from the inputs."""
    phase: dict[str, str] = {}
    for n in gm.graph.nodes:
        tag = n.meta.get("partitioner_tag")
        if n.op == "placeholder":
            phase[n.name] = BWD if n in tangents else FWD
        elif tag in ("is_backward", "is_forward"):
            phase[n.name] = BWD if tag == "is_backward" else FWD
        else:
            phase[n.name] = BWD if any(phase.get(a.name) == BWD for a in n.all_input_nodes) else FWD
    return phase


def _label(gm: fx.GraphModule, fake_mode: Any) -> JointGraph:
    """Parameters, buffers, inputs, tangents and gradients of the joint graph, from the
    descriptors AOTAutograd attached (read with torch's own fx_utils helpers)."""
    g = gm.graph
    param_pairs = {_strip(d.target): pair for d, pair in T.get_param_and_grad_nodes(g).items()}
    params = {fqn: n for fqn, (n, _) in param_pairs.items()}
    buffers = {_strip(fqn): n for fqn, n in T.get_named_buffer_nodes(g).items()}
    input_pairs = sorted(T.get_plain_input_and_grad_nodes(g).items(), key=lambda kv: kv[0].idx)
    inputs = [n for _, (n, _) in input_pairs]
    out_tangents = [(d, t) for d, (_, t) in T.get_all_output_and_tangent_nodes(g).items() if t is not None]
    roles = {n.name: NodeRole(PARAM, fqn) for fqn, n in params.items()}
    roles.update({n.name: NodeRole(BUFFER, fqn) for fqn, n in buffers.items()})
    roles.update({n.name: NodeRole(INPUT, d.idx) for d, (n, _) in input_pairs})
    roles.update({t.name: NodeRole(TANGENT, str(d)) for d, t in out_tangents})
    constants = {n.name: n for n in g.find_nodes(op="get_attr")}
    roles.update({n.name: NodeRole(CONSTANT, str(n.target)) for n in constants.values()})
    slots, fwd_index = _output_slots(gm, roles)
    tangents = [t for _, t in out_tangents]
    return JointGraph(
        gm=gm, fake_mode=fake_mode, params=params, buffers=buffers, inputs=inputs, tangents=tangents, slots=slots,
        param_grads={fqn: grad for fqn, (_, grad) in param_pairs.items()},
        input_grads={d.idx: grad for d, (_, grad) in input_pairs},
        output_tangents=[(fwd_index.get(d, 0), t) for d, t in out_tangents],
        roles=roles, phase=_phases(gm, tangents), fingerprint="", input_shapes=[],
        param_bytes={fqn: n.meta["val"].numel() * n.meta["val"].element_size() for fqn, n in params.items()},
        constants=constants,
    )
