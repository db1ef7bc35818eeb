"""A pipeline's stage plans made on one process, and the cut by their predicted times.

    stages = PipelineStages(model, mesh, request, hidden_dtype)
    pipeline_plan = stages.plan(layout)          # every kind of stage solved once, then cut

What the trainer's auto pipeline (trainer/auto_pipeline.py), its dry run and the mesh search's
pipeline points (search/pipeline_points.py) share: the stage submesh, one microbatch's request,
the stage shapes under the schedule, every kind of stage (as many blocks; the first, the last
or neither) solved once, each unit's predicted time (stages.unit_times) and the cut whose
slowest stage is fastest (`faster_cut`). ``constrain`` shapes every stage's planner (a preset,
e.g. the FSDP·TP recipe shape the mesh search prices beside its own picks). ``solve_kinds``
solves several kinds at once elsewhere (the dry run's worker processes, trainer/stage_processes.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models import transformer_blocks
from parallel.auto.api import AutoParallel
from parallel.auto.plan import Plan
from parallel.auto.plan.pipeline import PipelinePlan, StagePlan
from parallel.auto.request import PlanRequest, data_degree
from parallel.auto.stages import (
    EMBEDDING,
    StageShape,
    balanced_stages,
    p2p_us,
    pipeline_step_us,
    stage_planning,
    stage_submesh,
    stage_times_us,
    unit_times,
)
from parallel.recipes.pp import PipelineLayout, split_model

logger = logging.getLogger("autotitan")

RECUT_GAIN = 0.03
"""The share of the slowest stage's predicted time a new cut must save to be planned."""


def stage_units(layout: PipelineLayout, stage: int, n_layers: int) -> list[int]:
    """A stage's units in order: the embedding (first stage), its blocks, the head (last stage)."""
    return ([EMBEDDING] if stage == 0 else []) + list(layout.stages[stage]) + (
        [n_layers] if stage == layout.n_stages - 1 else [])


def faster_cut(layout: PipelineLayout, times: dict[int, float], n_layers: int) -> tuple[tuple[int, ...], ...] | None:
    """The cut by the units' predicted times (stages.balanced_stages), or None when its
    predicted step is not faster than `layout`'s by RECUT_GAIN."""
    unit_us = [times[u] for u in range(EMBEDDING, n_layers + 1)]
    cut = balanced_stages(unit_us, layout.n_stages)
    ranks = [layout.rank_of(i) for i in range(layout.n_stages)]
    before, after = (pipeline_step_us(stage_times_us(unit_us, c), ranks, layout.pp, layout.n_microbatches)
                     for c in (layout.stages, cut))
    if after > (1 - RECUT_GAIN) * before:
        return None
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("pipeline cut by the stages' predicted times: %s (step %.2f ms) instead of %s (%.2f ms)",
                    [list(s) for s in cut], after / 1e3, [list(s) for s in layout.stages], before / 1e3)
    return cut


@dataclasses.dataclass
class KindsSolved:
    """Stage plans made elsewhere: stage -> its plan, and the cost model's hardware (the p2p price)."""

    plans: dict[int, Plan]
    hardware: Any


SolveKinds = Callable[[PipelineLayout, list[int]], KindsSolved]
"""Solves these stages of a layout (one of each kind not solved yet), e.g. in other processes."""


