"""Stage 5: Plan -> ParallelModule (paper §5.1, plan materialisation).

    with AutoParallel(model, input_fn, mesh, loss_fn=lm_loss) as autop:
        plan = autop.optimize_placement()
        pmodel = autop.apply_placement(plan)        # -> apply_plan(...)
    pmodel.to_empty(device="cpu"); torch.manual_seed(0); pmodel.init_weights()
    loss = pmodel(local_tokens, local_labels)      # per-rank LOCAL inputs
    loss.backward()                                 # grads: DTensors with the planned placements

The returned module is an instance of a subclass of the user's model class (isinstance
holds, `named_parameters()` gives the same names); its parameters are
`nn.Parameter(DTensor)` with the planned placements. Its forward runs the joint graph's
forward part and autograd runs the backward part (a `torch.autograd.Function`):

  * an interpreter walks the nodes of one phase; for every op it redistributes each
    input to the placement the chosen strategy expects (all-gather, reduce-scatter,
    all-reduce, all-to-all, local chunking - DTensor's `redistribute`), then runs the op
    on those DTensors, so the per-device op sees local shards and DTensor adjusts view
    and factory shapes to per-device sizes; the op's output placement is checked
    against the plan (a disagreement is redistributed to the planned placement and
    counted in `runner.stats["deviations"]`);
  * forward values the backward needs are kept (only those) between the two phases;
  * gradients are reduced to the parameter's own placement (plan: tied), in the
    reduce dtype of the mixed-precision policy;
  * collective bucketing: parameters that ops use replicated are gathered once per
    step with one flat all-gather per placement group (kept for the backward), and
    gradient reductions are one flat reduce-scatter / all-reduce per group (layout ops
    between a weight-gradient matmul and its output run on the Partial value);
  * on the first call the interpreter is traced (`make_fx`, fake tensors) into two
    per-device FX graphs (LocalGraphs): plain ATen ops on local shards with explicit
    functional collectives, which later calls run without DTensor dispatch (eager
    interpretation stays as the fallback, `PlanRunner(local_graphs=False)`).

Mixed precision (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`): parameters
stay fp32 DTensors (optimizer state fp32); each is cast to bf16 on its own shard before
any gather, an op whose floating inputs mix bf16 and fp32 computes in bf16 (ops fed
one dtype run as traced, so the loss stays fp32), and gradients are cast to fp32 before
their reduction collective.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections import Counter
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from torch.distributed.tensor import Partial, Replicate, Shard
from parallel import _torch as T
from parallel._torch import tree_flatten, tree_unflatten
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.placements import placement_str, spec_placement_strs
from parallel.auto.strategies import PLACEHOLDER, Candidates
from parallel.auto.trace import BWD, FWD, JointGraph

log = logging.getLogger(__name__)

__all__ = ["apply_plan", "PlanRunner", "ParallelModuleMixin", "InputShapeError", "is_parallel_module"]


class InputShapeError(ValueError):
    """A per-rank input does not have the local shape the plan expects."""


_VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_CAST_OPS = (torch.ops.aten._to_copy.default,)
_LAYOUT_OPS = (torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.view.default,
               torch.ops.aten._unsafe_view.default, torch.ops.aten._to_copy.default, torch.ops.aten.detach.default,
               torch.ops.aten.clone.default)
# inputs that keep their dtype under mixed precision (flattened argument positions):
# the CPU flash-attention backward takes an fp32 logsumexp with bf16 q/k/v
_KEEP_DTYPE = {T.CPU_ATTENTION_BWD: (5,)}


def _is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def redistribute(x: DTensor, mesh: Any, target: tuple) -> DTensor:
    """`x` with placements `target`, including Partial targets.

    DTensor's public `redistribute` refuses X -> Partial; plans use it (e.g. a Replicate
    value entering an op that expects Partial, P(sum) -> P(avg)). Partial targets are
    reached with local math only: P(sum) <-> P(avg) rescale by the axis size, a
    Replicate value is partitioned (`Partial._partition_value`), anything else is first
    made Replicate on that axis (all-reduce / all-gather).
    """
    cur = tuple(x.placements)
    if cur == target:
        return x
    if not any(isinstance(p, Partial) for p in target):
        return x.redistribute(mesh, target)
    inter = list(target)
    scale = 1.0
    relabel = list(cur)
    for ax, (c, t) in enumerate(zip(cur, target)):
        if not isinstance(t, Partial):
            continue
        if c == t:
            continue
        if isinstance(c, Partial) and type(t) is Partial and c.reduce_op in ("sum", "avg") and t.reduce_op in ("sum", "avg"):
            n = mesh.size(ax)
            if c.reduce_op == "sum" and t.reduce_op == "avg":
                scale *= n
            elif c.reduce_op == "avg" and t.reduce_op == "sum":
                scale /= n
            relabel[ax] = t  # same partial values, relabelled after scaling
            inter[ax] = t
        else:
            inter[ax] = Replicate()
    if relabel != list(cur):
        local = x.to_local()
        if scale != 1.0:
            local = local * scale
        x = DTensor.from_local(local, mesh, relabel, run_check=False, shape=x.shape, stride=x.stride())
    if tuple(x.placements) != tuple(inter):
        x = x.redistribute(mesh, tuple(inter))
    if tuple(inter) == tuple(target):
        return x
    local = x.to_local()
    for ax, (i, t) in enumerate(zip(inter, target)):
        if isinstance(i, Replicate) and isinstance(t, Partial):
            local = t._partition_value(local, mesh, ax)
    return DTensor.from_local(local, mesh, target, run_check=False, shape=x.shape, stride=x.stride())


def _shard_dim(src: tuple, dst: tuple) -> int | None:
    """The one tensor dim the Shard placements of src and dst split (0 if none), else None."""
    dims = {p.dim for p in src + dst if isinstance(p, Shard)}
    if any(isinstance(p, Shard) and type(p) is not Shard for p in src + dst):
        return None  # _StridedShard
    if len(dims) > 1:
        return None
    return dims.pop() if dims else 0


def _as_dim0(placements: tuple) -> tuple:
    return tuple(Shard(0) if isinstance(p, Shard) else p for p in placements)


def bucket_key(src: tuple, dst: tuple) -> tuple | None:
    """Normalised (src, dst) when a flat-buffer collective can do src -> dst, else None.

    Per mesh axis: (S(d) -> R) gathers, or (P(sum) -> S(d) | R) reductions, or unchanged
    R / S(d); one tensor dim d per tensor (moved to the front in the buffer); gathers and
    reductions are not mixed; at least one axis changes.
    """
    d = _shard_dim(src, dst)
    if d is None:
        return None
    a_, b_ = _as_dim0(src), _as_dim0(dst)
    changed = gather = reduce = False
    for a, b in zip(a_, b_):
        if a == b and isinstance(a, (Replicate, Shard)) and not isinstance(a, Partial):
            continue
        if isinstance(a, Shard) and isinstance(b, Replicate):
            gather = changed = True
        elif type(a) is Partial and a.reduce_op == "sum" and isinstance(b, (Replicate, Shard)):
            reduce = changed = True
        else:
            return None
    if not changed or (gather and reduce):
        return None
    return (a_, b_)


def _n_chunks(placements: tuple, mesh: Any) -> int:
    k = 1
    for ax, p in enumerate(placements):
        if isinstance(p, Shard):
            k *= mesh.size(ax)
    return k


def bucketed_redistribute(items: list[DTensor], targets: list[tuple], mesh: Any) -> list[DTensor]:
    """Redistribute tensors sharing one `bucket_key` with ONE collective per mesh axis on a
    flat buffer (FSDP-style bucketing) instead of one per tensor.

    Each tensor's sharded dim is moved to the front; the buffer is laid out chunk-major
    (chunk r of every tensor, then chunk r+1, ...) so that DTensor's own Shard(0) of the
    buffer coincides with every tensor's shards.
    """
    src, dst = bucket_key(tuple(items[0].placements), targets[0])
    k_src, k_dst = _n_chunks(src, mesh), _n_chunks(dst, mesh)
    # the finest split has max(k_src, k_dst) chunks; this rank's source local tensor holds q
    # of them (q > 1 only when reducing onto a finer shard)
    q = k_dst // k_src if k_dst > k_src else 1
    dims = [_shard_dim(tuple(x.placements), t) for x, t in zip(items, targets)]
    moved = [x.to_local().movedim(d, 0) if d else x.to_local() for x, d in zip(items, dims)]
    parts = [m.contiguous().reshape(q, -1) for m in moved]
    widths = [pt.shape[1] for pt in parts]
    buf = torch.cat(parts, dim=1).reshape(-1)  # [q blocks of L], block b = chunk b of every tensor
    L = sum(widths)
    dt = DTensor.from_local(buf, mesh, src, run_check=False, shape=(buf.numel() * k_src,), stride=(1,))
    blocks = redistribute(dt, mesh, dst).to_local().reshape(-1, L)
    res = []
    off = 0
    for x, t, d, m, w in zip(items, targets, dims, moved, widths):
        piece = blocks[:, off:off + w].reshape(-1, *m.shape[1:])
        off += w
        if d:
            piece = piece.movedim(0, d).contiguous()
        res.append(DTensor.from_local(piece, mesh, t, run_check=False, shape=x.shape,
                                      stride=_contiguous_stride(tuple(x.shape))))
    return res


# ---------------------------------------------------------------------------
# The plan as executable per-node specs
# ---------------------------------------------------------------------------


class PlanRunner:
    """Executes the joint graph of `graph` with the placements of `plan` on `mesh`.

    Holds, per node, the chosen OpSpec (looked up in `candidates` by the plan's strategy
    index and checked against the plan's placement strings, so a replayed plan that does
    not fit this graph is refused).
    """

    def __init__(self, graph: JointGraph, candidates: Candidates, plan: Plan, mesh: Any, mp_policy: Any = None,
                 bucket: bool = True, local_graphs: bool = True):
        self.graph = graph
        self.mesh = mesh
        self.plan = plan
        self.mp_policy = mp_policy
        self.param_dtype = getattr(mp_policy, "param_dtype", None) if mp_policy is not None else None
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None) if mp_policy is not None else None
        self.spec: dict[str, Any] = {}
        self.stats: Counter = Counter()
        self._check_and_resolve(candidates)
        gm = graph.gm
        nodes = list(gm.graph.nodes)
        self.fwd_nodes = [n for n in nodes if n.op == "call_function" and graph.phase.get(n.name) == FWD]
        self.bwd_nodes = [n for n in nodes if n.op == "call_function" and graph.phase.get(n.name) == BWD]
        bwd_names = {n.name for n in self.bwd_nodes}
        # forward values the backward reads (activations, params, inputs)
        need: set[str] = set()
        for n in self.bwd_nodes:
            for a in n.all_input_nodes:
                if a.name not in bwd_names and graph.phase.get(a.name) != BWD:
                    need.add(a.name)
        self.saved_names = need
        # slots
        self.out_slots = [s for s in graph.slots if s.kind == "output"]
        self.grad_slots = {s.of: s for s in graph.slots if s.kind == "grad_param"}
        for s in graph.slots:
            if s.node is not None and graph.phase.get(s.node.name) == BWD and s.kind == "output":
                raise NotImplementedError(f"forward output {s.index} is computed in the backward phase")
        self.param_names = list(graph.params)
        self.buffer_names = list(graph.buffers)
        self.input_nodes = list(graph.inputs)
        self.tangent_of = {t.name: i for i, t in graph.output_tangents}
        # per-device graphs (LocalGraphs), built on the first call; None = interpret eagerly
        self.use_local_graphs = local_graphs
        self._local_graphs: Any = None
        self._local_graphs_key: Any = None
        # collective bucketing (gathers of parameters, gradient reductions)
        self.bucket = bucket
        # layout-only ops between a weight-gradient matmul and its gradient output: run them
        # on the Partial value and reduce once, bucketed, at the output (sum commutes with
        # transposes, views and casts), instead of one reduce-scatter per gradient
        self.defer: set[str] = set()
        if bucket:
            grad_nodes = {s.node.name for s in self.grad_slots.values() if s.node is not None}
            for n in reversed(self.bwd_nodes):
                if n.target not in _LAYOUT_OPS:
                    continue
                users = list(n.users)
                if users and all(u.op == "output" or u.name in self.defer for u in users) and (
                        n.name in grad_nodes or any(u.name in self.defer for u in users)):
                    self.defer.add(n.name)
        self._cache: dict[str, Any] = {}
        param_nodes = {graph.params[f].name for f in self.param_names}
        self._gather_params: list[str] = []
        for n in nodes:
            if n.op != "call_function" or n.name not in self.spec or n.target is operator.getitem:
                continue
            ins = list(self.spec[n.name].input_specs or [])
            leaves, _ = tree_flatten((n.args, dict(n.kwargs)))
            k = 0
            for a in leaves:
                if _is_tensor_node(a):
                    if a.name in param_nodes and k < len(ins) and all(isinstance(p, Replicate) for p in ins[k].placements):
                        if a.name not in self._gather_params:
                            self._gather_params.append(a.name)
                    k += 1

    def local_graphs(self, params: list[DTensor], buffers: list[Any], inputs: list[DTensor]) -> Any:
        """The LocalGraphs for these argument specs (built on first use), or None (eager)."""
        if not self.use_local_graphs:
            return None
        key = tuple(_dspec(x) if isinstance(x, DTensor) else (tuple(x.shape), x.dtype)
                    for x in params + buffers + inputs) + tuple(x.dtype for x in params + inputs)
        if self._local_graphs is None or self._local_graphs_key != key:
            try:
                self._local_graphs = LocalGraphs(self, params, buffers, inputs)
                self._local_graphs_key = key
            except Exception as e:  # noqa: BLE001 - the interpreter is always correct
                log.warning("apply: could not lower the plan to local graphs (%s: %s); interpreting eagerly",
                            type(e).__name__, str(e)[:300])
                self.use_local_graphs = False
                return None
        return self._local_graphs

    # -- plan <-> candidates -------------------------------------------------
    def _check_and_resolve(self, cands: Candidates) -> None:
        missing = [n for n in cands.nodes if n not in self.plan.nodes]
        extra = [n for n in self.plan.nodes if n not in cands.nodes]
        if missing or extra:
            raise PlanMismatchError(
                f"the plan does not match this model's joint graph: {len(missing)} nodes without a "
                f"strategy (e.g. {missing[:3]}), {len(extra)} unknown plan nodes (e.g. {extra[:3]}); re-plan"
            )
        for name, c in cands.nodes.items():
            np_ = self.plan.nodes[name]
            want = (list(np_.output_placements), list(np_.input_placements))

            def matches(spec: Any) -> bool:
                outs, ins = spec_placement_strs(spec)
                return outs == want[0] and (c.kind == PLACEHOLDER or ins == want[1])

            # the plan's index first; by placements when the menus differ (candidates rebuilt
            # from the plan on a seeded mesh hold one strategy per node)
            s = np_.strategy
            if 0 <= s < len(c.specs) and matches(c.specs[s]):
                spec = c.specs[s]
            else:
                spec = next((sp for sp in c.specs if matches(sp)), None)
            if spec is None:
                raise PlanMismatchError(
                    f"plan node {name} ({np_.label or np_.target}): no candidate here gives outputs "
                    f"{want[0]} from inputs {want[1]} ({len(c.specs)} candidates); the plan was made "
                    "for a different graph"
                )
            self.spec[name] = spec

    def out_placements(self, name: str, idx: int | None = None) -> tuple:
        o = self.spec[name].output_specs
        if isinstance(o, tuple):
            o = o[idx or 0]
        return tuple(o.placements)

    def param_placements(self, fqn: str) -> tuple:
        return self.out_placements(self.graph.params[fqn].name)

    def input_placements(self, i: int) -> tuple:
        return self.out_placements(self.input_nodes[i].name)

    # -- redistribution --------------------------------------------------------
    def _to(self, x: Any, placements: tuple) -> Any:
        if not isinstance(x, DTensor):
            if isinstance(x, torch.Tensor):  # a plain (global) tensor: every rank holds it
                x = DTensor.from_local(x, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
            else:
                return x
        if tuple(x.placements) == tuple(placements):
            return x
        self.stats["redistributions"] += 1
        return redistribute(x, self.mesh, tuple(placements))

    # -- interpretation ----------------------------------------------------------
    def _run_node(self, n: fx.Node, env: dict[str, Any]) -> Any:
        if n.target is operator.getitem:
            return env[n.args[0].name][n.args[1]]
        spec = self.spec[n.name]
        in_specs = list(spec.input_specs or [])
        leaves, tspec = tree_flatten((n.args, dict(n.kwargs)))
        k = 0
        vals = []
        for a in leaves:
            if _is_tensor_node(a):
                v = env[a.name]
                if k < len(in_specs) and n.name not in self.defer:
                    tgt = tuple(in_specs[k].placements)
                    cached = self._cache.get(a.name)
                    if cached is not None and tuple(cached.placements) == tgt:
                        v = cached
                    else:
                        v = self._to(v, tgt)
                if n.target in _VIEW_OPS and isinstance(v, DTensor) and not v.to_local().is_contiguous():
                    # the joint graph is functional: a copy is as good as a view, and local
                    # shards (after a redistribution) need not keep the global layout
                    v = DTensor.from_local(v.to_local().contiguous(), v.device_mesh, v.placements,
                                           run_check=False, shape=v.shape, stride=v.stride())
                k += 1
                vals.append(v)
            elif isinstance(a, fx.Node):
                vals.append(env[a.name])
            else:
                vals.append(a)
        if self.param_dtype is not None:
            vals = self._harmonize(vals, n)
        args, kwargs = tree_unflatten(vals, tspec)
        try:
            out = n.target(*args, **kwargs)
        except Exception as e:
            ins = [f"{tuple(v.shape)}@{placement_str(tuple(v.placements))} local {tuple(v.to_local().shape)} "
                   f"stride {v.to_local().stride()}" for v in vals if isinstance(v, DTensor)]
            raise RuntimeError(f"apply: node {n.name} ({n.target}) failed on inputs {ins}: {e}") from e
        if n.name in self.defer:
            return out
        # check / enforce the planned output placements
        o_spec = spec.output_specs
        if isinstance(out, (tuple, list)):
            outs = list(out)
            for i, o in enumerate(outs):
                if isinstance(o_spec, tuple) and i < len(o_spec) and o_spec[i] is not None and isinstance(o, torch.Tensor):
                    outs[i] = self._fix(o, tuple(o_spec[i].placements), n)
            return type(out)(outs) if isinstance(out, tuple) else outs
        if isinstance(out, torch.Tensor):
            if isinstance(o_spec, tuple):
                o_spec = o_spec[0]
            return self._fix(out, tuple(o_spec.placements), n)
        return out

    def _fix(self, out: torch.Tensor, planned: tuple, n: fx.Node) -> Any:
        if not isinstance(out, DTensor):
            # factory op (no DTensor input): a global value on every rank
            out = DTensor.from_local(out, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        if tuple(out.placements) != planned:
            self.stats["deviations"] += 1
            if self.stats["deviations"] <= 5:
                log.debug("apply: %s (%s) produced %s, plan says %s; redistributing", n.name, n.target,
                          placement_str(tuple(out.placements)), placement_str(planned))
            out = redistribute(out, self.mesh, planned)
        return out

    def _harmonize(self, vals: list[Any], n: fx.Node) -> list[Any]:
        """Mixed precision: an op whose floating inputs mix dtypes computes in param_dtype.

        The graph was traced in fp32; parameters enter it in bf16, so fp32 values (RoPE
        tables, the fp32 loss branch meeting a bf16 matmul in backward) are cast down
        where they meet bf16 ones. Ops with a single float dtype run as traced (the
        loss stays fp32).
        """
        if n.target in _CAST_OPS:
            return vals
        dts = {v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
        if len(dts) <= 1:
            return vals
        pd = self.param_dtype
        keep = _KEEP_DTYPE.get(n.target, ())
        return [v.to(pd) if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and v.dtype != pd
                and i not in keep else v for i, v in enumerate(vals)]

    def _autocast(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def run_forward(self, params: list[DTensor], buffers: list[Any], inputs: list[DTensor]) -> tuple[list[Any], dict]:
        env: dict[str, Any] = {}
        g = self.graph
        for fqn, p in zip(self.param_names, params):
            name = g.params[fqn].name
            v = p.detach()
            if self.param_dtype is not None and v.dtype.is_floating_point and v.dtype != self.param_dtype:
                v = v.to(self.param_dtype)  # cast the shard before any gather
            env[name] = v
        for fqn, b in zip(self.buffer_names, buffers):
            name = g.buffers[fqn].name
            env[name] = self._to(b, self.out_placements(name))
        for node, x in zip(self.input_nodes, inputs):
            env[node.name] = x
        self._cache = {}
        if self.bucket:
            self._prefetch(env)
        with torch.no_grad(), self._autocast():
            for n in self.fwd_nodes:
                env[n.name] = self._run_node(n, env)
        outs = []
        for s in self.out_slots:
            v = env[s.node.name]
            v = self._to(v, self.out_placements(f"output[{s.index}]"))
            outs.append(v)
        saved = {k: env[k] for k in self.saved_names if k in env}
        saved["__cache__"] = self._cache
        self._cache = {}
        return outs, saved

    def run_backward(self, saved: dict, tangents: list[Any], params: list[DTensor]) -> list[Any]:
        env = dict(saved)
        self._cache = env.pop("__cache__", {})
        g = self.graph
        for out_idx, t in g.output_tangents:
            val = tangents[out_idx] if out_idx < len(tangents) else None
            if val is None:
                val = torch.zeros(t.meta["val"].shape, dtype=t.meta["val"].dtype)
            env[t.name] = self._to(val, self.out_placements(t.name))
        with torch.no_grad(), self._autocast():
            for n in self.bwd_nodes:
                env[n.name] = self._run_node(n, env)
        self._cache = {}
        grads: list[Any] = []
        pending: dict[tuple, list[int]] = {}  # (src, dst, dtype) -> indices into grads
        for fqn, p in zip(self.param_names, params):
            s = self.grad_slots.get(fqn)
            if s is None or s.node is None:
                grads.append(None)
                continue
            v = env[s.node.name]
            if self.reduce_dtype is not None and v.dtype != self.reduce_dtype and v.dtype.is_floating_point:
                v = v.to(self.reduce_dtype)  # reduce gradients in the reduce dtype
            dst = self.out_placements(f"output[{s.index}]")
            src = tuple(v.placements)
            key = bucket_key(src, dst) if self.bucket and src != dst else None
            if key is not None:
                pending.setdefault((key, v.dtype), []).append((len(grads), dst))
            else:
                v = self._to(v, dst)
            grads.append(v)
        for members in pending.values():  # one collective per bucket and mesh axis
            self.stats["bucketed_grad_reductions"] += 1
            idx = [i for i, _ in members]
            outs = bucketed_redistribute([grads[i] for i in idx], [d for _, d in members], self.mesh)
            for i, r in zip(idx, outs):
                grads[i] = r
        for i, (v, p) in enumerate(zip(grads, params)):
            if v is None:
                continue
            if v.dtype != p.dtype:
                v = v.to(p.dtype)
            if tuple(v.placements) != tuple(p.placements):
                v = redistribute(v, self.mesh, tuple(p.placements))
            grads[i] = v
        return grads

    def _prefetch(self, env: dict[str, Any]) -> None:
        """Gather every parameter that some op uses replicated with one bucketed collective
        per (placement, dtype) group; fwd and bwd uses then read the gathered copy."""
        groups: dict[tuple, list[str]] = {}
        for name in self._gather_params:
            v = env[name]
            src = tuple(v.placements)
            rep = tuple(Replicate() for _ in src)
            key = bucket_key(src, rep)
            if key is not None:
                groups.setdefault((key, v.dtype), []).append(name)
        for names in groups.values():
            rep = tuple(Replicate() for _ in range(self.mesh.ndim))
            self.stats["bucketed_param_gathers"] += 1
            outs = bucketed_redistribute([env[n] for n in names], [rep] * len(names), self.mesh)
            for name, full in zip(names, outs):
                self._cache[name] = full


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _dspec(x: DTensor) -> tuple:
    return (tuple(x.placements), tuple(x.shape), tuple(x.stride()))


class LocalGraphs:
    """The plan lowered to two per-device FX graphs (paper §5.1): plain ATen ops on local
    shards with explicit functional collectives where placements change.

    Built once by tracing the DTensor interpreter (`make_fx`, fake tensors) on this rank's
    local shapes: `fwd(param locals, buffers, input locals) -> (output locals, saved locals)`
    and `bwd(saved locals, tangent locals) -> gradient locals`. Running them skips DTensor's
    per-op dispatch; the results are those of the interpreter, op for op.
    """

    def __init__(self, runner: PlanRunner, params: list[DTensor], buffers: list[Any], inputs: list[DTensor]):
        from torch.fx.experimental.proxy_tensor import make_fx

        mesh = runner.mesh
        self.pspecs = [_dspec(p) for p in params]
        ispecs = [_dspec(x) for x in inputs]
        bspecs = [_dspec(b) if isinstance(b, DTensor) else None for b in buffers]
        self.param_dtypes = [p.dtype for p in params]
        meta: dict[str, Any] = {}

        def wrap(locs: list[Any], specs: list[Any]) -> list[Any]:
            return [DTensor.from_local(l, mesh, sp[0], run_check=False, shape=sp[1], stride=sp[2])
                    if sp is not None else l for l, sp in zip(locs, specs)]

        def fwd(plocs: list[torch.Tensor], blocs: list[torch.Tensor], ilocs: list[torch.Tensor]) -> Any:
            outs, saved = runner.run_forward(wrap(plocs, self.pspecs), wrap(blocs, bspecs), wrap(ilocs, ispecs))
            cache = saved.pop("__cache__", {})
            keys = sorted(saved)
            ckeys = sorted(cache)
            meta["keys"], meta["ckeys"] = keys, ckeys
            meta["saved"] = [_dspec(saved[k]) if isinstance(saved[k], DTensor) else None for k in keys]
            meta["cache"] = [_dspec(cache[k]) for k in ckeys]
            meta["outs"] = [_dspec(o) for o in outs]
            return [o.to_local() for o in outs], [_local(saved[k]) for k in keys] + [cache[k].to_local() for k in ckeys]

        plocs = [p.to_local() for p in params]
        blocs = [_local(b) for b in buffers]
        ilocs = [x.to_local() for x in inputs]
        self.fwd = make_fx(fwd, tracing_mode="fake")(plocs, blocs, ilocs)
        self.out_specs = meta["outs"]
        keys, ckeys = meta["keys"], meta["ckeys"]
        sspecs = meta["saved"] + meta["cache"]
        n_saved = len(keys)
        param_specs = self.pspecs

        def bwd(slocs: list[torch.Tensor], tlocs: list[torch.Tensor]) -> Any:
            vals = wrap(slocs, sspecs)
            saved = dict(zip(keys, vals[:n_saved]))
            saved["__cache__"] = dict(zip(ckeys, vals[n_saved:]))
            tangents = wrap(tlocs, self.out_specs)
            grads = runner.run_backward(saved, tangents, [_ParamMeta(sp, dt) for sp, dt in zip(param_specs, self.param_dtypes)])
            meta["has_grad"] = [g is not None for g in grads]
            return [g.to_local() for g in grads if g is not None]

        _, slocs = self.fwd(plocs, blocs, ilocs)
        tlocs = [torch.ones(sp[1], dtype=o.dtype) if not sp[1] else torch.ones(
            local_shape(sp[1], sp[0], tuple(mesh.shape)), dtype=o.dtype) for sp, o in zip(self.out_specs, self.fwd(plocs, blocs, ilocs)[0])]
        self.bwd = make_fx(bwd, tracing_mode="fake")(slocs, tlocs)
        self.has_grad = meta["has_grad"]
        n_coll = sum(1 for g in (self.fwd, self.bwd) for n in g.graph.nodes if "_c10d_functional" in str(n.target)
                     and "wait" not in str(n.target))
        runner.stats["local_graph_collectives"] = n_coll
        log.info("apply: local graphs built (%d forward, %d backward nodes, %d collectives)",
                 len(self.fwd.graph.nodes), len(self.bwd.graph.nodes), n_coll)


class _ParamMeta:
    """What run_backward reads of a parameter: dtype and placements."""

    def __init__(self, spec: tuple, dtype: torch.dtype):
        self.placements = spec[0]
        self.dtype = dtype


class _PlanFunction(torch.autograd.Function):
    """Forward part of the plan in forward, backward part in backward."""

    @staticmethod
    def forward(ctx: Any, runner: PlanRunner, n_params: int, n_buffers: int, *flat: Any) -> Any:
        params = list(flat[:n_params])
        buffers = list(flat[n_params : n_params + n_buffers])
        inputs = list(flat[n_params + n_buffers :])
        lg = runner.local_graphs(params, buffers, inputs)
        ctx.n_params = n_params
        ctx.n_rest = n_buffers + len(inputs)
        ctx.runner = runner
        if lg is not None:
            outs_l, saved_l = lg.fwd([p.to_local() for p in params], [_local(b) for b in buffers],
                                     [x.to_local() for x in inputs])
            ctx.lg, ctx.saved = lg, saved_l
            ctx.out_placements = [sp[0] for sp in lg.out_specs]
            ctx.out_meta = [(sp[1], sp[2]) for sp in lg.out_specs]
            return tuple(outs_l) if len(outs_l) > 1 else outs_l[0]
        ctx.lg = None
        outs, saved = runner.run_forward(params, buffers, inputs)
        ctx.saved = saved
        ctx.params = params
        locals_ = tuple(o.to_local() for o in outs)
        ctx.out_placements = [tuple(o.placements) for o in outs]
        ctx.out_meta = [(o.shape, o.stride()) for o in outs]
        return locals_ if len(locals_) > 1 else locals_[0]

    @staticmethod
    def backward(ctx: Any, *grad_outs: Any) -> Any:
        runner: PlanRunner = ctx.runner
        if ctx.lg is not None:
            lg: LocalGraphs = ctx.lg
            tl = [g.contiguous() if g is not None else torch.zeros(local_shape(sp[1], sp[0], tuple(runner.mesh.shape)))
                  for g, sp in zip(grad_outs, lg.out_specs)]
            gl = iter(lg.bwd(ctx.saved, tl))
            ctx.saved = None
            grads = []
            for has, sp in zip(lg.has_grad, lg.pspecs):
                grads.append(DTensor.from_local(next(gl), runner.mesh, sp[0], run_check=False, shape=sp[1],
                                                stride=sp[2]) if has else None)
            return (None, None, None, *grads, *([None] * ctx.n_rest))
        tangents = []
        for g, pl, (shape, stride) in zip(grad_outs, ctx.out_placements, ctx.out_meta):
            if g is None:
                tangents.append(None)
                continue
            tangents.append(DTensor.from_local(g.contiguous(), runner.mesh, pl, run_check=False, shape=shape, stride=stride))
        grads = runner.run_backward(ctx.saved, tangents, ctx.params)
        ctx.saved = None
        return (None, None, None, *grads, *([None] * ctx.n_rest))


# ---------------------------------------------------------------------------
# The ParallelModule
# ---------------------------------------------------------------------------


class ParallelModuleMixin:
    """Methods of the materialised module (mixed into a subclass of the user's class)."""

    computes_loss: bool = False  # True when the plan's forward returns the loss (traced with loss_fn)
    handles_mixed_precision: bool = True
    is_auto_parallel: bool = True

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        runner: PlanRunner = self._ap_runner
        flat, _ = tree_flatten(inputs)
        if len(flat) != len(runner.input_nodes):
            raise TypeError(f"{type(self).__name__}.forward expects {len(runner.input_nodes)} tensor inputs "
                            f"(as traced), got {len(flat)}")
        dts = []
        for i, (x, node) in enumerate(zip(flat, runner.input_nodes)):
            val = node.meta["val"]
            pl = runner.input_placements(i)
            if isinstance(x, DTensor):
                if tuple(x.shape) != tuple(val.shape):
                    raise InputShapeError(f"input {i}: global shape {tuple(x.shape)}, the plan was made for {tuple(val.shape)}")
                dts.append(runner._to(x, pl))
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i}: expected a tensor, got {type(x).__name__}")
            want = local_shape(tuple(val.shape), pl, tuple(runner.mesh.shape))
            if tuple(x.shape) != want:
                raise InputShapeError(
                    f"input {i}: this rank got local shape {tuple(x.shape)} but the plan expects {want} "
                    f"(global {tuple(val.shape)} placed {placement_str(pl)} on mesh {tuple(runner.mesh.shape)} "
                    f"{tuple(runner.mesh.mesh_dim_names or ())}); pass each rank its LOCAL shard"
                )
            if x.dtype != val.dtype:
                raise InputShapeError(f"input {i}: dtype {x.dtype}, the plan was traced with {val.dtype}")
            # the graph was traced on contiguous inputs (its views assume that layout)
            dts.append(DTensor.from_local(x.contiguous(), runner.mesh, pl, run_check=False, shape=val.shape,
                                          stride=_contiguous_stride(tuple(val.shape))))
        params = [self._ap_param_refs[f]() for f in runner.param_names]
        buffers = [self._ap_buffer_refs[f]() for f in runner.buffer_names]
        return _PlanFunction.apply(runner, len(params), len(buffers), *params, *buffers, *dts)

    @torch.no_grad()
    def init_weights(self, *args: Any, **kwargs: Any) -> None:
        """The single-device init (same RNG draws), then each rank keeps its shards."""
        template = copy.deepcopy(self._ap_template)
        device = self._ap_device()
        template.to_empty(device=device)
        template.init_weights(*args, **kwargs)
        self._ap_load_full(template)

    def _ap_device(self) -> torch.device:
        for p in self.parameters():
            loc = p.to_local() if isinstance(p, DTensor) else p
            return loc.device
        return torch.device("cpu")

    @torch.no_grad()
    def _ap_load_full(self, full: nn.Module) -> None:
        """Copy the shards of a full (single-device) module's weights into this module."""
        runner: PlanRunner = self._ap_runner
        full_params = dict(full.named_parameters())
        for fqn in runner.param_names:
            p = self._ap_param_refs[fqn]()
            src = full_params[fqn].detach().to(p.dtype)
            local = local_shard(src, runner.mesh, tuple(p.placements))
            p.to_local().copy_(local)
        for fqn, b in full.named_buffers():
            mod, _, leaf = fqn.rpartition(".")
            setattr(self.get_submodule(mod) if mod else self, leaf, b.detach().clone())

    @property
    def plan(self) -> Plan:
        return self._ap_runner.plan


