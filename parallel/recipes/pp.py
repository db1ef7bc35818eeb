"""Pipeline parallel (PP): the model's layers cut into stages over the ``pp`` mesh axis (the
outermost), run under a ``torch.distributed.pipelining`` schedule.

Split (:func:`pipeline_layout`): the embedding and the output head count as one layer each, so
a model of L blocks has L + 2 units; ``S`` stages take consecutive units, balanced (stage sizes
differ by at most one; the spare units go to the middle stages). ``S`` is one per pp rank for
the single-stage schedules (GPipe, 1F1B), two per rank for the multi-stage ones unless
``pipeline_parallel_layers_per_stage`` (``S = ceil((L + 2) / it)``) or
``pipeline_parallel_split_points`` (``len + 1`` stages) says otherwise. Stages go to ranks
"loop" style (stage ``s`` on rank ``s % pp``), or "v" style for ZBVZeroBubble / DualPipeV (rank
``r`` holds stages ``r`` and ``2 pp - 1 - r``).

Stage modules (:func:`split_model`), as TorchTitan: each is a new instance of the model's
class sharing the blocks it holds with the unsplit model; ``layers`` is a ``ModuleDict`` keyed
by the block's index in the model (so parameter names stay ``layers.<i>....``), and
``tok_embeddings`` / ``norm`` / ``output`` are ``None`` where the stage does not hold them
(``DecoderBase.forward`` then takes / returns the hidden state). The rank's *model* (what the
optimizer, clipping and checkpoints see) is built the same way over the union of its stages:
its state dict has the unsplit model's names, so DCP reshards between PP and no PP.

Each stage module is parallelized on its own by the caller's recipe (TP, AC, compile, then
FSDP: ``fully_shard`` of its blocks and of the stage module, which ``PipelineStage`` drives
through its last backward). Loss (:class:`Pipeline`): each microbatch's loss is the mean
cross-entropy of its tokens; its backward starts from it divided by the number of microbatches
(and by the trainer's accumulation steps), so the summed gradient is that of the mean over the
global batch, as without PP (equal rows per microbatch). Not torch's ``scale_grads``: that
divides the whole ``.grad`` after a step, gradients accumulated by earlier steps too. The
step's loss is the mean of the microbatch losses, broadcast from the rank of the last stage to
the other pp ranks. CP: every stage's forward gets the cp rank's token positions (a forward
pre-hook; the same for every microbatch). torch's stages infer their shapes with one real forward
at their first step; buffers it changes (MoE token counts) are restored (``_torch_pipeline``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from models import transformer_blocks
from parallel._torch_pipeline import stage_infers_metadata
from parallel.mesh import PP
from parallel.settings import PipelineSettings

from .errors import RecipeError

__all__ = ["Pipeline", "PipelineLayout", "SCHEDULE_STYLES", "apply_pp", "check_composition", "fill_and_drain_us",
           "in_flight", "join_stages", "pipeline_layout", "schedule_name", "split_model"]

SINGLE, LOOP, V = "single", "loop", "v"
SCHEDULE_STYLES: dict[str, str] = {
    "GPipe": SINGLE, "1F1B": SINGLE, "Interleaved1F1B": LOOP, "LoopedBFS": LOOP,
    "InterleavedZeroBubble": LOOP, "ZBVZeroBubble": V, "DualPipeV": V,
}
"""The schedules torch 2.13 ships (``get_schedule_class`` names), and how stages go to ranks:
one per rank, several per rank looped, or two per rank V-shaped."""

_KEY_SCHEDULE = "pipeline_parallel_schedule"
_KEY_MB = "pipeline_parallel_microbatch_size"
_KEY_PER = "pipeline_parallel_layers_per_stage"
_KEY_POINTS = "pipeline_parallel_split_points"


def schedule_name(name: str) -> str:
    """The schedule's name as torch spells it (case-insensitive match); RecipeError otherwise."""
    for known in SCHEDULE_STYLES:
        if known.lower() == str(name).lower():
            return known
    raise RecipeError(_KEY_SCHEDULE, name, f"not a pipeline schedule of torch.distributed.pipelining; use one of "
                      f"{', '.join(SCHEDULE_STYLES)}")


