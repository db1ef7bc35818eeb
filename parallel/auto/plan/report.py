"""A Plan's reports, from its data alone (a loaded plan has them too): the breakdown, the
per-layer summary in words (`linear_roles`: what each projection does on each mesh axis),
and the diff of two plans."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from parallel.auto.candidates.placements import placement_words
from parallel.auto.regions import option_names
from parallel.auto.trace.joint import layer_prefix


def breakdown(plan: Any) -> str:
    lines = [f"objective {plan.objective_us:,.1f} µs = compute {plan.compute_us:,.1f} µs "
             f"+ comm {sum(plan.comm_us.values()):,.1f} µs"]
    for k in sorted(plan.comm_us):
        lines.append(f"  {k:<28} {plan.comm_us[k]:>12,.1f} µs  {plan.comm_bytes.get(k, 0) / 2**20:>10,.1f} MiB")
    return "\n".join(lines)

def recompute_line(plan: Any) -> str | None:
    """What the solve chose to recompute, block runs first ("full: blocks 0-11; op: blocks
    12-31"), the forward time the backward spends again and the activations kept; None when
    the job fixed its activation checkpointing."""
    rc = getattr(plan, "recompute", None) or {}
    blocks = rc.get("blocks")
    if not blocks:
        return None
    runs: list[list] = []
    for i, c in enumerate(blocks):
        if runs and runs[-1][0] == c:
            runs[-1][2] = i
        else:
            runs.append([c, i, i])
    where = "; ".join(f"{c}: block{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}" for c, a, b in runs)
    return (f"activation checkpointing chosen in the solve: {where} (none: keep all, op: per-op SAC, full: "
            f"recompute the block); the backward recomputes {rc.get('recompute_us', 0.0) / 1e3:,.1f} ms of forward, "
            f"the blocks keep {rc.get('activation_bytes', 0.0) / 2**30:,.2f} GiB of activations "
            f"({rc.get('saved_bytes', 0.0) / 2**30:,.2f} GiB less than keeping every block whole)")


def resharding_words(reshard: bool) -> str:
    """What a resharding setting does, in the words of logs and plan pages."""
    return ("the backward gathers the parameters again (FSDP's default)" if reshard
            else "the forward's gathered parameters are kept for the backward (ZeRO-2's shape)")


def resharding_line(plan: Any) -> str | None:
    """The planner's resharding choice (parallel/auto/resharding.py); None when the job fixed it."""
    reshard = getattr(plan, "reshard_after_forward", None)
    return None if reshard is None else f"resharding chosen by the planner: {resharding_words(reshard)}"


def summary(plan: Any) -> str:
    """Per-layer table: what each projection does on each mesh axis, in words."""
    rows = linear_roles(plan)
    by_module: dict[str, list[str]] = defaultdict(list)
    for fqn, words in rows:
        layer = layer_prefix(fqn.rpartition(".")[0], innermost=True) or ""
        short = fqn[len(layer) + 1:] if layer else fqn
        by_module[layer].append(f"{short.removesuffix('.weight')}: {words}")
    lines = [
        f"Plan for mesh {tuple(plan.mesh_shape)} {tuple(plan.mesh_axis_names)} on {plan.hardware} "
        f"({plan.solver}, {plan.status}, {plan.timings.get('solve', 0):.2f}s)",
        plan.breakdown(),
        f"parameter memory per device: {plan.memory_fraction:.4f} of all parameter bytes",
    ]
    if plan.memory is not None:
        lines.append(plan.memory.summary())
    lines.extend(line for line in (recompute_line(plan), resharding_line(plan), getattr(plan, "selection", "")) if line)
    collapsed = collapse_layers(by_module)
    for layer, items in collapsed:
        lines.append(f"{layer or '(top)'}:")
        lines.extend(f"  {it}" for it in items)
    return "\n".join(lines)


def diff(plan: Any, other: Any) -> PlanDiff:
    """Nodes whose placements differ between `plan` and `other`, and the objective change."""
    changed = []
    for name, a in plan.nodes.items():
        b = other.nodes.get(name)
        if b is None:
            continue
        if a.output_placements != b.output_placements or a.input_placements != b.input_placements:
            changed.append((name, a, b))
    return PlanDiff(plan.objective_us, other.objective_us, changed,
                    sorted(set(other.nodes) - set(plan.nodes)), sorted(set(plan.nodes) - set(other.nodes)))


@dataclass
class PlanDiff:
    """Nodes whose placements differ between two plans, and the objective change."""

    objective_a: float
    objective_b: float
    changed: list[tuple[str, Any, Any]]  # (name, NodePlan in a, in b)
    only_in_b: list[str]
    only_in_a: list[str]

    @property
    def objective_delta(self) -> float:
        return self.objective_b - self.objective_a

    def __len__(self) -> int:
        return len(self.changed)

    def __str__(self) -> str:
        lines = [f"{len(self.changed)} nodes changed; objective {self.objective_a:,.1f} -> {self.objective_b:,.1f} µs "
                 f"({self.objective_delta:+,.1f})"]
        for name, a, b in self.changed[:50]:
            lines.append(f"  {name} [{a.label or a.target}]: {', '.join(a.input_placements) or '-'} -> "
                         f"{', '.join(a.output_placements)}  =>  "
                         f"{', '.join(b.input_placements) or '-'} -> {', '.join(b.output_placements)}")
        if len(self.changed) > 50:
            lines.append(f"  ... {len(self.changed) - 50} more")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Words for what a projection does
# ---------------------------------------------------------------------------


def linear_roles(plan: Any) -> list[tuple[str, str]]:
    """(param FQN, words) for every parameter, from its forward use.

    A 2-D weight used through `t` by a forward mm: S(out) on an axis is column-parallel,
    S(in) row-parallel; used Replicate while stored sharded is FSDP (all-gather), stored
    Replicate with a sharded activation is data parallel (gradient all-reduce).
    """
    consumers: dict[str, list[Any]] = defaultdict(list)
    for n in plan.nodes.values():
        for i, src in enumerate(n.inputs):
            consumers[src].append(n)
    names = plan.mesh_axis_names
    out = []
    for fqn, n in plan.params().items():
        stored = placement_words(n.output_placements[0])
        region = _region_use(n, consumers)
        if region is not None:
            out.append((fqn, "; ".join(f"{w} on {name}" for w, name in zip(region, names))))
            continue
        use, act, weight_dims = _forward_use(n, consumers)
        words = []
        for ax, name in enumerate(names):
            st = stored[ax] if ax < len(stored) else "R"
            if use is None:
                words.append(f"{_store_words(st)} on {name}")
                continue
            u = use[ax]
            a = act[ax] if act is not None else "R"
            if u.startswith("S("):
                d = int(u[2:-1])
                role = weight_dims.get(d, f"sharded dim {d}")
                w = role
            elif st.startswith("S("):
                w = "FSDP (all-gather)" if a.startswith("S(") else "gathered, replicated compute"
            else:
                w = "data parallel (replicated, grad all-reduce)" if a.startswith("S(") else "replicated"
            words.append(f"{w} on {name}")
        out.append((fqn, "; ".join(words)))
    return out


def _region_use(param: Any, consumers: dict[str, list[Any]]) -> list[str] | None:
    """Per mesh axis "option of region r (stored ...)" when a local_map region consumes the
    parameter in the forward (directly or through a dtype cast), else None."""
    frontier = [param.name]
    while frontier:
        name = frontier.pop(0)
        for c in consumers.get(name, []):
            if c.phase != "fwd":
                continue
            if c.target == "aten._to_copy.default":
                frontier.append(c.name)
                continue
            opts = option_names(c.target, c.input_placements)
            if opts is None:
                return None
            stored = placement_words(param.output_placements[0])
            region = c.target.split(".")[1]
            return [f"{o} (region {region}, {_store_words(st)})" for o, st in zip(opts, stored)]
    return None


def _store_words(st: str) -> str:
    return "stored replicated" if st == "R" else f"stored {st}"


def _forward_use(param: Any,
                 consumers: dict[str, list[Any]]) -> tuple[list[str] | None, list[str] | None, dict[int, str]]:
    """Weight placement seen by its first forward matmul/embedding, the activation's, and dim roles."""
    frontier = [(param.name, False)]
    seen = set()
    while frontier:
        name, transposed = frontier.pop(0)
        if name in seen:
            continue
        seen.add(name)
        for c in consumers.get(name, []):
            if c.phase != "fwd":
                continue
            op = c.target
            k = c.inputs.index(name)
            if op in ("aten.t.default", "aten.transpose.int") and not transposed:
                frontier.append((c.name, True))
            elif op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default"):
                use = placement_words(c.input_placements[k])
                act = placement_words(c.input_placements[1 - k]) if len(c.input_placements) > 1 else None
                # Linear weight [out, in] used as t(W) = [in, out]
                # Linear weight [out, in] is used as t(W) = [in, out]; X @ W uses W = [in, out]
                return use, act, {1: "column-parallel", 0: "row-parallel"}
            elif op == "aten.embedding.default" and k == 0:
                use = placement_words(c.input_placements[0])
                act = placement_words(c.input_placements[1])
                return use, act, {0: "vocab-parallel", 1: "embedding-dim sharded"}
            elif op in ("aten._to_copy.default", "aten.view.default", "aten._unsafe_view.default",
                        "aten.detach.default"):
                frontier.append((c.name, transposed))
            elif c.kind == "op":
                use = placement_words(c.input_placements[k])
                others = [p for i, p in enumerate(c.input_placements) if i != k]
                act = placement_words(others[0]) if others else None
                return use, act, {}
    return None, None, {}


def collapse_layers(by_layer: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """Merge consecutive layers with identical descriptions ("layers.0-31")."""
    out: list[tuple[str, list[str]]] = []
    for layer, items in by_layer.items():
        m = re.match(r"(.*\.)(\d+)$", layer)
        if out and m:
            prev_name, prev_items = out[-1]
            pm = re.match(r"(.*\.)(\d+)(?:-(\d+))?$", prev_name)
            if (pm and pm.group(1) == m.group(1) and prev_items == items
                    and int(pm.group(3) or pm.group(2)) + 1 == int(m.group(2))):
                out[-1] = (f"{pm.group(1)}{pm.group(2)}-{m.group(2)}", prev_items)
                continue
        out.append((layer, items))
    return out
