"""Split-dimension seeding (paper §4.3): plan a D-dim mesh from D one-dimensional plans.

Candidate enumeration and pairwise costs grow as (1 + n)^D with the mesh dimension D
(a 4-D LLaMA 3 8B problem cannot even be enumerated here). So:

1. for every mesh axis a, the joint graph is planned on the 1-D sub-mesh of that axis
   (the axis sliced out of the fake world's mesh) with the cost model projected onto the
   axis (`CostModel.project(a)`: that axis's link), the user constraints projected onto
   the axis, and parameters fully sharded on it (the paper's setting: storage fixed at
   its minimum; a later axis may still deviate inside the ball). Axes of equal size and
   link give the same 1-D problem: solved once;
2. each node's seed is the D-tuple of its 1-D strategies (one per axis);
3. the D-dim candidates are enumerated restricted to the Hamming ball of radius r
   around the seed: every D-tuple of per-axis 1-D strategies that differs from the seed
   on at most r axes (`strategies.build_candidates(restrict=...)`), which turns the
   O((1+n)^D) menu into O(D^r n^r). Nodes whose whole product is small (at most
   FULL_MENU_MAX strategies: parameters, gradients, transposes) keep the whole product,
   since 1-D plans break their dim-0/dim-1 ties arbitrarily (see `_menu`).

`seeded_candidates(...)` returns the restricted Candidates and a `SeedInfo` report.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial

from parallel import _torch as T
from parallel.auto.candidates.enumeration import make_spec
from parallel.auto.candidates.placements import placement_words, spec_placement_strs, strategy_key
from parallel.auto.candidates.strategies import GETITEM, PLACEHOLDER, Candidates, NodeCandidates, build_candidates
from parallel.auto.cost import CostModel
from parallel.auto.plan import Plan, PlanMismatchError
from parallel.auto.problem.formulation import build_problem
from parallel.auto.problem.placement_problem import Constraint, min_parameter_fraction
from parallel.auto.solve import solve
from parallel.auto.solve.problem_mrf import MRFEffort
from parallel.auto.trace.joint import JointGraph

log = logging.getLogger("parallel.auto.seed")

DEFAULT_RADIUS = 2
SEED_FROM_NDIM = 3
"""Seeding is on by default for meshes of this many dimensions and more."""
FULL_MENU_MAX = 256
"""A node whose whole per-axis product has at most this many strategies gets all of them
instead of the Hamming ball (see `_menu`)."""


@dataclass
class SeedInfo:
    radius: int
    axes: list[dict] = field(default_factory=list)  # per axis: size, name, objective, solver, seconds, reused
    ball_max: int = 0
    ball_mean: float = 0.0
    strategies: int = 0
    seconds: float = 0.0
    unseeded_vars_estimate: int = 0  # ILP variables of the unseeded problem, from the 1-D menus (upper bound)
    rounds: int = 1  # re-seeding rounds run (see `reseeded_candidates`)
    options: dict = field(default_factory=dict, repr=False)  # node -> per-axis 1-D option keys
    seeds: dict = field(default_factory=dict, repr=False)  # node -> per-axis option index of the seed

    def summary(self) -> str:
        parts = []
        for a in self.axes:
            how = "same 1-D problem as axis %d" % a["reused_from"] if a.get("reused_from") is not None else \
                f"{a['solver']} {a['objective']:,.1f} µs, " + (
                    "solved for an earlier mesh" if a.get("earlier_mesh") else f"{a['seconds']:.1f}s")
            parts.append(f"axis {a['axis']} ({a['name']}, {a['size']}): {how}")
        return (f"seeding: radius {self.radius}; " + "; ".join(parts) +
                f"; Hamming-ball menus: max {self.ball_max}, mean {self.ball_mean:.1f} strategies per node "
                f"({self.strategies:,} in all), {self.seconds:.1f}s")


def _project_placements(p: Any, axis: int) -> Any:
    if p is None:
        return None
    p = tuple(p)
    if p and (isinstance(p[0], tuple) or p[0] is None):  # several outputs
        return tuple(None if x is None else (tuple(x)[axis],) for x in p)
    return (p[axis],)


def project_constraint(con: Constraint, axis: int) -> Constraint:
    ins = None
    if con.input_placements is not None:
        ins = tuple(None if x is None else (tuple(x)[axis],) for x in con.input_placements)
    return Constraint(con.kind, f"{con.description} (mesh axis {axis})", node=con.node,
                      placements=_project_placements(con.placements, axis), input_placements=ins)


def _combine(keys: list[tuple]) -> tuple:
    """D-dim key from one 1-D key per axis."""
    outs = [k[0] for k in keys]
    o0 = outs[0]
    if o0 and (isinstance(o0[0], tuple) or o0[0] is None):  # several outputs
        out = tuple(None if o0[i] is None else tuple(o[i][0] for o in outs) for i in range(len(o0)))
    else:
        out = tuple(o[0] for o in outs)
    n_in = len(keys[0][1])
    ins = tuple(tuple(k[1][j][0] for k in keys) for j in range(n_in))
    return (out, ins)


def _mixed_partial(key: tuple) -> bool:
    """True when a tensor is Partial with a min/max reduction on one axis and a different
    one on another (e.g. Partial(min) x Partial(max)): valid per axis, but DTensor's own
    mesh expansion never produces it, so seeded menus leave it out too."""
    o, ins = key
    outs = o if (o and (isinstance(o[0], tuple) or o[0] is None)) else (o,)
    for pl in list(outs) + list(ins):
        if pl is None:
            continue
        ops = {p.reduce_op for p in pl if type(p) is Partial}
        if len(ops) > 1 and not ops <= {"sum", "avg"}:  # linear reductions commute; min/max do not
            return True
    return False


def hamming_ball(options: list[list[Any]], seed: list[int], radius: int) -> list[tuple[int, ...]]:
    """Index tuples (one option per axis) differing from `seed` on at most `radius` axes.

    Ordered by distance, then axis, then option: the seed first.
    """
    d = len(options)
    out = [tuple(seed)]
    for r in range(1, min(radius, d) + 1):
        for axes in itertools.combinations(range(d), r):
            alts = [[i for i in range(len(options[a])) if i != seed[a]] for a in axes]
            for choice in itertools.product(*alts):
                t = list(seed)
                for a, i in zip(axes, choice):
                    t[a] = i
                out.append(tuple(t))
    return out


def _menu(options: list[list[Any]], seed: list[int], radius: int) -> list[tuple[int, ...]]:
    """The node's index tuples: the Hamming ball, or the whole per-axis product when small.

    Why: on one axis, sharding a weight (and its gradient, and the transposes between
    them) on dim 0 or dim 1 often costs the same, so each 1-D plan breaks the tie its own
    way, while on the full mesh the combination matters (which dim each axis gathers).
    LLaMA 3 8B on 4x2x4: its ILP optimum flips such nodes on all three axes, outside a
    radius-2 ball (+0.19 % without this rule, 0 with it); on 2x2x2x4 the plan improves
    1.9 %. These nodes have small menus (3-4 options per axis), so enumerating them fully
    is cheap; big menus keep the ball.
    """
    if math.prod(len(o) for o in options) <= FULL_MENU_MAX:
        radius = len(options)
    return hamming_ball(options, seed, radius)


def _ball_keys(options: list[list[tuple]], seed: list[int], radius: int, cache: dict) -> list[tuple]:
    """The D-dim strategy keys of a node's menu (`_menu`), without mixed min/max partials.
    Copies of a layer share menus and seeds: one list object per distinct (menus, seed),
    which the restricted enumeration also caches by."""
    ck = (tuple(tuple(o) for o in options), tuple(seed))
    keys = cache.get(ck)
    if keys is None:
        combined = (_combine([options[a][t[a]] for a in range(len(options))]) for t in _menu(options, seed, radius))
        keys = cache[ck] = [k for k in combined if not _mixed_partial(k)]
    return keys


_SOLVED_AXES: dict[int, dict[tuple, tuple]] = {}
"""Per joint graph (by id; dropped with the graph): the 1-D seeds solved in this process, by
everything that decides one. A mesh search's meshes share axes (one size on one link), and a
1-D problem depends on the graph, the axis and the planner settings, not on the other axes."""


def _solved_axes(graph: JointGraph) -> dict[tuple, tuple]:
    memo = _SOLVED_AXES.get(id(graph))
    if memo is None:
        memo = _SOLVED_AXES[id(graph)] = {}
        weakref.finalize(graph, _SOLVED_AXES.pop, id(graph), None)
    return memo


def _axis_candidates(graph: JointGraph, mesh: DeviceMesh) -> list[Candidates]:
    """Per mesh axis, the full 1-D candidates on that axis's sub-mesh (built once per axis size)."""
    by_size: dict[int, Candidates] = {}
    for a, size in enumerate(mesh.shape):
        if size not in by_size:
            by_size[size] = build_candidates(graph, _axis_submesh(mesh, a))
    return [by_size[size] for size in mesh.shape]


