"""Replay a plan at another shape: the same placements, priced on a new graph's problem.

A plan is made for one input shape (`Plan.check_compatible` refuses another), but its
decisions are placements per named node, and the joint graph of the same model at another
sequence length or batch has the same nodes. Re-pricing those placements on the new
shape's Problem answers "what would the old plan cost now?" (the paper's Replay arm of
Figure 4, against a fresh plan at the new shape).

    labels = replay_labels(problem, plan)        # one strategy per decision group
    replayed = replay_plan(problem, plan)        # a Plan at the new shape, same placements
"""

from __future__ import annotations

from parallel.auto.candidates.placements import spec_placement_strs
from parallel.auto.candidates.strategies import PLACEHOLDER
from parallel.auto.plan import Plan, PlanMismatchError, build_plan
from parallel.auto.problem.placement_problem import Problem


def _strategy_index(prob: Problem, name: str, plan: Plan) -> int:
    """Index of the candidate of node `name` holding the plan's placements for it."""
    c = prob.candidates.nodes[name]
    np_ = plan.nodes.get(name)
    if np_ is None:
        raise PlanMismatchError(f"the plan has no strategy for node {name} of this graph: it was made for "
                                "another model or graph; re-plan")
    want_out, want_in = list(np_.output_placements), list(np_.input_placements)
    for i, spec in enumerate(c.specs):
        outs, ins = spec_placement_strs(spec)
        if outs == want_out and (c.kind == PLACEHOLDER or ins == want_in):
            return i
    raise PlanMismatchError(f"plan node {name} ({np_.label or np_.target}): outputs {want_out} from inputs "
                            f"{want_in} are not a strategy of this shape's graph ({len(c.specs)} candidates: "
                            "a dimension no longer divides?); re-plan for this shape")


def _recompute_label(prob: Problem, plan: Plan) -> int:
    """The plan's recomputation option among this problem's (every block "none" for a plan
    that fixed its AC setting: replayed, it is priced without recomputation)."""
    blocks = tuple(plan.recompute.get("blocks", ()))
    options = prob.recompute.options
    if not blocks:
        return 0
    if blocks not in options:
        raise PlanMismatchError(f"the plan's recomputation ({len(blocks)} blocks: {plan.recompute.get('summary')}) "
                                f"is not an option of this graph ({len(options[0])} blocks); re-plan")
    return options.index(blocks)


def replay_labels(prob: Problem, plan: Plan) -> list[int]:
    """One strategy index per decision group of `prob`, reproducing `plan`'s placements.

    Every member of a group must land on the same index (groups tie nodes that decide
    together); a plan that splits a group raises PlanMismatchError."""
    labels: list[int] = []
    for g, members in enumerate(prob.groups):
        if prob.recompute is not None and g == prob.recompute.group:
            labels.append(_recompute_label(prob, plan))
            continue
        idx = {_strategy_index(prob, name, plan) for name in members}
        if len(idx) != 1:
            raise PlanMismatchError(f"the plan gives the tied nodes {members[:4]} different placements: it was "
                                    "made with repeated_blocks set otherwise; replay with repeated_blocks = false")
        labels.append(idx.pop())
    return labels


def replay_plan(prob: Problem, plan: Plan, *, hardware: str, timings: dict[str, float] | None = None) -> Plan:
    """`plan`'s placements as a Plan of `prob` (the new shape): objective, breakdown and
    input shapes are the new shape's; `solver` says it was replayed, not solved."""
    labels = replay_labels(prob, plan)
    low, high = prob.memory_low, prob.memory_high
    return build_plan(prob, labels, solver="replay", status=f"replayed ({plan.solver}, {plan.status})",
                      timings=dict(timings or {}), num_vars=0, hardware=hardware, memory_budget=(low, high),
                      constraints=[c.description for c in prob.constraints])


__all__ = ["replay_labels", "replay_plan"]