ALL_IN_FLIGHT = ("GPipe", "LoopedBFS")
"""Schedules that run every microbatch's forward before the first backward."""


def in_flight(schedule: str, n_microbatches: int, n_stages: int, stage: int) -> int:
    """Microbatches whose saved activations ``stage`` holds at once under ``schedule``: all of
    them (GPipe, LoopedBFS), else the stages from it to the last (1F1B's warm-up)."""
    return n_microbatches if schedule in ALL_IN_FLIGHT else min(n_microbatches, n_stages - stage)


def fill_and_drain_us(stage_us: Sequence[float], pp: int) -> float:
    """The time a schedule's slowest rank waits while the pipeline fills and drains: with one
    stage per rank, the other stages' times (GPipe's exactly; 1F1B overlaps some of it); with
    several, ``pp - 1`` times the slowest stage."""
    if len(stage_us) == pp:
        return sum(stage_us) - max(stage_us)
    return (pp - 1) * max(stage_us)


@dataclass(frozen=True)
class PipelineLayout:
    """The stages (the block indices of each; stage 0 also embeds, the last one also norms and
    projects to logits), how they go to the pp ranks, and the microbatches of a step."""

    schedule: str
    pp: int
    stages: tuple[tuple[int, ...], ...]
    n_microbatches: int

    @property
    def style(self) -> str:
        return SCHEDULE_STYLES[self.schedule]

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def stages_of(self, rank: int) -> list[int]:
        """The stage indices pp rank ``rank`` runs, in order."""
        if self.style == V:
            return [rank, 2 * self.pp - 1 - rank]
        return list(range(rank, self.n_stages, self.pp))

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations ``stage`` holds at once under the schedule."""
        return in_flight(self.schedule, self.n_microbatches, self.n_stages, stage)

    def rank_of(self, stage: int) -> int:
        """The pp rank that runs ``stage``."""
        return next(r for r in range(self.pp) if stage in self.stages_of(r))


def pipeline_layout(n_layers: int, pp: int, settings: PipelineSettings, local_batch: int) -> PipelineLayout:
    """The layout of a PP job, or RecipeError naming the key that cannot work, its value and the fix."""
    name = schedule_name(settings.pipeline_parallel_schedule)
    stages = _split(n_layers, pp, name, settings)
    mb = settings.pipeline_parallel_microbatch_size
    if local_batch % mb:
        fits = [d for d in range(1, local_batch + 1) if local_batch % d == 0]
        raise RecipeError(_KEY_MB, mb, f"does not divide training.local_batch_size = {local_batch}: every microbatch "
                          f"has the same rows; use one of {fits}")
    n_mb = local_batch // mb
    why = _microbatch_problem(name, n_mb, len(stages), pp)
    if why:
        fits = [d for d in range(1, local_batch + 1)
                if local_batch % d == 0 and not _microbatch_problem(name, local_batch // d, len(stages), pp)]
        fix = f"use pipeline_parallel_microbatch_size {' or '.join(map(str, fits))}" if fits else \
            "raise training.local_batch_size"
        raise RecipeError(_KEY_MB, mb, f"training.local_batch_size = {local_batch} makes {n_mb} microbatch"
                          f"{'es' if n_mb != 1 else ''} a step: {why}; {fix} (or another schedule)")
    return PipelineLayout(name, pp, stages, n_mb)


def _microbatch_problem(schedule: str, n_mb: int, n_stages: int, pp: int) -> Optional[str]:
    """Why ``schedule`` cannot run ``n_mb`` microbatches on ``n_stages`` stages (None: it can);
    the rules torch 2.13's schedules check when they are built."""
    if schedule in ("1F1B", "DualPipeV") and n_mb < n_stages:
        return f"{schedule} needs at least as many microbatches as stages ({n_stages})"
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_mb // pp)
        if n_mb % rounds:
            return (f"{schedule} runs the microbatches in rounds of pipeline_parallel_degree = {pp}: their number "
                    f"must be below {pp} or a multiple of {n_mb // rounds} ({rounds} rounds)")
    return None


