"""Identical layers traced once: the joint graph of a long stack of blocks, from a trace of two.

AOTAutograd's joint trace costs about a quarter of a second per LLaMA 3 8B layer on a
2-core machine (8 s for 32 layers, 20 s for 80), and every layer after the second adds
the same nodes again. A model that names its list of blocks (`repeated_blocks = "layers"`,
models/layers.py) is traced with its last run of identical blocks cut to two; the graph
then gets the rest as copies of the second one, forward and backward, with their own
parameter placeholders, gradient outputs and descriptors, so that what comes out is the
graph a full trace gives (tests/parallel/auto/test_repeated_blocks_trace.py compares them node by
node).

How a copy is wired is read from the two traced blocks, not assumed: the second block
(the template) and the first (its predecessor) must hold the same ops in the same order
with the same literals, and for every input of a template op the predecessor's op says
what it is. An input from the predecessor is the previous layer's value; one the
predecessor's op reads unchanged is shared (rotary tables, masks); one where the
predecessor's op reads the template instead is the next layer's (the gradient flowing
back). Anything else - a literal that differs between the two blocks (a forward that
depends on its index), a value read across layers, an output nobody can name - refuses
the copy (`CopyRefused`), and the model is traced in full.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from parallel import _torch as T

log = logging.getLogger(__name__)

_OWN, _PARAM, _PREV, _SHARED, _NEXT = "own", "param", "prev", "shared", "next"


class CopyRefused(Exception):
    """The traced blocks are not a pattern the copy can repeat; the caller traces in full."""


@dataclass(frozen=True)
class BlockRun:
    """The blocks a trace keeps: the model's `container` list holds `total` blocks, of
    which the first `kept` are traced; the last two kept are identical to every later one."""

    container: str
    total: int
    kept: int

    def name(self, index: int) -> str:
        return f"{self.container}.{index}"

    @property
    def template(self) -> str:
        return self.name(self.kept - 1)

    @property
    def predecessor(self) -> str:
        return self.name(self.kept - 2)


def _block_signature(block: nn.Module) -> tuple:
    tensors = list(block.named_parameters()) + list(block.named_buffers())
    return type(block), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors)


def block_run(model: nn.Module) -> BlockRun | None:
    """The run of identical blocks at the end of the model's `repeated_blocks` list, if
    copying saves a trace of at least one block (None otherwise, or when the model does
    not name its blocks)."""
    name = getattr(model, "repeated_blocks", None)
    blocks = getattr(model, name, None) if isinstance(name, str) else None
    if not isinstance(blocks, nn.ModuleList) or len(blocks) < 3:
        return None
    sigs = [_block_signature(b) for b in blocks]
    start = len(sigs) - 1
    while start > 0 and sigs[start - 1] == sigs[-1]:
        start -= 1
    kept = start + 2
    return BlockRun(name, len(sigs), kept) if kept < len(sigs) else None


def truncate(model: nn.Module, run: BlockRun) -> None:
    """Drop the blocks the trace does not need (on the planner's own copy of the model)."""
    del getattr(model, run.container)[run.kept:]


def _renamed(desc: Any, old: str, new: str) -> Any:
    """An AOT descriptor with every target under `old` moved to `new` (nested descriptors too)."""
    if not dataclasses.is_dataclass(desc) or isinstance(desc, type):
        return desc
    changes = {}
    for f in dataclasses.fields(desc):
        v = getattr(desc, f.name)
        if isinstance(v, str) and (v == old or v.startswith(old + ".")):
            changes[f.name] = new + v[len(old):]
        elif dataclasses.is_dataclass(v):
            r = _renamed(v, old, new)
            if r is not v:
                changes[f.name] = r
    return dataclasses.replace(desc, **changes) if changes else desc


def _mentions(desc: Any, prefix: str) -> bool:
    return _renamed(desc, prefix, prefix + "#") is not desc


def _flat_args(n: fx.Node) -> tuple[list[Any], list[Any]]:
    """(input nodes in order, the literals) of a node's args and kwargs."""
    nodes: list[Any] = []
    fx.node.map_arg((n.args, n.kwargs), nodes.append)
    literals = fx.node.map_arg((n.args, n.kwargs), lambda _: None)
    return nodes, [literals]


class _Blocks:
    """The traced graph split around the two kept blocks of the run."""

    def __init__(self, gm: fx.GraphModule, module_of: dict[str, str], run: BlockRun, prefix: str):
        self.graph = gm.graph
        self.nodes = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}

        def chunk(layer: str, backward: bool) -> list[fx.Node]:
            return [n for n in self.nodes if n.op == "call_function" and _in(module_of.get(n.name, ""), layer)
                    and (n.meta.get("partitioner_tag") == "is_backward") == backward]

        self.fwd, self.bwd = chunk(run.template, False), chunk(run.template, True)
        prev_fwd, prev_bwd = chunk(run.predecessor, False), chunk(run.predecessor, True)
        for mine, theirs in ((self.fwd, prev_fwd), (self.bwd, prev_bwd)):
            if not mine or len(mine) != len(theirs):
                raise CopyRefused(f"{run.template} and {run.predecessor} traced to {len(mine)} / {len(theirs)} ops")
            for part in (mine, theirs):
                if self.pos[part[-1]] - self.pos[part[0]] + 1 != len(part):
                    raise CopyRefused("a block's ops are not contiguous in the graph")
        self.template = self.fwd + self.bwd
        self.counterpart = dict(zip(self.template, prev_fwd + prev_bwd))
        self.of_counterpart = {p: t for t, p in self.counterpart.items()}
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"
                             and _mentions(n.meta.get("desc"), prefix + run.template)]
        if not self.placeholders:
            raise CopyRefused(f"no parameter of {run.template} found among the graph's inputs")

    def rules(self) -> dict[fx.Node, dict[fx.Node, tuple[str, Any]]]:
        """For every template op, what each of its input nodes is to a copy."""
        tset, pset, phs = set(self.template), set(self.counterpart.values()), set(self.placeholders)
        out: dict[fx.Node, dict[fx.Node, tuple[str, Any]]] = {}
        for y in self.template:
            c = self.counterpart[y]
            if y.target != c.target:
                raise CopyRefused(f"{y.name} ({y.target}) and its predecessor's {c.name} ({c.target}) differ")
            mine, my_literals = _flat_args(y)
            theirs, their_literals = _flat_args(c)
            if len(mine) != len(theirs) or my_literals != their_literals:
                raise CopyRefused(f"{y.name} ({y.target}) differs from the predecessor's in its arguments")
            rules: dict[fx.Node, tuple[str, Any]] = {}
            for a, b in zip(mine, theirs):
                if a in tset:
                    rule = (_OWN, a) if b is self.counterpart[a] else None
                elif a in phs:
                    rule = (_PARAM, a)
                elif a in pset:
                    rule = (_PREV, self.of_counterpart[a]) if b not in tset else None
                elif b is a:
                    rule = (_SHARED, a)
                elif b in tset:
                    rule = (_NEXT, b)
                else:
                    rule = None
                if rule is None or rules.setdefault(a, rule) != rule:
                    raise CopyRefused(f"input {a.name} of {y.name} ({y.target}) is not a pattern the copy repeats")
            out[y] = rules
        return out


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


