"""Communication/computation overlap on a per-device graph: where collectives start and wait.

Functional collectives run asynchronously: a collective node starts the communication and
its `wait_tensor` blocks until the result is there. The plan's runner issues every
collective right before its first use, so nothing overlaps. This pass moves, in the FX
graph itself (eager and compiled runs alike):

  * every wait to just before the first op that reads its result;
  * except gradient reductions (read only by the step's output, or by the next stage of a
    reduction over several axes): each waits right after the next reduction has started,
    so one bucket (one block) reduces while the next block's backward runs, FSDP's one
    reduce-scatter in flight. Waiting at the very end of the step instead would keep every
    unreduced gradient bucket alive until then (the work holds its input until the wait
    returns): the whole full-size gradient at the backward's end, measured by the CPU
    allocator (scripts/bench_foreign_memory.py);
  * every collective start as early as its inputs allow, together with the cheap layout
    ops (views, casts, concatenations) that build its buffer;
  * except parameter gathers (collectives fed by graph inputs only): those start when the
    previous gather's result is first used, i.e. one bucket (one block) ahead, FSDP's
    prefetch, so gathered parameters do not all live at once;
  * on gloo (`one_gather_per_group`), an all-gather waits for the previous all-gather of its
    process group before it starts. torch 2.13's functional all-gathers corrupt the heap
    on gloo when several are in flight on one group ("malloc(): unaligned tcache chunk
    detected"): 4 ranks issuing 6 of them a step and waiting in any order aborted 3 runs
    in 3 (2,000 steps each), waited one at a time 0 in 3; reduce-scatters and all-reduces
    in flight together did not (0 in 2 each). A 2 x 2 auto run aborted that way.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

from torch import fx

from parallel import _torch as T

log = logging.getLogger("parallel.auto.runtime")

COLLECTIVE_NAMESPACE = "_c10d_functional"
_CHEAP = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "clone", "_to_copy", "cat", "slice",
          "split", "split_with_sizes", "unsqueeze", "squeeze", "expand", "contiguous", "alias", "detach",
          "movedim", "select", "narrow", "flatten", "unflatten"}


def _is_collective(n: fx.Node) -> bool:
    return (n.op == "call_function" and getattr(n.target, "namespace", "") == COLLECTIVE_NAMESPACE
            and T.op_name(n.target) != "wait_tensor")


def _is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", "") == COLLECTIVE_NAMESPACE \
        and T.op_name(n.target) == "wait_tensor"


def _is_cheap(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target is operator.getitem or T.op_name(n.target) in _CHEAP)


@dataclass
class OverlapReport:
    """What the pass did (for logs and tests)."""

    collectives: int = 0
    starts_moved: int = 0
    waits_moved: int = 0
    prefetched_gathers: int = 0
    reductions_bounded: int = 0  # gradient reductions waited for when the next one starts
    gathers_serialised: int = 0  # all-gathers waited for before the next one on their group starts (gloo)

    def __str__(self) -> str:
        serial = (f"; {self.gathers_serialised} all-gathers waited for before the next on their group"
                  if self.gathers_serialised else "")
        return (f"overlap: {self.collectives} collectives, {self.starts_moved} started earlier "
                f"({self.prefetched_gathers} parameter gathers one bucket ahead), {self.waits_moved} waits deferred "
                f"to first use ({self.reductions_bounded} gradient reductions waited for when the next starts{serial})")


def _after(n: fx.Node, k: int) -> fx.Node:
    """The node `k` places after `n` (FX nodes compare by graph order: `a < b` is O(1) and
    stays right as nodes move, so no pass renumbers the graph, which was quadratic)."""
    for _ in range(k):
        n = n.next
    return n


def _buffer_chain(c: fx.Node) -> list[fx.Node]:
    """`c` and the cheap ops that only build its buffer (moved along with it), in graph order."""
    chain, stack = {c}, list(c.all_input_nodes)
    while stack:
        a = stack.pop()
        if a in chain or not _is_cheap(a) or any(u not in chain for u in a.users):
            continue  # expensive, or shared with other consumers: it stays where it is
        chain.add(a)
        stack.extend(a.all_input_nodes)
    return sorted(chain)


def _result_chain(w: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """The cheap ops unpacking a wait's result (moved along with it), and the first other
    node that reads any of them (where the result is really needed)."""
    chain, stack = [w], list(w.users)
    seen = {w}
    while stack:
        u = stack.pop()
        if u in seen or not _is_cheap(u):
            continue
        seen.add(u)
        chain.append(u)
        stack.extend(u.users)
    readers = [u for n in chain for u in n.users if u not in seen]
    return sorted(chain), min(readers, default=None)


def _move_up(chain: list[fx.Node], anchor: fx.Node) -> bool:
    """Place the chain's nodes that come after `anchor` right after it (in order), when the
    collective (the chain's last node) then starts earlier than it does now."""
    later = [n for n in chain if n > anchor]
    if not later or chain[-1] <= _after(anchor, len(later)):
        return False
    at = anchor
    for n in later:
        at.append(n)
        at = n
    return True


def _anchor(chain: list[fx.Node], floor: fx.Node | None) -> fx.Node:
    """The last node the chain must follow: its latest outside input, or `floor`."""
    members = set(chain)
    cands = [a for n in chain for a in n.all_input_nodes if a not in members]
    cands += [floor] if floor is not None else []
    anchor = max(cands) if cands else next(iter(chain[0].graph.nodes))
    while anchor.next.op == "placeholder":  # placeholders stay together at the top
        anchor = anchor.next
    return anchor


def _defer_waits(graph: fx.Graph, report: OverlapReport) -> None:
    for w in [n for n in graph.nodes if _is_wait(n)]:
        chain, reader = _result_chain(w)
        if reader is not None and reader > chain[-1].next:
            for n in chain:
                reader.prepend(n)
            report.waits_moved += 1


def _reductions(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Gradient reductions, collective -> its wait: collectives whose result only the step's
    output reads, directly or through further reductions (a gradient reduced over two mesh
    axes is one collective per axis, the second reading the first's result)."""
    out = graph.output_node()
    found: dict[fx.Node, fx.Node] = {}
    for c in reversed([n for n in graph.nodes if _is_collective(n)]):
        waits = [u for u in c.users if _is_wait(u)]
        if len(waits) != 1:
            continue
        readers = _readers(waits[0])
        if readers and all(r is out or r in found for r in readers):
            found[c] = waits[0]
    return found


def _readers(w: fx.Node) -> set[fx.Node]:
    """The nodes reading a wait's result, past the cheap ops that unpack it."""
    chain, _ = _result_chain(w)
    members = set(chain)
    return {u for n in chain for u in n.users if u not in members}


def _bound_reductions(graph: fx.Graph, report: OverlapReport, in_flight: int = 1) -> None:
    """Gradient reductions wait for their result right after the `in_flight`-th next
    reduction has started, instead of at the end of the step: at most `in_flight` + 1
    reduction buffers are alive at once.

    A reduction over several axes is a chain of collectives, stage 0 reading the gradient.
    Chains are ordered by their stage 0; stage s of chain k starts once stage s-1 is waited
    for and is waited for after stage 0 of chain k + `in_flight` + s has started. Bounding
    stage 0 alone left the next stage, and so the first stage's buffer (a full-size fp32
    gradient), waiting to the end of the step: 77 GiB of DeepSeek-V3 671B's predicted
    116 GiB peak on a 32 x 8 mesh."""
    found = _reductions(graph)
    preds: dict[fx.Node, list[fx.Node]] = {c: [] for c in found}
    for c, w in found.items():
        for r in _readers(w):
            if r in preds:
                preds[r].append(c)
    firsts = sorted(c for c in found if not preds[c])
    index = {c: i for i, c in enumerate(firsts)}
    level = dict.fromkeys(firsts, 0)
    for c in sorted(found):  # a stage's predecessors come before it in the graph
        if preds[c]:
            level[c] = 1 + max(level[p] for p in preds[c])
            index[c] = max(index[p] for p in preds[c])
    for c in sorted(found, key=lambda c: (level[c], index[c])):  # stage by stage: each after its predecessor's wait
        if level[c] > 0:
            chain = _buffer_chain(c)
            if _move_up(chain, _anchor(chain, None)):
                report.starts_moved += 1
        j = index[c] + in_flight + level[c]
        while j < len(firsts) and not firsts[j] > c:
            j += 1
        w = found[c]
        if j < len(firsts) and w > firsts[j].next:
            firsts[j].append(w)
            report.reductions_bounded += 1


def _group_of(c: fx.Node) -> object:
    """The process group a functional collective runs on (its `group_name` argument)."""
    return c.kwargs.get("group_name", c.args[-1] if c.args else None)


def _one_gather_per_group(graph: fx.Graph, report: OverlapReport) -> None:
    """Each all-gather's wait moved, when needed, to just before the next all-gather of its
    process group starts: at most one all-gather in flight per group (the gloo fault in the
    module doc). Moving a wait earlier keeps the graph valid: it reads only its collective,
    which started before."""
    in_flight: dict[object, fx.Node] = {}  # group -> the wait of its all-gather in flight
    for n in list(graph.nodes):
        if _is_wait(n):
            c = n.args[0]
            if isinstance(c, fx.Node) and in_flight.get(_group_of(c)) is n:
                del in_flight[_group_of(c)]
        elif _is_collective(n) and T.op_name(n.target) == "all_gather_into_tensor":
            group = _group_of(n)
            w = in_flight.pop(group, None)
            if w is not None and w > n:
                n.prepend(w)
                report.gathers_serialised += 1
            wait = next((u for u in n.users if _is_wait(u)), None)
            if wait is not None:
                in_flight[group] = wait


def _input_derived(graph: fx.Graph) -> set[fx.Node]:
    """Graph inputs and what cheap ops make of them alone (parameter shards, their casts)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or (_is_cheap(n) and n.all_input_nodes and all(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out


def schedule_overlap(gm: fx.GraphModule, recompile: bool = True, one_gather_per_group: bool = False) -> OverlapReport:
    """Reorder `gm` in place for overlap (see the module docstring); returns what moved.
    `recompile=False`: only the graph is reordered (for analyses that walk it, not run it;
    regenerating a 32-layer step graph's Python code takes about a second).
    `one_gather_per_group`: at most one all-gather in flight per process group (gloo)."""
    graph = gm.graph
    report = OverlapReport()
    _defer_waits(graph, report)
    derived = _input_derived(graph)
    gathers, others = [], []
    for c in [n for n in graph.nodes if _is_collective(n)]:
        chain = _buffer_chain(c)
        ext = [a for n in chain for a in n.all_input_nodes if a not in chain]
        (gathers if ext and all(a in derived for a in ext) else others).append((c, chain))
    report.collectives = len(gathers) + len(others)
    prev_wait: fx.Node | None = None  # parameter gathers: prefetch depth one, in order of use
    for c, chain in gathers:
        if _move_up(chain, _anchor(chain, prev_wait)):
            report.starts_moved += 1
            report.prefetched_gathers += 1
        prev_wait = next((u for u in c.users if _is_wait(u)), c)
    for c, chain in others:
        if _move_up(chain, _anchor(chain, None)):
            report.starts_moved += 1
    _bound_reductions(graph, report)
    if one_gather_per_group:
        _one_gather_per_group(graph, report)
    graph.lint()
    if recompile:
        T.generate_code(gm)
    log.info("%s", report)
    return report


def count_collectives(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if _is_collective(n))


__all__ = ["OverlapReport", "count_collectives", "schedule_overlap"]