def _n_stages(n_layers: int, pp: int, schedule: str, settings: PipelineSettings) -> tuple[int, str, Any]:
    """(stages, the key that set them, its value)."""
    points, per = settings.pipeline_parallel_split_points, settings.pipeline_parallel_layers_per_stage
    if points:
        return len(points) + 1, _KEY_POINTS, list(points)
    if per is not None:
        return math.ceil((n_layers + 2) / per), _KEY_PER, per
    return pp * (1 if SCHEDULE_STYLES[schedule] == SINGLE else 2), "pipeline_parallel_degree", pp


def _split(n_layers: int, pp: int, schedule: str, settings: PipelineSettings) -> tuple[tuple[int, ...], ...]:
    """The block indices of each stage (RecipeError when the stages do not fit the schedule, the
    degree or the model)."""
    n, key, value = _n_stages(n_layers, pp, schedule, settings)
    style = SCHEDULE_STYLES[schedule]
    count = f"{n} stage{'s' if n != 1 else ''}" + (
        f" (ceil(({n_layers} layers + 2 for the embedding and the output) / {value}))" if key == _KEY_PER else "")
    want = {SINGLE: pp, V: 2 * pp}.get(style)
    if want is not None and n != want:
        per = math.ceil((n_layers + 2) / want)
        hint = f"pipeline_parallel_layers_per_stage = {per}" if key == _KEY_PER else f"{want - 1} split points"
        raise RecipeError(key, value, f"makes {count}, but {schedule} runs {want // pp} stage"
                          f"{'s' if want > pp else ''} per rank on pipeline_parallel_degree = {pp}: it needs {want} "
                          f"stages; use {hint}, or a schedule with another number of stages per rank")
    if style == LOOP and (n % pp or n < 2 * pp):
        raise RecipeError(key, value, f"makes {count}, but {schedule} runs the same number of stages, at least 2, "
                          f"on each of the pipeline_parallel_degree = {pp} ranks: use a multiple of {pp} stages, "
                          f">= {2 * pp}")
    if n > n_layers + 2:
        raise RecipeError(key, value, f"makes {count}, more than the {n_layers} layers + the embedding and the "
                          f"output can fill; use at most {n_layers + 2} stages")
    if key == _KEY_POINTS:
        return _from_points(settings.pipeline_parallel_split_points, n_layers)
    base, extra = divmod(n_layers + 2, n)
    sizes = [base] * n
    for i in sorted(range(n), key=lambda i: (abs(2 * i - (n - 1)), i))[:extra]:  # spare units: middle stages
        sizes[i] += 1
    out, start = [], -1  # unit -1 is the embedding, n_layers the output head
    for size in sizes:
        out.append(tuple(u for u in range(start, start + size) if 0 <= u < n_layers))
        start += size
    return tuple(out)


def _from_points(points: Sequence[str], n_layers: int) -> tuple[tuple[int, ...], ...]:
    """Stages cut before each named block; RecipeError for blocks out of order or out of range."""
    cuts = [int(p.split(".")[1]) for p in points]
    if any(not 0 < c < n_layers for c in cuts) or cuts != sorted(set(cuts)):
        raise RecipeError(_KEY_POINTS, list(points), f"must name blocks layers.1 .. layers.{n_layers - 1} in "
                          "increasing order, each once (a stage starts at each)")
    bounds = [0, *cuts, n_layers]
    return tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]))


def check_composition(pp: int, replicate: int, ddp: bool) -> None:
    """RecipeError for what a pipeline does not compose with: DDP (``ddp``:
    data_parallel_replicate_degree alone; FSDP/HSDP do)."""
    if pp > 1 and ddp:
        raise RecipeError("data_parallel_replicate_degree", replicate,
                          f"without data_parallel_shard_degree is DDP, which pipeline_parallel_degree = {pp} does not "
                          "compose with; use data_parallel_shard_degree (FSDP) instead, or both (HSDP)")


# --------------------------------------------------------------------------- the split