RUN = object()
"""`mirrored_value`'s answer for a value it cannot mirror: the copy runs the op on fake tensors."""


def _tensors(v: Any) -> list[Any]:
    return [x for x in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(x, torch.Tensor)]


def mirrored_value(y: fx.Node, new: fx.Node, storages: dict[int, torch.Tensor]) -> Any:
    """The value of `new`, the copy of `y`, made like `y`'s without running the op: fresh fake
    tensors of its shapes on storages that mirror `y`'s (a view of an input stays a view of the
    copy's input; `storages` maps the template's storages to the copy's, per layer). Running the
    op through FakeTensorMode was most of a copy's time. `RUN` for a value with anything but
    fake tensors and literals in it."""
    val = y.meta.get("val")
    leaves = val if isinstance(val, (tuple, list)) else (val,)
    if not all((isinstance(x, torch.Tensor) and T.is_fake(x) and not x.requires_grad)
               or x is None or isinstance(x, (bool, int, float)) for x in leaves):
        return RUN
    reads: tuple[list[fx.Node], list[fx.Node]] = ([], [])
    fx.node.map_arg((y.args, y.kwargs), reads[0].append)
    fx.node.map_arg((new.args, new.kwargs), reads[1].append)
    for a, b in zip(*reads):  # argument by argument: the template's input storages are the copy's inputs'
        for ta, tb in zip(_tensors(a.meta.get("val")), _tensors(b.meta.get("val"))):
            storages.setdefault(T.storage_id(ta), tb)
    out = []
    with T.no_modes():
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = T.storage_id(x)
                base = storages.get(key)
                if base is None:
                    base = storages[key] = T.meta_storage(x.untyped_storage().nbytes())
                x = T.fake_view(x.fake_mode, base, x)
            out.append(x)
    return type(val)(out) if isinstance(val, (tuple, list)) else out[0]


