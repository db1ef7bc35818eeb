"""A pipeline's step as a schedule picture: one lane per pp rank, a bar per microbatch's
forward and backward through the rank's stage, drawn where a simulation of the schedule puts
it (one stage per rank: GPipe runs every forward first, the 1F1B family warms up with
``pp - rank - 1`` forwards and then alternates). Each bar waits for the rank and for the
microbatch on the neighbouring stage (plus one point-to-point send), so the fill and drain
the step formula prices as a bubble shows as the lanes' empty stretches; the simulated step
is printed beside the formula's, so the two can disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from .svg import line, rect, svg, text

WIDTH, LEFT, RIGHT, LANE_H, GAP, TOP = 1000.0, 90.0, 20.0, 20.0, 6.0, 18.0
FILL = {"F": "#4c78a8", "B": "#f58518"}


@dataclass(frozen=True)
class Slot:
    """One microbatch's forward ("F") or backward ("B") on one pp rank, µs from the step's start."""

    rank: int
    kind: str
    microbatch: int
    start: float
    end: float


def rank_order(schedule: str, rank: int, pp: int, n: int) -> list[tuple[str, int]]:
    """The order a rank runs its microbatches' forwards and backwards in."""
    if schedule == "GPipe":
        return [("F", m) for m in range(n)] + [("B", m) for m in range(n)]
    warm = min(n, pp - rank - 1)
    order = [("F", m) for m in range(warm)]
    for i in range(n - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", m) for m in range(n - warm, n)]


def simulate(schedule: str, fwd_us: list[float], bwd_us: list[float], n: int, p2p_us: float) -> list[Slot]:
    """Every rank's slots of a one-stage-per-rank schedule: each starts when its rank is free
    and its inputs have arrived (the previous stage's forward, the next stage's backward, one
    send later)."""
    pp = len(fwd_us)
    orders = [rank_order(schedule, r, pp, n) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    free, nxt, slots = [0.0] * pp, [0] * pp, []
    while any(nxt[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if nxt[r] == len(orders[r]):
                continue
            kind, m = orders[r][nxt[r]]
            deps = ([("F", r - 1, m)] if kind == "F" and r > 0 else []) + (
                [("B", r + 1, m)] if kind == "B" and r < pp - 1 else []) + ([("F", r, m)] if kind == "B" else [])
            if any(d not in done for d in deps):
                continue
            ready = max([free[r]] + [done[d] + (p2p_us if d[1] != r else 0.0) for d in deps])
            end = ready + (fwd_us[r] if kind == "F" else bwd_us[r])
            done[(kind, r, m)], free[r] = end, end
            slots.append(Slot(r, kind, m, ready, end))
            nxt[r] += 1
            moved = True
        if not moved:
            raise ValueError(f"schedule {schedule}: the simulation is stuck (an order that waits on itself)")
    return slots


def schedule_svg(slots: list[Slot], pp: int, formula_us: float) -> str:
    """The lanes of a simulated schedule, with the formula's step as a dashed line."""
    end = max([s.end for s in slots] + [formula_us]) or 1.0
    scale = (WIDTH - LEFT - RIGHT) / end
    body = [text(LEFT, 12, f"simulated step {max(s.end for s in slots) / 1e3:,.2f} ms; dashed: the priced step "
                 f"{formula_us / 1e3:,.2f} ms (blue: forward, orange: backward; the number: the microbatch)")]
    for r in range(pp):
        y = TOP + r * (LANE_H + GAP)
        body.append(text(LEFT - 6, y + 14, f"pp rank {r}", anchor="end"))
        for s in (s for s in slots if s.rank == r):
            x, w = LEFT + s.start * scale, (s.end - s.start) * scale
            what = "forward" if s.kind == "F" else "backward"
            body.append(rect(x, y, w, LANE_H, FILL[s.kind], cls=f"slot-{s.kind}",
                             title=f"{what} of microbatch {s.microbatch} on pp rank {r}: "
                                   f"{s.start / 1e3:,.2f} - {s.end / 1e3:,.2f} ms",
                             data={"rank": r, "microbatch": s.microbatch, "start-us": s.start, "end-us": s.end}))
            if w > 14:
                body.append(text(x + w / 2, y + 14, s.microbatch, anchor="middle", fill="#fff"))
    h = TOP + pp * (LANE_H + GAP)
    body.append(line(LEFT + formula_us * scale, TOP - 4, LEFT + formula_us * scale, h, stroke="#222", dash="4 3"))
    return svg(WIDTH, h + 4, body, cls="pipeline-schedule", label="the pipeline's schedule, simulated",
               data={"simulated-us": max(s.end for s in slots), "priced-us": formula_us})


__all__ = ["Slot", "rank_order", "schedule_svg", "simulate"]