def local_shard(full: torch.Tensor, mesh: Any, placements: tuple) -> torch.Tensor:
    """This rank's local shard of a global tensor (no communication)."""
    dt = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return dt.redistribute(mesh, placements).to_local()


_SUBCLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"AutoParallel{cls.__name__}", (ParallelModuleMixin, cls), {"__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


def is_parallel_module(m: Any) -> bool:
    return isinstance(m, ParallelModuleMixin)


def _all_meta(model: nn.Module) -> bool:
    ts = list(model.parameters()) + list(model.buffers())
    return bool(ts) and all(t.device.type == "meta" for t in ts)


def apply_plan(model: nn.Module, graph: JointGraph, candidates: Candidates, plan: Plan, mesh: Any, *,
               mp_policy: Any = None, computes_loss: bool | None = None) -> nn.Module:
    """Materialise `plan` for `model`: a ParallelModule with DTensor parameters (see module doc).

    `model` may be on meta (then `to_empty` + `init_weights()` later) or materialised (then
    every rank must hold the same full weights; each keeps its shards).
    """
    plan.check_compatible(model=model, mesh=mesh, source="the plan")
    runner = PlanRunner(graph, candidates, plan, mesh, mp_policy)
    on_meta = _all_meta(model)
    pm = copy.deepcopy(model)
    template = copy.deepcopy(model) if on_meta else copy.deepcopy(model).to("meta")
    pm.__class__ = _parallel_class(type(model))
    named = dict(pm.named_parameters())
    if set(named) != set(runner.param_names):
        raise PlanMismatchError(f"model parameters {sorted(set(named) ^ set(runner.param_names))[:5]} are not in the plan")
    param_refs = {}
    for fqn in runner.param_names:
        p = named[fqn]
        pl = runner.param_placements(fqn)
        if on_meta or p.device.type == "meta":
            local = torch.empty(local_shape(tuple(p.shape), pl, tuple(mesh.shape)), dtype=p.dtype, device="meta")
        else:
            local = local_shard(p.detach(), mesh, pl).clone()
        dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=p.shape, stride=_contiguous_stride(tuple(p.shape)))
        mod_name, _, leaf = fqn.rpartition(".")
        mod = pm.get_submodule(mod_name) if mod_name else pm
        setattr(mod, leaf, nn.Parameter(dt, requires_grad=p.requires_grad))
        param_refs[fqn] = _ref(mod, leaf, "_parameters")
    buffer_refs = {}
    for fqn in runner.buffer_names:
        mod_name, _, leaf = fqn.rpartition(".")
        mod = pm.get_submodule(mod_name) if mod_name else pm
        buffer_refs[fqn] = _ref(mod, leaf, "_buffers")
    object.__setattr__(pm, "_ap_runner", runner)
    object.__setattr__(pm, "_ap_template", template)
    object.__setattr__(pm, "_ap_param_refs", param_refs)
    object.__setattr__(pm, "_ap_buffer_refs", buffer_refs)
    if computes_loss is None:
        computes_loss = True
    object.__setattr__(pm, "computes_loss", computes_loss)
    log.info("apply: materialised %s with %d DTensor parameters on mesh %s", type(pm).__name__, len(param_refs),
             tuple(mesh.shape))
    return pm


def _ref(mod: nn.Module, leaf: str, table: str) -> Any:
    d = getattr(mod, table)
    return lambda: d[leaf] if leaf in d else getattr(mod, leaf)
