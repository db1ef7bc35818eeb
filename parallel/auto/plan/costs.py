"""What needs the solved problem behind a plan (the in-memory plan of `optimize_placement`):
every candidate of a node priced with its neighbours fixed (`costs_for_node`, `explain`) and
the collectives one by one. A loaded plan has none of it (its data and reports are whole)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from parallel.auto.candidates.placements import placement_str
from parallel.auto.problem.placement_problem import Problem
from parallel.auto.problem.pricing import comm_dtype


@dataclass
class PlanCosts:
    """The solved problem and its labels (one strategy per group), kept with an in-memory plan."""

    problem: Problem
    labels: list[int]

    def collectives(self, plan: Any) -> list[dict]:
        """Every redistribution the plan implies."""
        prob = self.problem
        cm = prob.cost_model
        out = []
        for e in prob.edges:
            if e.kind == "recompute":
                continue
            a = e.src_cls[self.labels[e.src]]
            b = e.dst_cls[self.labels[e.dst]]
            src, dst = e.src_placements[a], e.dst_placements[b]
            if src == dst:
                continue
            meta = (e.tensor[0], comm_dtype(e.tensor[1], prob.mp_dtype))
            for producer, consumer, k in e.members:
                for c in cm.redistribute_collectives(src, dst, meta):
                    out.append({
                        "producer": producer, "consumer": consumer, "input": k,
                        "src": placement_str(src), "dst": placement_str(dst),
                        "kind": c.kind, "axis": c.axis_name, "bytes": c.bytes, "time_us": c.time_us,
                        "phase": plan.nodes[consumer].phase if consumer in plan.nodes else "",
                    })
        # redistributions inside tied groups (a producer and consumer tied together)
        return out

    def costs_for_node(self, plan: Any, name: str) -> list[dict]:
        """Every candidate of a node: compute and redistribution µs given the neighbours' choices."""
        prob = self.problem
        g = prob.group_of[name]
        cands = prob.candidates.nodes[name]
        comm = np.zeros(prob.n_strategies[g])
        for e in prob.edges:
            if e.src == g:
                b = e.dst_cls[self.labels[e.dst]]
                comm += e.cost[e.src_cls, b]
            elif e.dst == g:
                a = e.src_cls[self.labels[e.src]]
                comm += e.cost[a, e.dst_cls]
        rows = []
        pbytes = prob.param_bytes.get(g)
        for s, spec in enumerate(cands.specs):
            outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
            rows.append({
                "strategy": s,
                "param_bytes": float(pbytes[s]) if pbytes is not None else 0.0,
                "inputs": [placement_str(i.placements) for i in (spec.input_specs or [])],
                "outputs": [placement_str(o.placements) if o is not None else "-" for o in outs],
                "compute_us": float(prob.unary[g][s]),
                "comm_us": float(comm[s]),
                "total_us": float(prob.unary[g][s] + comm[s]),
                "allowed": bool(prob.allowed[g][s]),
                "chosen": s == self.labels[g],
            })
        return rows

    def explain(self, plan: Any, name: str, top: int = 5) -> str:
        """Why this strategy: its cost vs the best alternatives, all else fixed."""
        prob = self.problem
        g = prob.group_of[name]
        rows = self.costs_for_node(plan, name)
        chosen = next(r for r in rows if r["chosen"])
        others = sorted((r for r in rows if not r["chosen"]), key=lambda r: r["total_us"])
        n = plan.nodes[name]
        copies = len(prob.groups[g])
        lines = [
            f"{name} ({n.label or n.target}, {n.phase}, module {n.module or '-'}): "
            f"{' , '.join(chosen['inputs']) or '-'} -> {', '.join(chosen['outputs'])}",
            f"  chosen: compute {chosen['compute_us']:.1f} µs + redistribution {chosen['comm_us']:.1f} µs "
            f"= {chosen['total_us']:.1f} µs (decided jointly for {copies} tied node(s))",
        ]
        for r in others[:top]:
            why = "forbidden by a constraint" if not r["allowed"] else (
                "not allowed (needs a Replicate->Partial redistribution)" if not math.isfinite(r["total_us"])
                else f"+{r['total_us'] - chosen['total_us']:.1f} µs")
            if r["param_bytes"] > chosen["param_bytes"] and r["total_us"] < chosen["total_us"]:
                why += f", but {r['param_bytes'] / 2**20:,.1f} MiB of parameters per device: over the memory budget"
            lines.append(
                f"  alt {r['strategy']}: {', '.join(r['inputs']) or '-'} -> {', '.join(r['outputs'])}: "
                f"compute {r['compute_us']:.1f} + comm {r['comm_us']:.1f} = {r['total_us']:.1f} µs ({why})"
            )
        if len(others) > top:
            lines.append(f"  ... {len(others) - top} more")
        return "\n".join(lines)