class PipelineStages:
    """What planning a model's pipeline stages needs: the model, the mesh (with its ``pp``
    axis) and the stage submesh, the request of one microbatch (``request.local_batch_size``:
    its rows per data rank), the dtype stages hand each other, and an optional constraint set."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, request: PlanRequest, hidden_dtype: torch.dtype,
                 constrain: Callable[[AutoParallel], None] | None = None, traces: dict | None = None,
                 solve_kinds: SolveKinds | None = None) -> None:
        self.model, self.mesh, self.sub = model, mesh, stage_submesh(mesh)
        self.request = dataclasses.replace(request, runtime=dataclasses.replace(request.runtime, micro_batches=1))
        self.hidden_dtype, self.constrain = hidden_dtype, constrain
        self.dim = model.tok_embeddings.weight.shape[1]
        self.n_layers = len(transformer_blocks(model))
        self.hw: Any = None
        self.solved: dict[tuple, Plan] = {}  # kind and microbatches held -> its plan (a recut reuses them)
        # stage -> (module, joint graph) by trace_key: a caller's dict shares them between pipelines
        self.traces: dict[tuple, tuple[nn.Module, Any]] = traces if traces is not None else {}
        self.solve_kinds = solve_kinds

    @property
    def rows(self) -> int:
        return self.request.local_batch_size

    def shape(self, layout: PipelineLayout, stage: int) -> StageShape:
        return StageShape(first=stage == 0, rows=self.rows, seq_len=self.request.seq_len, dim=self.dim,
                          dtype=self.hidden_dtype, microbatches_held=layout.in_flight(stage))

    def part(self, layout: PipelineLayout, stage: int) -> nn.Module:
        return split_model(self.model, layout.stages[stage], stage == 0, stage == layout.n_stages - 1)

    def planner(self, layout: PipelineLayout, stage: int, part: nn.Module, graph: Any = None) -> Any:
        """The entered planner of `stage` (a context manager), the constraint set applied."""
        return _Constrained(stage_planning(part, self.sub, self.request, self.shape(layout, stage), graph), self)

    def trace_key(self, layout: PipelineLayout, stage: int) -> tuple:
        """What a stage's joint graph depends on: its blocks, the embedding or the head, its global
        input (one microbatch of every data rank), the dtype it takes; not the submesh."""
        return (tuple(layout.stages[stage]), stage == 0, stage == layout.n_stages - 1,
                self.rows * data_degree(self.sub), self.request.seq_len, self.hidden_dtype)

    def plan_distinct(self, layout: PipelineLayout, only: list[int] | None = None
                      ) -> tuple[dict[int, Plan], dict[int, int]]:
        """Every stage's plan (`only`: these stages') on this one process: stages of one kind (as
        many blocks, the first, the last or neither) are solved once, on the first of them (under
        1F1B it holds the most microbatches: its plan fits the others). (stage -> its kind's plan,
        stage -> the stage that plan was made on)."""
        firsts = self.kinds(layout, only)
        todo = {kind: i for kind, i in firsts.items() if self._solved_key(layout, i) not in self.solved}
        if self.solve_kinds is not None and len(todo) > 1:  # side by side, elsewhere
            got = self.solve_kinds(layout, list(todo.values()))
            self.hw = got.hardware
            self.solved.update((self._solved_key(layout, i), got.plans[i]) for i in todo.values())
        for i in todo.values():
            if self._solved_key(layout, i) not in self.solved:
                self._solve(layout, i)
        made_on = {i: firsts[self.kind(layout, i)] for i in range(layout.n_stages) if only is None or i in only}
        return {i: self.solved[self._solved_key(layout, j)] for i, j in made_on.items()}, made_on

    def kind(self, layout: PipelineLayout, stage: int) -> tuple[int, bool, bool]:
        """What makes two stages' plans one: as many blocks, the first or not, the last or not."""
        return len(layout.stages[stage]), stage == 0, stage == layout.n_stages - 1

    def kinds(self, layout: PipelineLayout, only: list[int] | None = None) -> dict[tuple, int]:
        """Each kind of stage among `only` (default: all) -> the first stage of it."""
        firsts: dict[tuple, int] = {}
        for i in range(layout.n_stages):
            if only is None or i in only:
                firsts.setdefault(self.kind(layout, i), i)
        return firsts

    def _solved_key(self, layout: PipelineLayout, stage: int) -> tuple:
        """A stage's kind and microbatches held: a cut planned before may have solved it."""
        return (*self.kind(layout, stage), layout.in_flight(stage))

    def _solve(self, layout: PipelineLayout, i: int) -> None:
        """Stage `i` planned on this process (its trace reused when a caller's dict has it)."""
        t0 = time.perf_counter()
        key = self.trace_key(layout, i)
        part, graph = self.traces.get(key) or (self.part(layout, i), None)
        with self.planner(layout, i, part, graph) as autop:
            self.solved[self._solved_key(layout, i)] = autop.optimize_placement(verbose=False)
            _keep(self.traces, key, (part, autop.graph))
        if not dist.is_initialized() or dist.get_rank() == 0:
            last = i == layout.n_stages - 1
            logger.info("pipeline stage %d (%d blocks%s%s) planned in %.1f s", i, len(layout.stages[i]),
                        ", the embedding" if i == 0 else "", ", the output" if last else "", time.perf_counter() - t0)

    def unit_times(self, layout: PipelineLayout, plans: dict[int, Plan], made_on: dict[int, int] | None = None
                   ) -> dict[int, float]:
        """The predicted time of every unit of these stages (a plan made on another stage of
        the same kind: its units' times, in order)."""
        out: dict[int, float] = {}
        for i, plan in plans.items():
            j = i if made_on is None else made_on[i]
            got = unit_times(plan, layout.stages[j], j == 0, j == layout.n_stages - 1, self.n_layers)
            theirs = stage_units(layout, j, self.n_layers)
            out.update(zip(stage_units(layout, i, self.n_layers), (got[u] for u in theirs)))
        return out

    def plan_deeper(self, layout: PipelineLayout, shallower: PipelinePlan) -> PipelinePlan:
        """`layout`'s pipeline, as many stages as `shallower`'s and one block more in each, with
        only its middle stages solved: its first and last stages are `shallower`'s, each longer by
        what the block adds to a middle stage (the deeper of the screen's two pipelined copies,
        search/depth_scaling.py; two stages, no middle one: every stage solved)."""
        last = layout.n_stages - 1
        middle = list(range(1, last))
        if not middle:
            return self.plan(layout, recut=False)
        plans, _ = self.plan_distinct(layout, only=middle)
        block_us = plans[1].objective_us - shallower.stages[1].plan.objective_us
        for i in (0, last):
            end = shallower.stages[i].plan
            plans[i] = dataclasses.replace(end, objective_us=end.objective_us + block_us)
        return self._pipeline(layout, plans, [f"stages 0 and {last}: the shallower copy's, {block_us:,.1f} µs longer"])

    def p2p_us(self) -> float:
        """One boundary's send of a microbatch's hidden state on the pp axis's link."""
        itemsize = torch.empty((), dtype=self.hidden_dtype).element_size()
        return p2p_us(self.hw, self.mesh, self.rows * self.request.seq_len * self.dim * itemsize)

    def plan(self, layout: PipelineLayout, recut: bool = True) -> PipelinePlan:
        """The pipeline's plan: every kind of stage solved once; with `recut`, the cut by their
        predicted unit times when it is faster (and its stages solved)."""
        plans, made_on = self.plan_distinct(layout)
        if recut:
            cut = faster_cut(layout, self.unit_times(layout, plans, made_on), self.n_layers)
            if cut is not None:
                layout = dataclasses.replace(layout, stages=cut)
                plans, made_on = self.plan_distinct(layout)
        notes = [f"stage {i} is priced by stage {j}'s plan (as many blocks: one solve)"
                 for i, j in made_on.items() if i != j]
        return self._pipeline(layout, plans, notes)

    def _pipeline(self, layout: PipelineLayout, plans: dict[int, Plan], notes: list[str]) -> PipelinePlan:
        stages = [StagePlan(i, layout.stages[i], layout.rank_of(i), plans[i]) for i in range(layout.n_stages)]
        return PipelinePlan(layout.schedule, layout.pp, layout.n_microbatches, stages, p2p_us=self.p2p_us(),
                            notes=notes)


TRACES_KEPT = 6
"""Stage traces a shared dict keeps (a 405B stage's graph is some 100 MB)."""


def _keep(traces: dict, key: tuple, value: tuple) -> None:
    traces.pop(key, None)
    while len(traces) >= TRACES_KEPT:
        traces.pop(next(iter(traces)))
    traces[key] = value


class _Constrained:
    """A stage's planner context with the job's constraint set applied on entry; keeps the
    cost model's hardware for the p2p price."""

    def __init__(self, context: Any, stages: PipelineStages) -> None:
        self.context, self.stages = context, stages

    def __enter__(self) -> AutoParallel:
        autop = self.context.__enter__()
        if self.stages.constrain is not None:
            self.stages.constrain(autop)
        self.stages.hw = autop.cost_model().hw
        return autop

    def __exit__(self, *exc: Any) -> Any:
        return self.context.__exit__(*exc)
