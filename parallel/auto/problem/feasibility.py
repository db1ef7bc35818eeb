"""User constraints on a Problem and its feasibility, with errors in the user's terms.

Before solving: each constraint restricts its node's group; arc consistency over finite
edge costs removes strategies no neighbour can follow; when nothing is left, a deletion
filter finds the smallest set of user constraints (and the memory budget) that conflict
and names them in one PlanningError.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from parallel.auto.candidates.placements import placement_str
from parallel.auto.cost.memory import format_bytes
from parallel.auto.problem.placement_problem import Constraint, PlanningError, Problem


def constraint_mask(prob: Problem, con: Constraint) -> np.ndarray:
    """Strategies of the constrained node's group that satisfy `con`."""
    c = prob.candidates.nodes[con.node]
    mask = np.ones(len(c.specs), dtype=bool)
    for j, s in enumerate(c.specs):
        o = s.output_specs
        if con.placements is not None:
            op = tuple(x.placements if x is not None else None for x in o) if isinstance(o, tuple) else o.placements
            want = tuple(con.placements)
            if isinstance(o, tuple) and want and not isinstance(want[0], tuple):
                op = op[0]
            if op != want:
                mask[j] = False
        if con.input_placements is not None:
            got = tuple(i.placements for i in s.input_specs)
            for k, want_k in enumerate(con.input_placements):
                if want_k is not None and (k >= len(got) or got[k] != tuple(want_k)):
                    mask[j] = False
    return mask


def apply_constraint(prob: Problem, con: Constraint) -> None:
    if con.node not in prob.candidates.nodes:
        raise PlanningError(f"{con.description}: no node named {con.node!r}")
    g = prob.group_of[con.node]
    mask = constraint_mask(prob, con)
    if not mask.any():
        c = prob.candidates.nodes[con.node]
        menu = sorted({placement_str(_first_out(s)) for s in c.specs})
        raise PlanningError(f"{con.description}: no candidate strategy has this placement; "
                            f"valid placements: {', '.join(menu)}")
    prob.allowed[g] = prob.allowed[g] & mask


def _first_out(s: Any) -> tuple:
    o = s.output_specs
    if isinstance(o, tuple):
        o = next(x for x in o if x is not None)
    return o.placements


# ---------------------------------------------------------------------------
# Feasibility (before solving), with errors in user terms
# ---------------------------------------------------------------------------


def _propagate(prob: Problem, allowed: list[np.ndarray]) -> int | None:
    """Arc consistency over finite edge costs; returns a group left with no strategy, or None."""
    changed = True
    rounds = 0
    while changed and rounds < 20:
        changed = False
        rounds += 1
        for e in prob.edges:
            fin = np.isfinite(e.cost)
            a_src, a_dst = allowed[e.src], allowed[e.dst]
            src_cls_ok = np.zeros(e.cost.shape[0], dtype=bool)
            src_cls_ok[e.src_cls[a_src]] = True
            dst_cls_ok = np.zeros(e.cost.shape[1], dtype=bool)
            dst_cls_ok[e.dst_cls[a_dst]] = True
            # a dst class is supported if some allowed src class reaches it with finite cost
            dst_sup = (fin & src_cls_ok[:, None]).any(axis=0)
            src_sup = (fin & dst_cls_ok[None, :]).any(axis=1)
            new_dst = a_dst & dst_sup[e.dst_cls]
            new_src = a_src & src_sup[e.src_cls]
            if not new_dst.all() or not new_src.all():
                if (new_dst != a_dst).any():
                    allowed[e.dst] = new_dst
                    changed = True
                if (new_src != a_src).any():
                    allowed[e.src] = new_src
                    changed = True
                if not new_dst.any():
                    return e.dst
                if not new_src.any():
                    return e.src
    return None


def _memory_range(prob: Problem, allowed: list[np.ndarray]) -> tuple[float, float]:
    lo = hi = 0.0
    for g in prob.param_groups:
        b = prob.param_bytes[g][allowed[g]]
        if b.size == 0:
            return math.inf, -math.inf
        lo += float(b.min())
        hi += float(b.max())
    return lo, hi


def _feasible_with(prob: Problem, base: list[np.ndarray], cons: list[Constraint], memory: bool) -> str | None:
    allowed = [a.copy() for a in base]
    for con in cons:
        if con.kind == "memory":
            continue
        g = prob.group_of[con.node]
        allowed[g] = allowed[g] & constraint_mask(prob, con)
        if not allowed[g].any():
            return f"no strategy of {prob.groups[g][0]} satisfies them"
    bad = _propagate(prob, allowed)
    if bad is not None:
        return f"node {prob.groups[bad][0]} is left without a valid strategy"
    if memory:
        lo, hi = _memory_range(prob, allowed)
        total = prob.total_param_bytes
        if prob.memory_high is not None and lo > prob.memory_high * total * (1 + 1e-9):
            return (f"parameters need at least {lo / total:.4g} of their bytes per device, "
                    f"above high={prob.memory_high:.4g}")
        if prob.memory_low is not None and hi < prob.memory_low * total * (1 - 1e-9):
            return (f"parameters take at most {hi / total:.4g} of their bytes per device, "
                    f"below low={prob.memory_low:.4g}")
    return None