def split_model(model: nn.Module, layers: Sequence[int], first: bool, last: bool) -> nn.Module:
    """A new module of ``model``'s class sharing its submodules: the blocks ``layers`` (a
    ModuleDict keyed by their index), the embedding if ``first``, norm and output if ``last``
    (else None). Parameter names are the unsplit model's."""
    blocks = dict(model.layers.items()) if isinstance(model.layers, nn.ModuleDict) else \
        {str(i): b for i, b in enumerate(model.layers)}
    part = type(model).__new__(type(model))
    nn.Module.__init__(part)
    for key, value in vars(model).items():
        if not key.startswith("_") and key != "training":
            object.__setattr__(part, key, value)
    for name, value in model.named_parameters(recurse=False):
        part.register_parameter(name, value)
    persistent = {k for k in model.state_dict(keep_vars=True) if "." not in k}
    for name, value in model.named_buffers(recurse=False):
        part.register_buffer(name, value, persistent=name in persistent)
    for name in ("tok_embeddings", "norm", "output"):  # None in a stage that does not hold them
        setattr(part, name, None)
    for name, module in model.named_children():
        setattr(part, name, module)
    part.layers = nn.ModuleDict({str(i): blocks[str(i)] for i in layers})
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    part.train(model.training)
    return part


def join_stages(model: nn.Module, parts: Sequence[nn.Module], stage_ids: Sequence[int],
                layout: PipelineLayout) -> nn.Module:
    """The rank's model over stage modules that are not ``model``'s own submodules (the
    planner's stage modules are copies with DTensor parameters): a module of ``model``'s class
    holding the parts' blocks, embedding, norm and output, under the unsplit model's names."""
    last = layout.n_stages - 1
    union = split_model(model, sorted(i for s in stage_ids for i in layout.stages[s]), 0 in stage_ids,
                        last in stage_ids)
    for part in parts:
        for name, child in part.named_children():
            if name == "layers":
                for key, block in child.items():
                    union.layers[key] = block
            elif child is not None and getattr(union, name, None) is not None:
                setattr(union, name, child)
    return union


