"""Whether the backward gathers a plan's parameters again: a choice the planner prices.

A parameter stored sharded and used replicated is gathered in its block's forward. The
backward then either gathers it again (FSDP's default: the gathered copy is freed after the
block's forward) or keeps the forward's copy until the block's backward (FSDP's
`reshard_after_forward=False`, the ZeRO-2 shape: the gradients are reduce-scattered and the
optimizer states and update stay sharded, while the parameters used by compute stay whole
for the step; one all-gather and one reduce-scatter a step, an all-reduce's volume, where
DDP also runs the whole update on every rank). Keeping saves a gather per parameter per
micro-batch and holds the gathered copies from the forward to the backward.

With `[parallelism] reshard_after_forward = "auto"` (auto mode's default) the planner solves
under both and keeps the faster plan that fits the memory limit, recording the choice on the
plan (`Plan.reshard_after_forward`, replayed with it). Two solves are spared where one
settles it: when the model's states fit many times over, keeping is solved first and a
kept plan that fits and recomputes nothing is the answer (for the same placements keeping is
never slower, so no resharding plan can beat it); otherwise resharding is solved first, and a
plan that must recompute blocks to fit leaves no memory for kept copies.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from parallel.auto.plan import Plan
from parallel.auto.plan.report import resharding_words
from parallel.auto.problem.placement_problem import MemoryLimitError
from parallel.auto.runtime import RuntimeOptions

log = logging.getLogger("parallel.auto.api")

AUTO = "auto"
KEEP_FIRST_SHARE = 0.25
"""Keeping is solved first when the unsharded model states (16 B per parameter: the fp32
parameter, its gradient, two AdamW states) take at most this share of the memory limit."""


def chooses_resharding(runtime: RuntimeOptions) -> bool:
    return runtime.reshard_after_forward == AUTO


def schedule_resharding(runtime: RuntimeOptions) -> bool:
    """The cost model's setting before a choice is made (resharding, FSDP's default)."""
    return runtime.reshard_after_forward is not False


def resolved(runtime: RuntimeOptions, plan: Plan) -> RuntimeOptions:
    """The options a plan runs with: under "auto" the plan's own choice (resharding for a
    plan that has none: saved before the choice, or made with the setting fixed)."""
    if not chooses_resharding(runtime):
        return runtime
    keep = plan.reshard_after_forward is False
    return dataclasses.replace(runtime, reshard_after_forward=not keep)


@dataclasses.dataclass
class _Outcome:
    reshard: bool
    plan: Plan | None = None
    error: MemoryLimitError | None = None
    state: dict = dataclasses.field(default_factory=dict)  # the planner's attributes after this solve


_SOLVE_STATE = ("candidates", "problem", "traced_step", "seed_info", "recompute_row", "_cost_model")


def solve_state(autop: Any) -> dict[str, Any]:
    """What a solve leaves on the planner (its problem, traced step, cost model, ...): kept
    per candidate plan, so the planner can be left as the chosen plan's solve left it."""
    return {k: getattr(autop, k, None) for k in _SOLVE_STATE}


def restore_solve_state(autop: Any, state: dict[str, Any]) -> None:
    for k, v in state.items():
        setattr(autop, k, v)


def use_setting(autop: Any, reshard: bool) -> None:
    """Make the planner solve (and estimate) with this setting: its runtime options and
    its cost model (`price_as`)."""
    autop.runtime = dataclasses.replace(autop.runtime, reshard_after_forward=reshard)
    price_as(autop, reshard)


def price_as(autop: Any, reshard: bool) -> None:
    """Give the planner a cost model whose schedule has this setting (sharing the first
    model's caches: collective and compute prices do not depend on it; the problem's
    pricing key does)."""
    cm = autop.cost_model()
    if cm.schedule.reshard_after_forward != reshard:
        cm = copy.copy(cm)
        cm.schedule = dataclasses.replace(cm.schedule, reshard_after_forward=reshard)
        autop._cost_model = cm


def keeps_first(n_params: int, limit_bytes: int) -> bool:
    """Whether keeping is solved first for a model of `n_params` parameters under this memory
    limit (0: none): its unsharded states take at most KEEP_FIRST_SHARE of it."""
    return not limit_bytes or 16 * n_params <= KEEP_FIRST_SHARE * limit_bytes


def _keep_first(autop: Any) -> bool:
    return keeps_first(sum(p.numel() for p in autop.model.parameters()), autop.memory_limit()[0])


def _recomputes(plan: Plan) -> bool:
    return any(c != "none" for c in plan.recompute.get("blocks", ()))


def _fits(plan: Plan) -> bool:
    return plan.memory is None or plan.memory.fits


def choose_resharding(autop: Any, solve: Callable[[], Plan]) -> Plan:
    """`solve()` under resharding and under keeping (one of them where it settles the
    choice, see the module's note); the faster plan that fits, with the planner left as
    that plan's solve left it. Raises the resharding plan's MemoryLimitError when neither fits."""
    runtime = autop.runtime
    order = (False, True) if _keep_first(autop) else (True, False)
    outcomes: list[_Outcome] = []
    try:
        for reshard in order:
            out = _Outcome(reshard)
            use_setting(autop, reshard)
            try:
                out.plan = solve()
                out.plan.reshard_after_forward = reshard
            except MemoryLimitError as e:
                out.error = e
            out.state = solve_state(autop)
            outcomes.append(out)
            if out.plan is not None and _fits(out.plan) and (
                    (not reshard and not _recomputes(out.plan)) or (reshard and _recomputes(out.plan))):
                break
    finally:
        autop.runtime = runtime
    micro = runtime.micro_batches
    fitting = [o for o in outcomes if o.plan is not None and _fits(o.plan)]
    best = min(fitting, key=lambda o: o.plan.step_time_us(micro)) if fitting else None
    if best is None:  # every returned plan fits (or was not estimated): neither solve made one;
        # the resharding one's refusal (it needs the least memory)
        raise next((o.error for o in outcomes if o.reshard), outcomes[-1].error)
    restore_solve_state(autop, best.state)
    if len(outcomes) > 1:
        other = next(o for o in outcomes if o is not best)
        theirs = (f"{other.plan.step_time_us(micro) / 1e3:,.1f} ms" if other.plan is not None and _fits(other.plan)
                  else "does not fit")
        log.info("resharding: %s (step %.1f ms; %s: %s)", resharding_words(best.reshard),
                 best.plan.step_time_us(micro) / 1e3, resharding_words(other.reshard), theirs)
    else:
        log.info("resharding: %s (settled by one solve)", resharding_words(best.reshard))
    return best.plan
