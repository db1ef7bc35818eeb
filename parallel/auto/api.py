"""User API: the AutoParallel context manager (trace -> candidates -> problem -> plan).

    with fake_world(32):
        mesh = init_device_mesh("cpu", (4, 8), mesh_dim_names=("dp", "tp"))
        with AutoParallel(model, input_fn, mesh, loss_fn=lm_loss, hardware="h100") as autop:
            autop.add_input_constraints([(Shard(0), Replicate()), (Shard(0), Replicate())])
            autop.add_parameter_memory_constraint(low=None, high=None)
            plan = autop.optimize_placement(verbose=True)
        print(plan.summary())

`input_fn()` returns GLOBAL-shaped sample inputs (tensors may be meta; DTensor leaves
contribute their placements as input constraints). The traced forward must return a
scalar loss: pass `loss_fn(model, *inputs)` around a model that returns logits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement, Replicate

from parallel import _torch as T
from parallel._torch import fake_world
from parallel.auto import recompute_fit, resharding, selection
from parallel.auto.candidates.coverage import GraphCoverage, coverage_of, coverage_report
from parallel.auto.candidates.placements import placement_str
from parallel.auto.candidates.strategies import Candidates, mesh_candidates
from parallel.auto.config import PlannerConfig, resolve_planner
from parallel.auto.cost import CostModel, RuntimeSchedule
from parallel.auto.cost.memory import GIB, MemoryEstimate, format_bytes
from parallel.auto.cost.timeline import StepTimeline
from parallel.auto.losses import lm_loss, lm_loss_positions
from parallel.auto.plan import Plan, PlanMismatchError, build_plan
from parallel.auto.plan.replay import replay_labels, replay_plan
from parallel.auto.problem.feasibility import memory_advice, memory_fix
from parallel.auto.problem.formulation import build_problem
from parallel.auto.problem.placement_problem import (
    Constraint,
    MemoryLimitError,
    PlanningError,
    Problem,
    min_parameter_fraction,
)
from parallel.auto.recompute_fit import RowState, chooses_recompute, first_solve, fit_with_recompute, plan_options
from parallel.auto.regions import CP_ATTENTION  # declares the causal-attention region
from parallel.auto.runtime import RuntimeOptions, apply_plan
from parallel.auto.runtime.memory import TracedStep, predict_traced, step_memory, trace_step
from parallel.auto.runtime.runner import same_graph_options
from parallel.auto.runtime.step_graph import fake_constants
from parallel.auto.solve import MRFEffort, Solution, solve
from parallel.auto.solve.seed import plan_candidates, reseeded_candidates, seeded_candidates, use_seeding
from parallel.auto.trace.gc_pause import pauses_collector
from parallel.auto.trace.joint import JointGraph, trace_joint

log = logging.getLogger("parallel.auto")

__all__ = ["AutoParallel", "CP_ATTENTION", "MemoryLimitError", "PlanningError", "Plan", "fake_world", "lm_loss",
           "lm_loss_positions"]

MEMORY_ROUNDS = 3  # re-solves with a tighter parameter budget when a plan is over the memory limit
ESTIMATES_KEPT = 4  # peak-memory estimates kept per joint graph (JointGraph.kept_estimates)
def _over_limit(est: MemoryEstimate) -> str:
    return (f"no plan fits in the memory limit: predicted peak {format_bytes(est.peak_bytes)} per device "
            f"({est.parts()}, in the {est.phase}) > {format_bytes(est.limit_bytes)} ({est.limit_source})")


def _as_placements(p: Any, ndim: int, what: str) -> tuple | None:
    if p is None:
        return None
    if isinstance(p, Placement):
        p = (p,)
    p = tuple(p)
    if len(p) != ndim:
        raise ValueError(f"{what}: {p} has {len(p)} placements for a {ndim}-D mesh")
    return p


class AutoParallel:
    """Plan SPMD placements for `model` on `mesh` (see the module docstring)."""

    microbatches_held = 1  # saved activations alive at the peak (a pipeline stage's: stages.StagePlanner)

    def __init__(
        self,
        model: nn.Module,
        input_fn: Callable[[], Any] | tuple,
        mesh: DeviceMesh,
        *,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        planner: PlannerConfig | None = None,
        runtime: RuntimeOptions | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
        regions: tuple[str, ...] = (),
        graph: JointGraph | None = None,
        stage: bool = False,
    ) -> None:
        """`planner`: every planner setting (config.py); `runtime`: how the plan will run (priced);
        `regions`: declared local_map regions traced as one node each; `graph`: a joint graph
        traced earlier for this model and these global inputs (a sweep plans one trace on many
        meshes). The planner's "choose for me" values are made concrete by the request builder's
        resolver (`config.resolve_planner`; a no-op for a request's planner, resolved already).
        `stage`: `model` is a pipeline stage (its forward returns a hidden state or logits; the
        gradient of a hidden-state input is part of the plan: trace_joint)."""

        self.model = model
        planner = planner if planner is not None else PlannerConfig()
        planner.check()  # the API's own entry: a PlannerConfig built by hand is checked here
        self.planner = resolve_planner(planner, mesh.size(), mesh.device_type)
        self.regions = tuple(regions)
        self.input_fn = input_fn
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.stage = stage
        self.mp_policy = mp_policy
        self.seed_info: Any = None
        self.runtime = runtime if runtime is not None else RuntimeOptions()
        self.mp_dtype: torch.dtype | None = getattr(mp_policy, "param_dtype", None) if mp_policy is not None else None
        self._cost_model: CostModel | None = None  # built on first use (cost_model())
        # a joint graph traced earlier for this model and these global inputs (a sweep plans one
        # trace on many meshes: the trace does not depend on the mesh); None: trace on entry
        self._given_graph = graph
        self.graph: JointGraph | None = None
        self.candidates: Candidates | None = None
        self.constraints: list[Constraint] = []
        self.timings: dict[str, float] = {}
        self._input_placements: list[tuple | None] = []
        self.problem: Problem | None = None  # the last problem built (solved, or for a replay)
        # the runner and step graph the last memory estimate traced: apply_placement of that plan
        # hands them to its ParallelModule (one trace per plan); replaced by each estimate
        self.traced_step: TracedStep | None = None
        self._warm_start: Plan | None = None  # optimize_placement's, for every solve of that call
        self.recompute_row: RowState | None = None  # mode "auto": the recomputation row (recompute_fit.py)

    # ------------------------------------------------------------------ context
    @pauses_collector
    def __enter__(self) -> "AutoParallel":
        t0 = time.perf_counter()
        inputs = self.input_fn() if callable(self.input_fn) else self.input_fn
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        flat, spec = T.tree_flatten(inputs)
        plain = []
        for x in flat:
            if isinstance(x, DTensor):
                self._input_placements.append(tuple(x.placements))
                plain.append(torch.empty(x.shape, dtype=x.dtype, device="meta"))
            else:
                self._input_placements.append(None)
                plain.append(x)
        inputs = T.tree_unflatten(plain, spec)
        if self._given_graph is not None:
            shapes = [list(x.shape) for x in T.tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]
            if shapes != [list(s) for s, _ in self._given_graph.input_shapes]:
                raise ValueError(f"the given graph was traced for inputs {self._given_graph.input_shapes}, "
                                 f"not {shapes}; trace again for these inputs")
            self.graph = self._given_graph
        else:
            self.graph = trace_joint(self.model, inputs, self.loss_fn, device=self.mesh.device_type,
                                     regions=self.regions, compute_dtype=self.mp_dtype, stage=self.stage)
        self.timings["trace"] = time.perf_counter() - t0 if self._given_graph is None else 0.0  # 0: not traced here
        t1 = time.perf_counter()
        if not self._seeded():  # seeded candidates are enumerated in optimize_placement
            self.candidates = mesh_candidates(self.graph, self.mesh)
        self.timings["candidates"] = time.perf_counter() - t1
        for i, p in enumerate(self._input_placements):
            if p is not None:
                self._add(Constraint("input", f"input constraint on input {i} {placement_str(p)} (from its DTensor)",
                                     node=self.graph.inputs[i].name, placements=p))
        return self

    def __exit__(self, *exc: Any) -> None:
        # the fake-tensor graph is kept on the plan's problem only while the user holds it
        self.candidates = None
        self.graph = None
        self.traced_step = None

    def _need_graph(self) -> JointGraph:
        if self.graph is None:
            raise RuntimeError("use AutoParallel(...) as a context manager: `with AutoParallel(...) as autop:`")
        return self.graph

    def _add(self, con: Constraint) -> None:
        self.constraints.append(con)

    def coverage(self) -> GraphCoverage:
        """How every ATen op of the traced graph is handled on this mesh (coverage.py): print it to
        see what a model nobody here wrote turned into, and what was folded or fell back."""
        jg = self._need_graph()
        return coverage_of(self.candidates) if self.candidates is not None else coverage_report(jg, self.mesh)

    # ------------------------------------------------------------------ constraints
    def add_input_constraints(self, placements: Sequence[Any]) -> None:
        """One placement tuple per (flattened) user input; None leaves an input free."""
        jg = self._need_graph()
        if len(placements) > len(jg.inputs):
            raise ValueError(f"{len(placements)} input constraints for {len(jg.inputs)} inputs")
        for i, p in enumerate(placements):
            p = _as_placements(p, self.mesh.ndim, f"input constraint {i}")
            if p is None:
                continue
            self._add(Constraint("input", f"input constraint on input {i} {placement_str(p)}", node=jg.inputs[i].name,
                                 placements=p))

    def add_output_constraints(self, placements: Sequence[Any]) -> None:
        """One placement tuple per forward output (the loss is a scalar: Replicate)."""
        jg = self._need_graph()
        outs = [s for s in jg.slots if s.kind == "output"]
        if len(placements) > len(outs):
            raise ValueError(f"{len(placements)} output constraints for {len(outs)} outputs")
        for i, p in enumerate(placements):
            p = _as_placements(p, self.mesh.ndim, f"output constraint {i}")
            if p is None:
                continue
            self._add(Constraint("output", f"output constraint on output {i} {placement_str(p)}",
                                 node=f"output[{outs[i].index}]", placements=p))

    def add_parameter_memory_constraint(self, low: float | None = None, high: float | None = None) -> None:
        """Byte-weighted parameter storage per device as a fraction of all parameter bytes.

        None for `high` means fully sharded (1 / world_size); None for `low` means no floor.
        The budget is the planner's (`memory_budget_low` / `_high`): this sets both, checked.
        """
        self.planner = self.planner.replace(memory_budget_low=low, memory_budget_high=high)

    @property
    def memory_low(self) -> float | None:
        """The parameter budget's floor (the planner's memory_budget_low)."""
        return self.planner.memory_budget_low

    @property
    def memory_high(self) -> float | None:
        """The parameter budget (the planner's memory_budget_high; None: fully sharded)."""
        return self.planner.memory_budget_high

    def add_node_constraint(self, node: Any, placements: Any = None,
                            input_placements: Sequence[Any] | None = None) -> None:
        """Fix a node's output placements (and optionally its inputs').

        `node`: an fx node, a node name, a parameter FQN or "output[i]" slot name.
        """
        jg = self._need_graph()
        name = self._node_name(node)
        p = _as_placements(placements, self.mesh.ndim, f"node constraint on {name}")
        ins = None
        if input_placements is not None:
            ins = tuple(_as_placements(x, self.mesh.ndim, f"node constraint on {name}") for x in input_placements)
        label = jg.labels.get(name, name)
        what = f"node constraint on `{node if isinstance(node, str) else name}` ({label})"
        if p is not None:
            what += f" {placement_str(p)}"
        if ins is not None:
            what += " inputs " + ", ".join(placement_str(x) if x else "*" for x in ins)
        self._add(Constraint("node", what, node=name, placements=p, input_placements=ins))

    def _node_name(self, node: Any) -> str:
        jg = self._need_graph()
        if isinstance(node, torch.fx.Node):
            return node.name
        if node in jg.params:
            return jg.params[node].name
        if node in jg.buffers:
            return jg.buffers[node].name
        if self.candidates is not None and node in self.candidates.nodes:
            return node
        if self.candidates is None and (node.startswith("output[") or any(n.name == node for n in jg.gm.graph.nodes)):
            return node
        raise KeyError(f"no node, parameter or buffer named {node!r}")

    # ------------------------------------------------------------------ solve
    def cost_model(self) -> CostModel:
        """The cost model of this mesh and hardware (built once)."""
        if self._cost_model is None:
            names = list(self.mesh.mesh_dim_names or [f"axis{i}" for i in range(self.mesh.ndim)])
            rt = self.runtime
            schedule = RuntimeSchedule(bucket=rt.bucket, reduce_bucket_bytes=rt.reduce_bucket_bytes, overlap=rt.overlap,
                                       reshard_after_forward=resharding.schedule_resharding(rt),
                                       reduce_dtype=getattr(self.mp_policy, "reduce_dtype", None))
            p, shape = self.planner, tuple(self.mesh.shape)
            self._cost_model = CostModel(p.hardware, shape, names, compute_dtype=self.mp_dtype, schedule=schedule,
                                         routing_imbalance=p.moe_imbalance_factor, optimizer=p.optimizer)
        return self._cost_model

    def _memory_bounds(self) -> tuple[float | None, float | None]:
        ws = self.mesh.size()
        if self.memory_high is not None:
            return self.memory_low, self.memory_high
        # default: fully sharded, or as close as the parameters' shapes allow
        floor = min_parameter_fraction(self.candidates) if self.candidates is not None else 0.0
        high = max(1.0 / ws, floor)
        if high > 1.0 / ws * (1 + 1e-9):
            log.info("memory: parameters cannot all be sharded %d ways; default high raised to %.4g", ws, high)
        return self.memory_low, high

    @pauses_collector
    def optimize_placement(self, verbose: bool = True, warm_start: Plan | None = None) -> Plan:
        """Build the problem, solve it and return the Plan (seeded from 3-D meshes on).

        `warm_start`: a neighbouring job's plan (a sweep's previous point on this mesh: another
        budget, sequence or batch) whose placements, where this graph's strategies hold them,
        start the solver (an incumbent for the exact ILP: the optimum does not change; a second
        starting point for the MRF's local search: the better plan wins)."""
        solve = (lambda: resharding.choose_resharding(self, lambda: self._optimize(verbose, warm_start))) \
            if resharding.chooses_resharding(self.runtime) else (lambda: self._optimize(verbose, warm_start))
        return selection.check_against_ddp(self, solve(), solve)  # the ILP's optimum against DDP's, simulated

    def _optimize(self, verbose: bool, warm_start: Plan | None) -> Plan:
        jg = self._need_graph()
        self._warm_start = warm_start
        self.recompute_row = RowState(self.memory_limit()[0], held=self.microbatches_held) \
            if chooses_recompute(self.runtime) else None
        level = logging.INFO if verbose else logging.DEBUG
        cm = self.cost_model()
        if self._seeded():
            t0 = time.perf_counter()
            self.candidates, self.seed_info = seeded_candidates(
                jg, self.mesh, cm, self.constraints, radius=self.planner.split_seeding_radius, mp_dtype=self.mp_dtype,
                repeated_blocks=self.planner.repeated_blocks, solver=self.planner.solver,
                time_limit=self.planner.time_limit, effort=MRFEffort.of(self.planner))
            self.timings["seed"] = time.perf_counter() - t0  # seed.py logs its summary
        assert self.candidates is not None
        low, high = self._memory_bounds()
        prob, sol = first_solve(self, low, high)
        rounds = self.planner.split_seeding_rounds if self._seeded() else 1
        for _ in range(rounds - 1):  # re-seed around the plan (seed.py)
            t1 = time.perf_counter()
            chosen = {n: self.candidates.nodes[n].specs[sol.labels[prob.group_of[n]]] for n in self.seed_info.options}
            cands2 = reseeded_candidates(jg, self.mesh, self.seed_info, chosen)
            prob2, sol2 = self._build_and_solve(cands2, low, high)
            self.timings["reseed"] = self.timings.get("reseed", 0.0) + time.perf_counter() - t1
            log.log(level, "re-seeding round %d: objective %.1f -> %.1f µs", self.seed_info.rounds, sol.objective,
                    sol2.objective)
            if not sol2.objective < sol.objective - 1e-9 * abs(sol.objective):
                break
            self.candidates, prob, sol = cands2, prob2, sol2
        self.problem = prob
        log.log(level, "solve: objective %.1f µs, %s, %.2fs (%s, %d vars)", sol.objective, sol.status, sol.seconds,
                sol.solver, sol.num_vars)
        plan = self.plan_of(prob, sol, low, high)
        if not self.planner.memory_estimate:
            log.log(level, "memory: not estimated (memory_estimate is off): the memory limit is not checked")
            return plan
        if self.recompute_row is not None:
            return fit_with_recompute(self, plan, low, high, level)
        return self._fit_memory(plan, low, high, level)

    def build_and_solve(self, low: float | None, high: float | None) -> tuple[Problem, Solution]:
        """The problem on the current candidates, solved (recompute_fit.py's rounds)."""
        return self._build_and_solve(self.candidates, low, high)

    def plan_of(self, prob: Problem, sol: Solution, low: float | None, high: float | None) -> Plan:
        cm = self.cost_model()
        return build_plan(prob, sol.labels, solver=sol.solver, status=sol.status, timings=self.timings,
                          num_vars=sol.num_vars, hardware=cm.hw.name,
                          memory_budget=(low, high), constraints=[c.description for c in self.constraints])

    # ------------------------------------------------------------------ memory
    def memory_limit(self) -> tuple[int, str]:
        """(bytes a plan's peak per device may reach, where that figure comes from); 0: none."""
        if self.planner.memory_limit_gib is not None:
            limit = self.planner.memory_limit_gib
            return (int(limit * GIB) if math.isfinite(limit) else 0), f"memory_limit_gib {limit:g}"
        hw = self.cost_model().hw
        return hw.memory_limit, f"memory_limit_gib of the hardware profile {hw.source}"

    @pauses_collector
    def estimate_memory(self, plan: Plan, options: RuntimeOptions | None = None) -> MemoryEstimate:
        """Peak bytes per device of a training step of `plan` run with `options` (default:
        this planner's runtime options), checked against `memory_limit()` (cost/memory.py).
        With this planner's options, the same step graph simulated on the cost model becomes
        `plan.timeline` (the plan page's lanes; not saved with the plan)."""
        jg = self._need_graph()
        if self.candidates is None:  # seeded mesh and nothing solved here: a replayed or received plan
            self.candidates = plan_candidates(jg, self.mesh, plan)
        t0 = time.perf_counter()
        self.traced_step = None  # release the previous plan's graph before tracing this one
        own = options is None or options == self.runtime
        options = plan_options(options if options is not None else self.runtime, plan)
        key = (id(self.mesh), plan.placement_digest(), tuple(sorted(_strategies(plan).items())),
               dataclasses.replace(options, compile=False), str(self.mp_dtype),
               str(getattr(self.mp_policy, "reduce_dtype", None)), self.planner.optimizer)
        kept = jg.kept_estimates.get(key)
        # this plan, estimated on this graph and mesh by another planner (a sweep's earlier point);
        # this planner's own estimates are traced again: apply_placement takes their step graph
        if kept is not None and kept[0] is self.mesh and kept[2] != id(self):
            est = dataclasses.replace(kept[1])
            est.limit_bytes, est.limit_source = self.memory_limit()
            if own and kept[3] is not None and kept[3][0] == self.cost_model().hw:  # simulated on this hardware
                plan.timeline = kept[3][1]
            self.timings["memory"] = self.timings.get("memory", 0.0) + time.perf_counter() - t0
            log.info("memory: the estimate of this plan on this mesh, made earlier, reused")
            return est
        step = trace_step(jg, self.candidates, plan, self.mesh, mp_policy=self.mp_policy, options=options)
        est = step_memory(step, self.mesh, self.planner.optimizer)
        if own:
            plan.timeline = self._simulate(step)
        while len(jg.kept_estimates) >= ESTIMATES_KEPT:
            jg.kept_estimates.pop(next(iter(jg.kept_estimates)))
        simulated = (self.cost_model().hw, plan.timeline) if own and plan.timeline is not None else None
        jg.kept_estimates[key] = (self.mesh, dataclasses.replace(est), id(self), simulated)
        est.limit_bytes, est.limit_source = self.memory_limit()
        consts = fake_constants(step.step_graph.gm)
        if consts:
            log.info("memory: the step graph holds fake-tensor constants (%s): apply_placement traces its own "
                     "(a graph traced on fake tensors cannot run on real ones with them)", ", ".join(consts[:5]))
        else:
            self.traced_step = step
        self.timings["memory"] = self.timings.get("memory", 0.0) + time.perf_counter() - t0
        return est

    def _simulate(self, step: TracedStep) -> StepTimeline | None:
        """The traced step on the cost model: its timeline (None, with a warning, where the
        simulation fails: the plan is no worse for it, its page says so)."""
        try:
            tl = predict_traced(step, self.mesh, self.cost_model()).timeline
            if tl is not None and step.options.micro_batches > 1:  # the graph each micro-batch runs
                tl.source += f", one of {step.options.micro_batches} micro-batches (gradients reduced once a step)"
            return tl
        except Exception as e:  # noqa: BLE001 - a picture, not the plan
            log.warning("step simulation failed (%s: %s); the plan page draws no timeline", type(e).__name__,
                        str(e)[:300])
            return None

    def _fit_memory(self, plan: Plan, low: float | None, high: float | None, level: int) -> Plan:
        """Estimate the plan's peak; over the limit, shard the parameters more and re-solve
        (each parameter byte less also saves its gradient and two AdamW states), a few
        rounds, the last one as sharded as the parameters allow; then MemoryLimitError."""
        floor = max(min_parameter_fraction(self.candidates), low or 0.0)
        cur = high if high is not None else 1.0
        for round_ in range(MEMORY_ROUNDS + 1):
            try:
                plan.memory = est = self.estimate_memory(plan)
            except Exception as e:  # noqa: BLE001 - a plan the runtime cannot trace still is a plan
                log.warning("memory: no estimate for this plan (%s: %s); the memory limit is not checked",
                            type(e).__name__, str(e)[:300])
                return plan
            plan.timings["memory"] = self.timings["memory"]
            if est.fits:
                return plan
            if round_ == MEMORY_ROUNDS or plan.memory_fraction <= floor * (1 + 1e-9):
                break
            target = plan.memory_fraction - (est.peak_bytes - est.limit_bytes) / (4 * plan.total_param_bytes)
            cur = floor if round_ == MEMORY_ROUNDS - 1 else max(floor, min(cur, target))
            log.log(level, "memory: peak %s > %s (%s): re-solving with parameter budget high=%.4g",
                    format_bytes(est.peak_bytes), format_bytes(est.limit_bytes), est.limit_source, cur)
            try:
                prob, sol = self._build_and_solve(self.candidates, low, cur)
            except PlanningError as e:
                raise MemoryLimitError(f"{_over_limit(est)}, and the constraints allow no more sharding "
                                       f"({e}); {self.memory_advice_text(est)}", est) from None
            plan = self.plan_of(prob, sol, low, cur)
        raise MemoryLimitError(f"{_over_limit(est)}, even with the parameters as sharded as they can be (parameter "
                               f"budget high={plan.memory_fraction:.4g}); {self.memory_advice_text(est)}", est)

    def memory_advice_text(self, est: MemoryEstimate) -> str:
        """The dominant part of the peak and the setting that lowers it, then the general fixes."""
        advice = memory_advice(est, self.runtime.ac_level, self.runtime.reshard_after_forward,
                               getattr(self.mp_policy, "param_dtype", None), self.planner.optimizer)
        return f"{advice}; {memory_fix(self.runtime.ac_level)}"

    @pauses_collector
    def replay_placement(self, plan: Plan) -> Plan:
        """`plan` (made for another input shape, e.g. a shorter sequence) priced on this
        graph: the same placements per node, the objective and breakdown of this shape.
        Reuses the problem of `optimize_placement` when it ran (the fresh plan's), so the
        two objectives are comparable; raises PlanMismatchError when a placement no longer
        fits (a dimension that stops dividing)."""
        jg = self._need_graph()
        plan.check_compatible(model=self.model, mesh=self.mesh, source="the replayed plan")
        if self.problem is None:
            if self.candidates is None:  # seeded mesh: the plan's own strategies, rebuilt
                self.candidates = plan_candidates(jg, self.mesh, plan)
            low, high = self._memory_bounds()
            t0 = time.perf_counter()
            if resharding.chooses_resharding(self.runtime):  # priced with the plan's own choice
                resharding.price_as(self, plan.reshard_after_forward is not False)
            self.problem = build_problem(self.candidates, self.cost_model(), constraints=self.constraints,
                                         memory_low=low, memory_high=high, repeated_blocks=self.planner.repeated_blocks,
                                         mp_dtype=self.mp_dtype, recompute=recompute_fit.replay_row(self.runtime, plan))
            self.timings["build"] = self.timings.get("build", 0.0) + time.perf_counter() - t0
        cm = self.cost_model()
        return replay_plan(self.problem, plan, hardware=cm.hw.name,
                           timings=self.timings)

    def _build_and_solve(self, cands: Candidates, low: float | None, high: float | None) -> tuple[Problem, Solution]:
        t0 = time.perf_counter()
        prob = build_problem(cands, self.cost_model(), constraints=self.constraints, memory_low=low, memory_high=high,
                             repeated_blocks=self.planner.repeated_blocks, mp_dtype=self.mp_dtype,
                             recompute=self.recompute_row.row() if self.recompute_row is not None else None)
        self.timings["build"] = self.timings.get("build", 0.0) + time.perf_counter() - t0
        sol = solve(prob, self.planner.solver, time_limit=self.planner.time_limit, start=self._start_labels(prob),
                    effort=MRFEffort.of(self.planner))
        self.timings["solve"] = self.timings.get("solve", 0.0) + sol.seconds
        return prob, sol

    def _start_labels(self, prob: Problem) -> list[int] | None:
        """The warm-start plan's strategies on `prob`; None without one, or when a placement of
        it is not a strategy here (another model, a dimension that no longer divides, seeding)."""
        if self._warm_start is None:
            return None
        try:
            return replay_labels(prob, self._warm_start)
        except PlanMismatchError as e:
            log.info("warm start: not used (%s)", str(e)[:200])
            return None

    def _seeded(self) -> bool:
        return use_seeding(self.mesh.ndim, self.planner.split_seeding)

    # ---- materialisation (parallel/auto/runtime) ----
    @pauses_collector
    def apply_placement(self, plan: Plan, options: RuntimeOptions | None = None) -> nn.Module:
        """Materialise `plan` (in-memory or loaded/replayed) as a ParallelModule (runtime/);
        `options`: activation checkpointing, resharding, bucketing, overlap, compilation."""
        jg = self._need_graph()
        if self.candidates is None:  # seeded mesh and nothing solved here: a replayed or received plan
            self.candidates = plan_candidates(jg, self.mesh, plan)
        options = plan_options(options if options is not None else self.runtime, plan)
        step, self.traced_step = self._traced_step_of(plan, options), None  # handed over or released
        jg.kept_candidates = None  # the module keeps the graph, not the candidates (strategies.mesh_candidates)
        return apply_plan(self.model, jg, self.candidates, plan, self.mesh, mp_policy=self.mp_policy,
                          options=options, cost_model=self.cost_model(),
                          runner=step.runner if step is not None else None,
                          step_graph=step.step_graph if step is not None else None)

    def _traced_step_of(self, plan: Plan, options: RuntimeOptions) -> TracedStep | None:
        """The memory estimate's runner and step graph when they were built for this plan (the
        same placements and strategies: a plan received as JSON matches the one solved), these
        options (compilation aside) and this planner's graph, candidates and mixed precision."""
        step = self.traced_step
        if step is None:
            return None
        same = (step.runner.graph is self.graph and step.candidates is self.candidates
                and step.runner.mesh is self.mesh
                and same_graph_options(step.options, options)
                and step.runner.param_dtype == getattr(self.mp_policy, "param_dtype", None)
                and step.runner.reduce_dtype == getattr(self.mp_policy, "reduce_dtype", None)
                and _strategies(step.plan) == _strategies(plan)
                and step.plan.placement_digest() == plan.placement_digest())
        if not same:
            log.info("apply: the memory estimate's step graph is of another plan or other runtime options; the "
                     "module traces its own")
            return None
        return step


def _strategies(plan: Plan) -> dict[str, int]:
    return {name: n.strategy for name, n in plan.nodes.items()}


# ---------------------------------------------------------------------------
# The one-call API
# ---------------------------------------------------------------------------


def _is_placement_tuple(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and bool(x) and all(isinstance(p, Placement) for p in x)


def auto_parallel(model: nn.Module, mesh: DeviceMesh, sample_inputs: Any, out_shardings: Any = None, *,
                  mp_policy: MixedPrecisionPolicy | None = None, parameter_memory_budget: tuple | None = (None, None),
                  dynamic: bool = False, loss_fn: Callable[..., torch.Tensor] | None = None,
                  planner: PlannerConfig | None = None, runtime: RuntimeOptions | None = None,
                  verbose: bool = False) -> nn.Module:
    """Plan + materialise in one call: returns the ParallelModule (expects per-rank local inputs).

    sample_inputs: global-shaped pytree (or a callable returning it); plain tensors are
    replicated on every mesh axis, DTensor leaves give their placements. out_shardings:
    one placement tuple per forward output (the traced forward returns a scalar loss:
    pass `loss_fn(model, *inputs)` around a model that returns logits).
    """
    if dynamic:
        raise NotImplementedError("dynamic=True (symbolic batch sizes) is not supported: "
                                  "the plan is made for fixed shapes")
    inputs = sample_inputs() if callable(sample_inputs) else sample_inputs
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    flat, _ = T.tree_flatten(inputs)
    with AutoParallel(model, inputs, mesh, loss_fn=loss_fn, mp_policy=mp_policy, planner=planner,
                      runtime=runtime) as autop:
        # plain tensors are replicated on every mesh axis; DTensors bring their placements
        rep = tuple(Replicate() for _ in range(mesh.ndim))
        autop.add_input_constraints([None if isinstance(x, DTensor) else rep for x in flat
                                     if isinstance(x, torch.Tensor)])
        if out_shardings is not None:
            outs = [tuple(out_shardings)] if _is_placement_tuple(out_shardings) else list(out_shardings)
            autop.add_output_constraints(outs)
        if parameter_memory_budget is not None:
            low, high = parameter_memory_budget
            autop.add_parameter_memory_constraint(low=low, high=high)
        plan = autop.optimize_placement(verbose=verbose)
        return autop.apply_placement(plan)