def _options(cands: Candidates, name: str) -> list[tuple]:
    """A node's distinct 1-D strategy keys, in menu order."""
    return list(dict.fromkeys(strategy_key(s) for s in cands.nodes[name].specs))


def _axis_submesh(mesh: DeviceMesh, axis: int) -> DeviceMesh:
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError("split-dimension seeding needs named mesh axes (init_device_mesh(..., mesh_dim_names=...))")
    return mesh[names[axis]]


def solve_axes(graph: JointGraph, mesh: DeviceMesh, cost_model: CostModel,
               constraints: list[Constraint] | None = None, *,
               mp_dtype: Any = None, repeated_blocks: bool = True, solver: str = "auto",
               time_limit: float | None = 120.0,
               effort: MRFEffort = MRFEffort()) -> tuple[list[tuple[Candidates, list[int], Any]], list[dict]]:
    """One 1-D plan per mesh axis: [(1-D candidates, strategy index per node name... as labels, problem)]."""
    shape = tuple(mesh.shape)
    names = list(getattr(mesh, "mesh_dim_names", None) or [f"axis{i}" for i in range(len(shape))])
    by_size: dict[int, Candidates] = {}
    memo = _solved_axes(graph)
    solved: dict[tuple, int] = {}
    results: list[tuple[Candidates, list[int], Any]] = []
    info: list[dict] = []
    for a, size in enumerate(shape):
        t0 = time.perf_counter()
        cm_a = cost_model.project(a)
        link = cm_a.links[0]
        ident = (size, repr({k: v for k, v in vars(link).items() if k not in ("axis", "name")}))
        if ident in solved:
            results.append(results[solved[ident]])
            info.append({"axis": a, "name": names[a], "size": size, "reused_from": solved[ident]})
            continue
        cons = [project_constraint(c, a) for c in (constraints or []) if c.kind != "memory"]
        key = (ident, repr(cons), cm_a.pricing_key(), str(mp_dtype), repeated_blocks, solver, time_limit, effort)
        if key in memo:  # solved for an earlier mesh of this graph
            solved[ident] = a
            cands, labels, prob, objective, how = memo[key]
            results.append((cands, labels, prob))
            info.append({"axis": a, "name": names[a], "size": size, "objective": objective, "solver": how,
                         "seconds": 0.0, "reused_from": None, "earlier_mesh": True})
            continue
        if size not in by_size:
            by_size[size] = build_candidates(graph, _axis_submesh(mesh, a))
        cands = by_size[size]
        high = max(1.0 / size, min_parameter_fraction(cands))
        prob = build_problem(cands, cm_a, constraints=cons, memory_high=high, repeated_blocks=repeated_blocks,
                             mp_dtype=mp_dtype)
        sol = solve(prob, solver, time_limit=time_limit, effort=effort)
        solved[ident] = a
        memo[key] = (cands, sol.labels, prob, sol.objective, sol.solver)
        results.append((cands, sol.labels, prob))
        info.append({"axis": a, "name": names[a], "size": size, "objective": sol.objective, "solver": sol.solver,
                     "seconds": time.perf_counter() - t0, "reused_from": None})
        log.info("seed: axis %d (%s, size %d): 1-D objective %.1f µs by %s in %.1fs", a, names[a], size,
                 sol.objective, sol.solver, time.perf_counter() - t0)
    return results, info