class Pipeline:
    """This rank's stages under the job's schedule. ``model``: the union of its stage modules
    (the unsplit model's names); ``step`` runs one forward/backward of the whole local batch."""

    def __init__(self, model: nn.Module, parts: list[nn.Module], stage_ids: list[int], layout: PipelineLayout,
                 pp_mesh: DeviceMesh, device: torch.device, loss_fn: Callable) -> None:
        self.model, self.parts, self.stage_ids, self.layout = model, parts, stage_ids, layout
        self.group = pp_mesh.get_group()
        self.loss_fn, self.scale, self.device = loss_fn, 1.0, device
        self.positions: Optional[torch.Tensor] = None  # CP: this rank's token positions, every stage's forward
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers kept from a metadata inference
        for i, part in enumerate(parts):
            part.register_forward_pre_hook(self._with_positions, with_kwargs=True)
            part.register_forward_pre_hook(functools.partial(self._before_forward, i))
            part.register_forward_hook(self._after_forward)
        self.has_first, self.has_last = 0 in stage_ids, layout.n_stages - 1 in stage_ids
        self.last_rank = layout.rank_of(layout.n_stages - 1)
        self.rebuild()

    def describe(self) -> str:
        """One line for the job's log: the schedule, the stages' blocks, the microbatches."""
        lay = self.layout
        blocks = "; ".join(f"{i}: " + ", ".join(
            ([] if i else ["embedding"]) + ([f"layers.{s[0]}-{s[-1]}"] if s else [])
            + (["norm", "output"] if i == lay.n_stages - 1 else [])) for i, s in enumerate(lay.stages))
        return (f"pipeline: {lay.schedule}, {lay.n_stages} stages over pipeline_parallel_degree = {lay.pp} ({blocks}), "
                f"{lay.n_microbatches} microbatches a local batch")

    def rebuild(self) -> None:
        """New stages and schedule over the same stage modules: they infer their input and output
        shapes again at their first step (after a change of the sequence length)."""
        layout = self.layout
        self.stages = [PipelineStage(part, i, layout.n_stages, self.device, group=self.group)
                       for part, i in zip(self.parts, self.stage_ids)]
        cls = get_schedule_class(layout.schedule)
        first = self.stages[0] if layout.style == SINGLE else self.stages
        # the loss function's outputs by id -> (output, unscaled loss); the schedule's own calls
        # (shape inference at its first run) are not a step's microbatches: its `losses` list says which are
        self._raw: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        try:  # scale_grads=False: torch's would divide the whole .grad, gradients accumulated before it too
            self.schedule = cls(first, n_microbatches=layout.n_microbatches, loss_fn=self._loss, scale_grads=False)
        except ValueError as e:  # a rule of torch's the layout's checks missed
            raise RecipeError(_KEY_MB, layout.n_microbatches, f"{layout.schedule}: {e}") from None

    def _before_forward(self, i: int, module: nn.Module, args: tuple) -> None:
        """A stage's shape inference (its first forward, on real or empty tensors) must leave no
        trace: its buffers (MoE token counts) are copied, restored after it."""
        if stage_infers_metadata(self.stages[i]):
            self._saved = [(b, b.detach().clone()) for b in module.buffers()]

    @torch.no_grad()
    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        for buffer, saved in self._saved:
            if not torch.equal(buffer, saved):  # only what it changed: the rest may be saved for its backward
                buffer.copy_(saved)
        self._saved = []

    def _with_positions(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A stage's forward gets the step's positions (the same for every microbatch)."""
        return args, kwargs if self.positions is None else {**kwargs, "positions": self.positions}

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A microbatch's loss, recorded; what its backward starts from: x scale / microbatches."""
        loss = self.loss_fn(output, target)
        out = loss * (self.scale / self.layout.n_microbatches)
        self._raw[id(out)] = (out, loss.detach().float())
        return out

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float = 1.0,
             positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward and backward of ``inputs`` in microbatches, gradients of ``scale`` x the mean
        loss added to the parameters'; the (unscaled) mean loss on every pp rank. ``positions``:
        the tokens' positions in the sequence (CP's shard)."""
        return self._run(self.schedule.step, inputs, labels, scale, positions)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor,
                  positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward only (validation): the mean loss on every pp rank."""
        return self._run(self.schedule.eval, inputs, labels, 1.0, positions)

    def _run(self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor, scale: float,
             positions: Optional[torch.Tensor]) -> torch.Tensor:
        self.scale, self._raw, self.positions = scale, {}, positions
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        run(*args, target=labels if self.has_last else None, losses=losses if self.has_last else None,
            return_outputs=False)
        raw, self._raw = self._raw, {}
        if self.has_last:
            loss = torch.stack([raw[id(x)][1] for x in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=inputs.device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss


def apply_pp(model: nn.Module, mesh: DeviceMesh, settings: PipelineSettings, local_batch: int,
             device: torch.device, loss_fn: Callable, parallelize: Callable[[nn.Module], Any]) -> Pipeline:
    """Split ``model`` (materialised or on meta) into this pp rank's stages, ``parallelize`` each
    stage module in place (the other recipes: TP, AC, compile, FSDP), build the schedule."""
    pp_mesh = mesh[PP]
    layout, ids, parts, rank_model = rank_stages(model, pp_mesh, settings, local_batch)
    for part in parts:
        parallelize(part)
    return Pipeline(rank_model, parts, ids, layout, pp_mesh, device, loss_fn)


def rank_stages(model: nn.Module, pp_mesh: DeviceMesh, settings: PipelineSettings, local_batch: int
                ) -> tuple[PipelineLayout, list[int], list[nn.Module], nn.Module]:
    """This pp rank's share of ``model``: the layout, its stage indices, one module per stage,
    and the rank's model (the union of its stages, for the optimizer and checkpoints)."""
    layout = pipeline_layout(len(transformer_blocks(model)), pp_mesh.size(), settings, local_batch)
    ids = layout.stages_of(pp_mesh.get_local_rank())
    last = layout.n_stages - 1
    parts = [split_model(model, layout.stages[i], i == 0, i == last) for i in ids]
    union = sorted(i for s in ids for i in layout.stages[s])
    return layout, ids, parts, split_model(model, union, 0 in ids, last in ids)