def check_feasible(prob: Problem) -> None:
    """Raise PlanningError naming the smallest conflicting set of user constraints."""
    base = [np.isfinite(u) for u in prob.unary]
    user = [c for c in prob.constraints if c.kind != "memory"]
    has_memory = prob.memory_high is not None or prob.memory_low is not None
    why = _feasible_with(prob, base, user, has_memory)
    if why is None:
        prob.allowed = _propagated(prob)
        return
    # deletion filter: drop constraints that are not needed for the conflict
    needed = list(user)
    memory_needed = has_memory
    for con in list(user):
        trial = [c for c in needed if c is not con]
        if _feasible_with(prob, base, trial, memory_needed) is not None:
            needed = trial
    if memory_needed and _feasible_with(prob, base, needed, False) is not None:
        memory_needed = False
    parts = [c.description for c in needed]
    if memory_needed:
        parts.append(_memory_description(prob))
    if not parts:
        raise PlanningError(f"the planning problem is infeasible without any user constraint: {why}")
    joined = " and ".join(parts)
    raise PlanningError(f"{joined} cannot all hold: {_feasible_with(prob, base, needed, memory_needed) or why}")


def _memory_description(prob: Problem) -> str:
    return (f"parameter memory constraint (low={prob.memory_low}, high={prob.memory_high:.4g})"
            if prob.memory_high is not None else f"parameter memory constraint (low={prob.memory_low})")


def _propagated(prob: Problem) -> list[np.ndarray]:
    allowed = [a.copy() for a in prob.allowed]
    _propagate(prob, allowed)
    return allowed


# ---------------------------------------------------------------------------
# What to change when no plan fits in memory
# ---------------------------------------------------------------------------

_PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer states"),
          ("activations_bytes", "activations"), ("transient_bytes", "transient"))


def dominant_part(est: Any) -> tuple[str, int]:
    """(name, bytes) of the largest of a MemoryEstimate's five parts at its peak."""
    key, name = max(_PARTS, key=lambda kn: getattr(est, kn[0]))
    return name, getattr(est, key)


def memory_advice(est: Any, ac_mode: str = "none", reshard_after_forward: bool = True,
                  param_dtype: Any = None, optimizer: str = "foreach") -> str:
    """Which part of the peak dominates and the one setting (job TOML key and value, and the
    API's equivalent) that lowers that part, for MemoryLimitError's message."""
    name, nbytes = dominant_part(est)
    share = nbytes / est.peak_bytes if est.peak_bytes else 0.0
    head = f"the largest part is {name} ({format_bytes(nbytes)}, {share:.0%} of the peak, in the {est.phase})"
    if name == "activations":
        mode = "full" if ac_mode == "selective" else "selective"
        knob = (f"[activation_checkpoint] mode = \"{mode}\" in the job's TOML (API: RuntimeOptions(ac_mode="
                f"\"{mode}\")), or a smaller [training] local_batch_size / seq_len" if ac_mode not in ("full", "auto")
                else "a smaller [training] local_batch_size or seq_len in the job's TOML (activations are already "
                "checkpointed as far as they can be)")
    elif name == "transient" and est.phase == "optimizer" and optimizer != "fused":
        knob = ("[optimizer] implementation = \"fused\" in the job's TOML (API: PlannerConfig(optimizer="
                "\"fused\")): the fused AdamW updates in place, without the temporaries of the "
                f"{optimizer} one")
    elif name == "transient" and not reshard_after_forward:
        knob = ("[parallelism] reshard_after_forward = true in the job's TOML (API: RuntimeOptions("
                "reshard_after_forward=True)): gathered parameters are kept from the forward to the backward")
    elif name == "transient" and param_dtype is None:
        knob = ("[training] mixed_precision_param = \"bfloat16\" in the job's TOML (API: mp_policy="
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16)): gathered parameters and their buffers in half "
                "the bytes")
    else:  # model states (or transients) already as small as the settings make them: more devices
        knob = ("more ranks on the sharding axis: a larger [parallelism] data_parallel_shard_degree (or world "
                "size) in the job's TOML (API: a larger mesh); each rank then holds a smaller shard")
    return f"{head}: {knob}"


_AC_FIX = {"none": "use activation checkpointing ([activation_checkpoint] mode = \"auto\", \"selective\" or \"full\", "
                   "RuntimeOptions(ac_mode=...)), ",
           "selective": "use full activation checkpointing ([activation_checkpoint] mode = \"full\"), "}


def memory_fix(ac_mode: str) -> str:
    """What lowers the peak, given the activation checkpointing already in use ("auto" and
    "full" have recomputed all they can)."""
    return f"{_AC_FIX.get(ac_mode, '')}a smaller local batch or sequence, or more ranks"