def seeded_candidates(graph: JointGraph, mesh: DeviceMesh, cost_model: CostModel,
                      constraints: list[Constraint] | None = None, *,
                      radius: int = DEFAULT_RADIUS, mp_dtype: Any = None, repeated_blocks: bool = True,
                      solver: str = "auto", time_limit: float | None = 120.0,
                      effort: MRFEffort = MRFEffort()) -> tuple[Candidates, SeedInfo]:
    """D-dim candidates restricted to the Hamming ball of `radius` around the 1-D seeds."""
    t0 = time.perf_counter()
    axes, info = solve_axes(graph, mesh, cost_model, constraints, mp_dtype=mp_dtype,
                            repeated_blocks=repeated_blocks, solver=solver, time_limit=time_limit,
                            effort=effort)
    restrict: dict[str, list[tuple]] = {}
    ref = axes[0][0]
    menu_cache: dict[tuple, list[tuple]] = {}
    options_by_node: dict[str, list[list[tuple]]] = {}
    seeds_by_node: dict[str, list[int]] = {}
    sizes = []
    for name, c0 in ref.nodes.items():
        if c0.kind not in (PLACEHOLDER, "op", "slot"):
            continue  # getitem menus follow their producer
        options: list[list[tuple]] = []
        seed: list[int] = []
        for cands, labels, prob in axes:
            uniq = _options(cands, name)
            options.append(uniq)
            seed.append(uniq.index(strategy_key(cands.nodes[name].specs[labels[prob.group_of[name]]])))
        ball_keys = _ball_keys(options, seed, radius, menu_cache)
        restrict[name] = ball_keys
        sizes.append(len(ball_keys))
        options_by_node[name] = options
        seeds_by_node[name] = seed
    est = _unseeded_vars_estimate(axes)
    cands = build_candidates(graph, mesh, restrict=restrict)
    n_specs = sum(len(c.specs) for c in cands.nodes.values())
    si = SeedInfo(radius, info, max(sizes) if sizes else 0, (sum(sizes) / len(sizes)) if sizes else 0.0, n_specs,
                  time.perf_counter() - t0, est, 1, options_by_node, seeds_by_node)
    log.info("%s", si.summary())
    return cands, si


