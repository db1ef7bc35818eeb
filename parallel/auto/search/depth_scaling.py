"""A screened candidate priced on two shallow copies of the model, extrapolated to its depth.

Planning one candidate of a deep model costs time in proportion to its graph: LLaMA 3.1 405B
has 126 blocks and 30 k nodes, and tracing, the candidates, the problem's build and the
seeding walk every one of them, while the plan repeats one block's decision (the planner's
repeated-block clustering). To the cost model a candidate's step is its ends (embedding,
output, loss, the optimizer's fixed part) plus one block's time per block, and its model
states are the same sum in bytes. The screen therefore plans two copies of the model on the
candidate's mesh, ``SCREEN_DEPTHS`` blocks deep after the model's distinct first blocks
(DeepSeek-V3's dense layers), and extrapolates each figure linearly in the blocks:
``value(n) = value(a) + (n - a) * (value(b) - value(a)) / (b - a)``.

A pipelined candidate's copies are cut so that every stage holds ``a`` (then ``b``) units,
the embedding and the output head counting one unit each as the recipe's cut counts them; the
pipeline's step is extrapolated to the full cut's largest stage (a step is the microbatches
times the slowest stage plus the fill and drain, linear in a stage's time). The deeper copy
solves only its middle stages and takes its first and last from the shallower copy, longer by
what the block adds to a middle stage (PipelineStages.plan_deeper: four stage plans instead of
six). DeepSeek-V3's dense blocks are not kept apart in a pipelined copy (they fall in its
first stage, not the slowest).

Where the full model's size decides how it is planned, the copies are planned as it would be:
resharding after the forward is fixed where the full model's first solve settles it
(resharding.keeps_first). Checked against planning every block with the same request in
docs/measurements.md ("Screening on shallow copies").
"""

from __future__ import annotations

import dataclasses

from models import model_args
from parallel.auto.cost import load_hardware
from parallel.auto.resharding import chooses_resharding, keeps_first
from parallel.mesh import PP

from .pipeline_points import layout
from .spec import Point

SCREEN_DEPTHS = (2, 3)
"""Blocks (a pipelined copy: units a stage) of the two shallow copies a candidate is screened on."""
LINEAR = ("step_ms", "objective_us", "compute_us", "comm_us", "grad_reduction_us", "bubble_ms", "mem_gib")
"""The row's figures that grow with the depth: extrapolated."""


def leading_blocks(point: Point) -> int:
    """Blocks before the repeated ones that differ from them (DeepSeek-V3's dense layers)."""
    return int(getattr(_args(point), "n_dense_layers", 0) or 0)


def full_depth(point: Point) -> float | None:
    """The point's depth in the copies' unit: repeated blocks, or a pipelined point's largest
    stage in units (None: its schedule cannot run the cut)."""
    args = _args(point)
    if point.pipeline is None:
        return args.n_layers - leading_blocks(point)
    cut = _layout(point, args.n_layers)
    if cut is None:
        return None
    last = len(cut.stages) - 1
    return max(len(s) + (i == 0) + (i == last) for i, s in enumerate(cut.stages))


def scales(point: Point) -> bool:
    """Whether the point is deep enough for the copies to save work (deeper than the deeper copy)."""
    depth = full_depth(point)
    return depth is not None and depth > max(SCREEN_DEPTHS)


def shallow_copies(point: Point) -> list[Point]:
    """The point with the model cut to each of SCREEN_DEPTHS, planned as the full model is."""
    args = _args(point)
    if point.pipeline is None:
        layers = [leading_blocks(point) + d for d in SCREEN_DEPTHS]
        share = 1
    else:
        cut = _layout(point, args.n_layers)
        assert cut is not None
        share = len(cut.stages)  # every stage d units: d x stages - 2 blocks with the embedding and the output
        layers = [d * share - 2 for d in SCREEN_DEPTHS]
    request = _as_full_model(point, args.num_params() // share)
    return [dataclasses.replace(point, model_args=_with_layers(point.model_args, n), request=request,
                                depth_scaled=False, shallow=True) for n in layers]


def extrapolate(point: Point, rows: list[dict]) -> dict:
    """The LINEAR figures of the copies' rows (in SCREEN_DEPTHS order) at the point's depth."""
    a, b = SCREEN_DEPTHS
    depth = full_depth(point)
    assert depth is not None
    out = {}
    for key in LINEAR:
        va, vb = rows[0].get(key), rows[1].get(key)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            out[key] = va + (depth - a) * (vb - va) / (b - a)
    return out


def _args(point: Point):
    return model_args(point.model, point.flavor, **dict(point.model_args))


def _layout(point: Point, n_layers: int):
    choice = point.pipeline
    assert choice is not None
    return layout(choice.schedule, point.mesh.degree(PP), n_layers, choice.n_microbatches,
                  point.local_batch_size * choice.n_microbatches)


def _with_layers(args: tuple[tuple[str, int], ...], n_layers: int) -> tuple[tuple[str, int], ...]:
    return tuple((k, v) for k, v in args if k != "n_layers") + (("n_layers", n_layers),)


def _as_full_model(point: Point, n_params: int):
    """The point's request with resharding fixed where a model (or stage) of `n_params` would
    settle it with its first solve: resharding solved first (states above the keep-first share)
    and the plan recomputing blocks (any AC mode but "none") keeps the resharding plan."""
    request = point.request
    runtime = request.runtime
    if not chooses_resharding(runtime) or runtime.ac_mode == "none":
        return request
    gib = request.planner.memory_limit_gib
    limit = int(gib * 2**30) if gib is not None and gib != float("inf") else (
        0 if gib is not None else load_hardware(point.hardware).memory_limit)
    if keeps_first(n_params, limit):
        return request
    return dataclasses.replace(request, runtime=dataclasses.replace(runtime, reshard_after_forward=True))