def copy_repeated_blocks(gm: fx.GraphModule, module_of: dict[str, str], run: BlockRun, fake_mode: Any,
                         prefix: str = "model.") -> int:
    """Add blocks `run.kept` .. `run.total - 1` to a graph traced with the first `run.kept`:
    copies of the last kept block, wired as the traced pair shows. `module_of` gains the
    copies' modules. Returns the nodes added; raises `CopyRefused` when the traced blocks
    are not a pattern it can repeat (the graph may be half-copied then: trace in full)."""
    blocks = _Blocks(gm, module_of, run, prefix)
    rules = blocks.rules()
    later_users = _readers_after_the_blocks(blocks, run, prefix)
    version = _copied_placeholders(blocks, run, prefix, fake_mode)
    added = _copy_block_nodes(blocks, rules, version, run, module_of, fake_mode)
    _rewire(blocks, rules, version, later_users, run, prefix)
    gm.recompile()
    return added


def _readers_after_the_blocks(blocks: _Blocks, run: BlockRun, prefix: str) -> list[tuple[fx.Node, fx.Node]]:
    """(user, template node it reads) for the users between the blocks' forward and backward;
    `CopyRefused` where the traced pattern cannot be repeated."""
    graph, tset = blocks.graph, set(blocks.template)
    lo, hi = blocks.pos[blocks.fwd[-1]], blocks.pos[blocks.bwd[0]]
    later_users: list[tuple[fx.Node, fx.Node]] = []
    for x in blocks.template:
        for u in x.users:
            if u in tset or u in blocks.of_counterpart or u.op == "output":
                continue
            if not lo < blocks.pos[u] < hi:
                raise CopyRefused(f"{u.name} ({u.target}) reads {x.name} of {run.template} from outside the run")
            later_users.append((u, x))
    for u in graph.nodes:
        if lo < blocks.pos[u] < hi and any(a in blocks.of_counterpart for a in u.all_input_nodes):
            raise CopyRefused(f"{u.name} ({u.target}) reads {run.predecessor} past the template")
    out_node = graph.output_node()
    outs, descs = list(out_node.args[0]), list(out_node.meta.get("desc") or [])
    if len(descs) != len(outs):
        raise CopyRefused("the graph's outputs carry no descriptors")
    for v, d in zip(outs, descs):
        if v in tset and not _mentions(d, prefix + run.template):
            raise CopyRefused(f"output {d} reads {run.template} but is not one of its gradients or buffers")
    return later_users


def _copied_placeholders(blocks: _Blocks, run: BlockRun, prefix: str,
                         fake_mode: Any) -> dict[int, dict[fx.Node, fx.Node]]:
    """Per block index, template node -> its copy: the traced block maps to itself, and each
    copied block gets its own parameter placeholders (fake values of the template's shape)."""
    graph = blocks.graph
    version: dict[int, dict[fx.Node, fx.Node]] = {run.kept - 1: {n: n for n in blocks.template}}
    for ph in blocks.placeholders:
        version[run.kept - 1][ph] = ph
    counter = sum(1 for n in blocks.nodes if n.op == "placeholder")
    cursor = blocks.placeholders[-1]
    for m in range(run.kept, run.total):
        version[m] = {}
        for ph in blocks.placeholders:
            counter += 1
            with graph.inserting_after(cursor):
                new = graph.placeholder(f"primals_{counter}")
            new.meta = dict(ph.meta)
            new.meta["desc"] = _renamed(ph.meta["desc"], prefix + run.template, prefix + run.name(m))
            v = ph.meta["val"]
            with fake_mode:
                new.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device,
                                                      requires_grad=v.requires_grad)
            version[m][ph] = cursor = new
    return version