def _project_key(key: tuple, axis: int) -> tuple:
    o, ins = key
    if o and (isinstance(o[0], tuple) or o[0] is None):
        po = tuple(None if x is None else (x[axis],) for x in o)
    else:
        po = (o[axis],)
    return (po, tuple((i[axis],) for i in ins))


def reseeded_candidates(graph: JointGraph, mesh: DeviceMesh, info: SeedInfo, strategy_of: dict[str, Any], *,
                        radius: int | None = None) -> Candidates:
    """Candidates in the Hamming ball around a solved plan (one more seeding round).

    `strategy_of`: node name -> the chosen D-dim OpSpec. Each node's new seed is the
    per-axis projection of its chosen strategy (nodes whose choice has no projection in
    the 1-D menus keep their seed), so the previous plan stays inside the new menus.
    """
    radius = info.radius if radius is None else radius
    restrict: dict[str, list[tuple]] = {}
    cache: dict[tuple, list[tuple]] = {}
    for name, options in info.options.items():
        seed = list(info.seeds[name])
        spec = strategy_of.get(name)
        if spec is not None:
            key = strategy_key(spec)
            for a in range(len(options)):
                try:
                    seed[a] = options[a].index(_project_key(key, a))
                except ValueError:
                    pass
        info.seeds[name] = seed
        restrict[name] = _ball_keys(options, seed, radius, cache)
    info.rounds += 1
    return build_candidates(graph, mesh, restrict=restrict)


def _axis_tokens(strings: list[str]) -> list[list[str]]:
    """Per tensor, its per-axis placement tokens: ["(S(0), R)", "-"] -> [["S(0)", "R"], None]."""
    return [None if s == "-" else placement_words(s) for s in strings]


