"""The ILP's free plan checked against the DDP plan by the step simulation.

Why: the ILP adds up each edge's price on its own, and some costs are not an edge's. A
bucketed collective's latency is shared out as latency / (tensors in the block), so a block
that gathers 5 of its 9 weights pays 5/9 of a gather where the runtime runs a whole one. On
the 2x2 fidelity jobs (docs/measurements.md, "The suite over repeats") the ILP's optimum,
weights stored sharded with the forward's gathers kept, priced 2 % below the DDP plan and
measured 2.3 % and 5.8 % behind it, while the step simulation, which walks the step graph
the runtime runs (one collective per bucket, in order), picked the measured-best plan on
all five jobs.

So where every parameter may stay replicated (the parameter budget allows it and nothing
but the inputs is constrained) and the free plan is not already DDP's, the planner solves
again with every parameter replicated, simulates both plans on their memory estimates'
step graphs (traced for the estimate anyway) and keeps the faster one that fits. The plan
says so (`Plan.selection`). Large models never pay for it: their default budget shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import Replicate

from parallel.auto.plan import Plan
from parallel.auto.problem.placement_problem import PlanningError
from parallel.auto.resharding import restore_solve_state, solve_state

log = logging.getLogger("parallel.auto.api")


def replicate_every_parameter(autop: Any) -> None:
    """Every parameter replicated on every mesh axis (gradients all-reduced): DDP's plan."""
    autop.add_parameter_memory_constraint(high=1.0)
    for fqn in autop.graph.params:
        autop.add_node_constraint(fqn, (Replicate(),) * autop.mesh.ndim)


def _replicated(plan: Plan) -> bool:
    return all(set(p.strip("()").split(", ")) == {"R"} for p in plan.param_placements().values())


def _simulated_us(plan: Plan) -> float | None:
    fits = plan.memory is None or plan.memory.fits
    return plan.timeline.step_us if plan.timeline is not None and fits else None


def applies(autop: Any, plan: Plan) -> bool:
    """Whether `plan` (the free solve's) is checked against DDP's."""
    only_inputs = all(c.kind == "input" for c in autop.constraints)
    high = autop.memory_high
    return (only_inputs and high is not None and high >= 1.0 and _simulated_us(plan) is not None
            and not _replicated(plan))


def check_against_ddp(autop: Any, plan: Plan, solve: Callable[[], Plan]) -> Plan:
    """`plan`, or the DDP plan `solve()` makes under `replicate_every_parameter` when its
    simulated step is shorter; the planner is left as the kept plan's solve left it."""
    if not applies(autop, plan):
        return plan
    ilp_state = solve_state(autop)
    constraints, planner = list(autop.constraints), autop.planner
    try:
        replicate_every_parameter(autop)
        ddp = solve()
    except PlanningError as e:  # MemoryLimitError included: DDP's copies do not fit
        log.info("selection: no DDP plan to check the free plan against (%s)", str(e).splitlines()[0][:200])
        ddp = None
    finally:
        autop.constraints[:], autop.planner = constraints, planner
    mine, theirs = _simulated_us(plan), _simulated_us(ddp) if ddp is not None else None
    if theirs is None or not theirs < mine:
        restore_solve_state(autop, ilp_state)
        if theirs is not None:
            plan.selection = (f"the ILP's optimum, checked against every parameter replicated (DDP) by the step "
                              f"simulation: {mine / 1e3:,.1f} ms against {theirs / 1e3:,.1f} ms")
        return plan
    ddp.selection = (f"every parameter replicated (DDP), chosen over the ILP's optimum by the step simulation: "
                     f"{theirs / 1e3:,.1f} ms against {mine / 1e3:,.1f} ms (objectives {ddp.objective_us / 1e3:,.1f} "
                     f"and {plan.objective_us / 1e3:,.1f} ms)")
    log.info("selection: %s", ddp.selection)
    return ddp