def _copy_block_nodes(blocks: _Blocks, rules: dict, version: dict[int, dict[fx.Node, fx.Node]], run: BlockRun,
                      module_of: dict[str, str], fake_mode: Any) -> int:
    """Copy the template's forward after it and its backward before it, once per added block;
    each copy's inputs resolved by `rules` (its own, the previous or next block's, shared)."""
    graph, layers = blocks.graph, range(run.kept, run.total)

    def resolve(m: int, y: fx.Node, a: fx.Node) -> fx.Node:
        kind, ref = rules[y][a]
        if kind in (_OWN, _PARAM):
            return version[m][ref]
        if kind == _PREV:
            return version[m - 1][ref]
        if kind == _SHARED:
            return a
        return a if m == run.total - 1 else version[m + 1][ref]  # _NEXT: the next layer's, past the last: as traced

    storages: dict[int, dict[int, torch.Tensor]] = {}  # per layer: template storage -> the copy's

    def copy(m: int, y: fx.Node) -> None:
        new = graph.node_copy(y, lambda a: resolve(m, y, a))
        new.meta = dict(y.meta)
        mirrored = mirrored_value(y, new, storages.setdefault(m, {}))
        if mirrored is RUN:
            args, kwargs = fx.node.map_arg((new.args, new.kwargs), lambda n: n.meta.get("val"))
            with fake_mode:
                mirrored = new.target(*args, **kwargs)
        new.meta["val"] = mirrored
        module_of[new.name] = run.name(m) + module_of[y.name][len(run.template):]
        version[m][y] = new

    try:
        cursor = blocks.fwd[-1]
        for m in layers:
            for y in blocks.fwd:
                with graph.inserting_after(cursor):
                    copy(m, y)
                cursor = version[m][y]
        with graph.inserting_before(blocks.bwd[0]):
            for m in reversed(layers):
                for y in blocks.bwd:
                    copy(m, y)
    except (KeyError, RuntimeError, NotImplementedError, TypeError) as e:
        raise CopyRefused(f"copying {run.template}: {type(e).__name__}: {e}") from e
    return len(layers) * (len(blocks.fwd) + len(blocks.bwd))


def _rewire(blocks: _Blocks, rules: dict, version: dict[int, dict[fx.Node, fx.Node]],
            later_users: list[tuple[fx.Node, fx.Node]], run: BlockRun, prefix: str) -> None:
    """The traced block now reads the first copy where it read the next block; what read the
    last traced block reads the last copy; the graph returns every copy's gradients."""
    graph = blocks.graph
    second = version[run.kept]
    for y, rs in rules.items():
        for a, (kind, ref) in rs.items():
            if kind == _NEXT:
                y.replace_input_with(a, second[ref])
    last = version[run.total - 1]
    for u, x in later_users:
        u.replace_input_with(x, last[x])
    out_node = graph.output_node()
    outs, descs = list(out_node.args[0]), list(out_node.meta.get("desc") or [])
    new_outs, new_descs = _outputs_with_copies(outs, descs, version, range(run.kept, run.total), prefix, run)
    out_node.args = (type(out_node.args[0])(new_outs),)
    out_node.meta["desc"] = new_descs
    if "val" in out_node.meta:
        out_node.meta["val"] = [n.meta.get("val") if isinstance(n, fx.Node) else n for n in new_outs]
    graph.lint()


def _outputs_with_copies(outs: list[Any], descs: list[Any], version: dict[int, dict[fx.Node, fx.Node]],
                         layers: range, prefix: str, run: BlockRun) -> tuple[list[Any], list[Any]]:
    """The output tuple with each run of the template's entries (its gradients, its
    buffers' new values) followed by the same entries of every copy, in layer order."""
    tmpl = prefix + run.template
    new_outs: list[Any] = []
    new_descs: list[Any] = []
    i = 0
    while i < len(outs):
        if not _mentions(descs[i], tmpl):
            new_outs.append(outs[i])
            new_descs.append(descs[i])
            i += 1
            continue
        j = i
        while j < len(outs) and _mentions(descs[j], tmpl):
            j += 1
        new_outs += outs[i:j]
        new_descs += descs[i:j]
        for m in layers:
            for v, d in zip(outs[i:j], descs[i:j]):
                if isinstance(v, fx.Node) and v not in version[m]:
                    raise CopyRefused(f"output {d} is not made inside {run.template}")
                new_outs.append(version[m][v] if isinstance(v, fx.Node) else v)
                new_descs.append(_renamed(d, tmpl, prefix + run.name(m)))
        i = j
    return new_outs, new_descs