def plan_candidates(graph: JointGraph, mesh: DeviceMesh, plan: Plan) -> Candidates:
    """Candidates holding exactly the strategy `plan` chose for every node.

    For applying a plan on a seeded (3-D and up) mesh without solving it here: a plan
    loaded from a file, or one another rank solved. The full D-dim menus are never
    enumerated: each node's chosen D-dim strategy is assembled from its per-axis 1-D
    menus (the same ones seeding uses), matched by the placement strings the plan saved,
    and enumeration is restricted to that one key. A node whose saved placements no 1-D
    menu can produce raises PlanMismatchError.
    """
    t0 = time.perf_counter()
    axis_cands = _axis_candidates(graph, mesh)
    restrict: dict[str, list[tuple]] = {}
    for name, c0 in axis_cands[0].nodes.items():
        if c0.kind not in (PLACEHOLDER, "op", "slot"):
            continue
        np_ = plan.nodes.get(name)
        if np_ is None:
            raise PlanMismatchError(f"the plan has no strategy for node {name} of this model's joint graph; re-plan")
        outs = _axis_tokens(list(np_.output_placements))
        ins = _axis_tokens(list(np_.input_placements)) if c0.kind != PLACEHOLDER else None
        per_axis = []
        for a, cands in enumerate(axis_cands):
            want_o = ["-" if t is None else f"({t[a]})" for t in outs]
            want_i = None if ins is None else [f"({t[a]})" for t in ins]
            found = None
            for spec in cands.nodes[name].specs:
                got_o, got_i = spec_placement_strs(spec)
                if got_o == want_o and (want_i is None or got_i == want_i):
                    found = strategy_key(spec)
                    break
            if found is None:
                raise PlanMismatchError(
                    f"plan node {name} ({np_.label or np_.target}): its placements {np_.output_placements} "
                    f"(inputs {np_.input_placements}) are not a strategy of this graph on mesh axis {a}; "
                    "the plan was made for a different model or mesh: re-plan")
            per_axis.append(found)
        restrict[name] = [_combine(per_axis)]
    cands = build_candidates(graph, mesh, restrict=restrict)
    for name, c in cands.nodes.items():
        if c.kind == GETITEM:
            _pin_getitem(c, axis_cands, plan)
    log.info("plan candidates: the saved plan's strategies rebuilt from the 1-D menus in %.1fs",
             time.perf_counter() - t0)
    return cands


def _pin_getitem(c: NodeCandidates, axis_cands: list[Candidates], plan: Plan) -> None:
    """Give a getitem node exactly the placement the plan chose for it.

    A getitem is a variable of its own in the solve: it may differ from its producer's
    output (a redistribution right after the getitem), so the one menu entry the
    producer's single strategy implies is not always the plan's; the plan's is rebuilt
    from the per-axis 1-D getitem menus, as for every other node."""
    np_ = plan.nodes.get(c.name)
    if np_ is None:
        raise PlanMismatchError(f"the plan has no strategy for node {c.name} of this model's joint graph; re-plan")
    want = list(np_.output_placements)
    if not c.specs or any(spec_placement_strs(s)[0] == want for s in c.specs):
        return  # no tensor here (refused by the plan check), or the producer's own placement
    (tokens,) = _axis_tokens(want)
    placements = []
    for a, cands in enumerate(axis_cands):
        found = next((s.output_specs.placements[0] for s in cands.nodes[c.name].specs
                      if spec_placement_strs(s)[0] == [f"({tokens[a]})"]), None) if tokens else None
        if found is None:
            raise PlanMismatchError(
                f"plan node {c.name} (getitem): its placement {want} is not one of this graph's on mesh axis {a}; "
                "the plan was made for a different model or mesh: re-plan")
        placements.append(found)
    meta = c.specs[0].output_specs.tensor_meta
    mesh = c.specs[0].output_specs.mesh
    pinned = make_spec(mesh, tuple(placements), meta)
    c.specs = [T.OpSpec(pinned, [make_spec(mesh, tuple(placements), meta)])]


def _unseeded_vars_estimate(axes: list[tuple[Candidates, list[int], Any]]) -> int:
    """Strategy + edge variables the unseeded D-dim problem would have (per-axis products of
    the 1-D menu and class counts: an upper bound, before divisibility filtering)."""
    p0 = axes[0][2]
    total = 0
    for g in p0.groups:
        prod = 1
        for cands, _, prob in axes:
            prod *= len(cands.nodes[g[0]].specs)
        total += prod
    per_axis = []
    for _, _, prob in axes:
        d = {}
        for e in prob.edges:
            for m in e.members:
                d[m] = e.cost.shape
        per_axis.append(d)
    for e in p0.edges:
        m = e.members[0]
        prod = 1
        for d in per_axis:
            shp = d.get(m)
            prod *= shp[0] * shp[1] if shp else e.cost.size
        total += prod
    return int(total)


def use_seeding(mesh_ndim: int, seed: bool | None) -> bool:
    return mesh_ndim >= SEED_FROM_NDIM if seed is None else bool(seed)


__all__ = ["DEFAULT_RADIUS", "FULL_MENU_MAX", "SEED_FROM_NDIM", "SeedInfo", "hamming_ball", "plan_candidates",
           "project_constraint", "seeded_candidates", "solve_axes", "use_seeding"]
