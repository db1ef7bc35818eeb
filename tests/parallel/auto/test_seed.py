"""Split-dimension seeding: Hamming balls, restricted enumeration, seeded plans, solver choice."""

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from models import build_model
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.candidates.enumeration import OpEnumerator
from parallel.auto.candidates.placements import strategy_key as _key
from parallel.auto.candidates.strategies import build_candidates
from parallel.auto.config import PlannerConfig
from parallel.auto.cost import CostModel
from parallel.auto.problem.formulation import build_problem
from parallel.auto.problem.placement_problem import Constraint, min_parameter_fraction
from parallel.auto.solve import choose_solver, solve
from parallel.auto.solve.seed import FULL_MENU_MAX, hamming_ball, project_constraint, seeded_candidates, solve_axes
from parallel.auto.trace.joint import trace_joint

TINY = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, ffn_hidden_dim=128)


def _inputs():
    return (torch.zeros(8, 16, dtype=torch.long),) * 2


@pytest.fixture(scope="module")
def jg():
    return trace_joint(build_model("llama3", "debug", device="meta", **TINY), _inputs(), lm_loss)


def test_hamming_ball():
    options = [list("abc"), list("wxyz"), list("pq")]
    seed = [0, 1, 1]
    assert hamming_ball(options, seed, 0) == [(0, 1, 1)]
    r1 = hamming_ball(options, seed, 1)
    assert r1[0] == tuple(seed) and len(r1) == 1 + 2 + 3 + 1
    r2 = hamming_ball(options, seed, 2)
    assert len(r2) == len(set(r2)) == 1 + 6 + (2 * 3 + 2 * 1 + 3 * 1)
    assert all(sum(a != b for a, b in zip(t, seed)) <= 2 for t in r2)
    assert len(hamming_ball(options, seed, 3)) == 3 * 4 * 2  # the whole product


def test_project_constraint():
    con = Constraint("input", "input 0", node="x", placements=(Shard(0), Replicate(), Shard(1)))
    assert project_constraint(con, 2).placements == (Shard(1),)
    assert "mesh axis 2" in project_constraint(con, 2).description


@pytest.mark.slow  # plans on a fake 2x2/3-D world: 12-43 s here
def test_radius_covering_the_mesh_gives_the_full_problem(jg):
    """On 2-D, radius 2 covers every per-axis combination: same menus, same optimum."""
    shape, names = (2, 2), ("dp", "tp")
    with fake_world(4):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        cm = CostModel("h100", shape, names)
        full = build_candidates(jg, mesh)
        seeded, info = seeded_candidates(jg, mesh, cm, radius=2)
    assert info.radius == 2 and len(info.axes) == 2
    assert info.axes[1]["reused_from"] == 0  # equal axes: one 1-D problem
    for name, c in seeded.nodes.items():
        if c.kind == "op" and "embedding" in str(c.node.target):
            continue  # _MaskPartial compares by identity of its mask buffer
        assert {_key(s) for s in c.specs} == {_key(s) for s in full.nodes[name].specs}, name
    hi = 0.25
    a = solve(build_problem(full, cm, memory_high=hi), "ilp")
    b = solve(build_problem(seeded, cm, memory_high=hi), "ilp")
    assert b.objective == pytest.approx(a.objective, rel=1e-9)


@pytest.mark.slow
def test_3d_enumeration_is_restricted_to_the_ball(jg, monkeypatch):
    shape, names = (2, 2, 2), ("dp", "cp", "tp")
    with fake_world(8):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        cm = CostModel("h100", shape, names)
        axes, _ = solve_axes(jg, mesh, cm)
        # the D-dim build must never expand DTensor's full mesh product
        real = OpEnumerator._single_dim

        def guarded(self, *a, **k):
            assert len(self.mesh_shape) == 1, "full mesh expansion on a seeded mesh"
            return real(self, *a, **k)

        monkeypatch.setattr(OpEnumerator, "_single_dim", guarded)
        for radius in (1, 2):
            cands, info = seeded_candidates(jg, mesh, cm, radius=radius)
            m = max(len({_key(s) for s in c.specs}) for c in axes[0][0].nodes.values()) - 1
            full_nodes = 0
            for name, c in cands.nodes.items():
                if c.kind not in ("op", "placeholder", "slot"):
                    continue
                product = math.prod(len(o) for o in info.options[name])
                if product <= FULL_MENU_MAX:  # small menus: the whole per-axis product
                    assert len(c.specs) <= product
                    full_nodes += c.kind == "placeholder" and len(c.specs) == product
                    continue
                assert len(c.specs) <= 1 + 3 * m + (3 * m * m if radius == 2 else 0) < m ** 3
                seed = []
                for cands1, labels, prob in axes:
                    c1 = cands1.nodes[name]
                    seed.append(_key(c1.specs[labels[prob.group_of[name]]]))
                for s in c.specs:
                    k = _key(s)
                    if c.source == "replicate_fallback":
                        continue
                    dist = sum(_axis(k, a) != _axis(seed[a], 0) for a in range(3))
                    assert dist <= radius, (name, k, seed)
            assert full_nodes > 0  # e.g. every weight: (R, S(0), S(1)) on each axis -> 27 strategies


def _axis(key, a):
    o, ins = key
    outs = o if (o and (isinstance(o[0], tuple) or o[0] is None)) else (o,)
    return (tuple(None if x is None else repr(x[a]) for x in outs), tuple(repr(i[a]) for i in ins))


@pytest.fixture(scope="module")
def seeded_3d():
    """One seeded 3-D plan (the API's default path, two seeding rounds) for the tests of this
    module that need any seeded plan: planning it takes ~35 s here, so it is made once."""
    model = build_model("llama3", "debug", device="meta", **TINY)
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        # seeding is asserted here, not the peak; 2 s per MRF run: the unbounded objectives in 2/3 of the time
        with AutoParallel(model, _inputs, mesh, loss_fn=lm_loss,
                          planner=PlannerConfig(solver="mrf", split_seeding_rounds=2, time_limit=2.0,
                                                memory_estimate=False)) as autop:
            enumerated_up_front = autop.candidates is not None
            p = (Shard(0), Replicate(), Replicate())
            autop.add_input_constraints([p, p])
            plan = autop.optimize_placement(verbose=False)
            graph = autop.graph  # released when the context exits
    return {"plan_json": plan.to_json(), "plan": plan, "seed_info": autop.seed_info, "graph": graph,
            "enumerated_up_front": enumerated_up_front}


def _seeded_plan(seeded_3d):
    """A fresh copy of the shared seeded plan (a test may change it)."""
    from parallel.auto.plan import Plan

    return Plan.from_json(seeded_3d["plan_json"])


@pytest.mark.slow  # plans on a fake 3-D world: ~35 s here (shared with the saved-plan tests below)
def test_api_seeds_3d_by_default_and_solver_choice(seeded_3d):
    model = build_model("llama3", "debug", device="meta", **TINY)
    plan, seed_info = seeded_3d["plan"], seeded_3d["seed_info"]
    assert not seeded_3d["enumerated_up_front"]  # no full 3-D enumeration up front
    assert seed_info is not None and "seed" in plan.timings
    assert seed_info.rounds == 2 and "reseed" in plan.timings  # one re-seeding round ran
    assert plan.solver == "mrf"
    assert plan.param_placements()  # every parameter placed
    with pytest.raises(ValueError, match="unknown solver"):
        AutoParallel(model, _inputs, None, planner=PlannerConfig(solver="gurobi"))


def test_auto_choice_threshold(jg):
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        cands = build_candidates(jg, mesh)
        prob = build_problem(cands, CostModel("h100", (2,), ("dp",)), memory_high=min_parameter_fraction(cands))
    assert choose_solver(prob, "auto")[0] == "ilp"
    assert choose_solver(prob, "auto", max_ilp_edge_vars=10)[0] == "mrf"
    assert choose_solver(prob, "highs")[0] == "ilp"
    assert math.isfinite(solve(prob, "auto", max_ilp_edge_vars=10).objective)


def test_config_rejects_unknown_solver():
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="solver"):
        load_config("llama3_debug", ["--parallelism.solver", "gurobi"])


@pytest.mark.slow  # plans on a fake 2x2/3-D world: 12-43 s here
def test_saved_plan_applies_on_a_seeded_mesh_without_solving(tmp_path, seeded_3d):
    """A 3-D plan loaded from a file (or received from rank 0) is materialised without
    enumerating the full 3-D menus: each node gets exactly the saved strategy."""
    from parallel.auto.candidates.placements import placement_str
    from parallel.auto.plan import Plan

    shape, names = (2, 2, 2), ("dp", "cp", "tp")
    plan = _seeded_plan(seeded_3d)  # any seeded plan serves here (input batch-sharded on dp)
    # a getitem is solved on its own: it may take another placement than its producer gives
    # (a redistribution right after it); the saved choice must be kept, not the producer's
    # (getitem_5 holds a batch-first tensor: both placements below are in its 1-D menus)
    other = {"(R, R, R)": "(S(0), S(0), S(0))"}.get(plan.nodes["getitem_5"].output_placements[0], "(R, R, R)")
    plan.nodes["getitem_5"].output_placements = plan.nodes["getitem_5"].input_placements = [other]
    with fake_world(8):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        path = tmp_path / "plan.json"
        plan.save(str(path))
        model = build_model("llama3", "debug", device="meta", **TINY)
        with AutoParallel(model, _inputs, mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="h100")) as autop:
            assert autop.candidates is None  # seeded mesh: nothing enumerated before solving
            pm = autop.apply_placement(Plan.load(str(path), model=model, mesh=mesh))
            assert all(len(c.specs) == 1 for c in autop.candidates.nodes.values() if c.kind != "getitem")
    runner = pm.plan_runner
    assert set(runner.spec) == set(plan.nodes)
    for name, spec in runner.spec.items():
        outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        assert ([placement_str(o.placements) if o is not None else "-" for o in outs]
                == plan.nodes[name].output_placements)
        if plan.nodes[name].kind != "placeholder":
            assert [placement_str(i.placements) for i in spec.input_specs] == plan.nodes[name].input_placements
    params = plan.param_placements()
    assert {n: placement_str(p.placements) for n, p in pm.named_parameters()} == params


@pytest.mark.slow  # plans on a fake 2x2/3-D world: 12-43 s here
def test_saved_placements_no_axis_menu_has_are_refused_on_a_seeded_mesh(seeded_3d):
    from parallel.auto.plan import PlanMismatchError
    from parallel.auto.solve.seed import plan_candidates

    shape, names = (2, 2, 2), ("dp", "cp", "tp")
    plan = _seeded_plan(seeded_3d)  # any seeded plan serves here
    with fake_world(8):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        wq = next(n for n, p in plan.nodes.items() if p.label == "param layers.0.attention.wq.weight")
        plan.nodes[wq].output_placements = ["(S(7), R, R)"]  # no such dim
        with pytest.raises(PlanMismatchError, match="layers.0.attention.wq.weight"):
            plan_candidates(seeded_3d["graph"], mesh, plan)


@pytest.mark.slow
def test_a_deeper_copy_on_the_same_mesh_reuses_the_restricted_menus(jg, monkeypatch):
    """The mesh search's shallow copies (2 and 3 blocks) ask for the same seeded balls: the
    second build on that mesh takes them from the mesh's shared cache by value, and its
    candidates and coverage are those of a build on a fresh mesh object."""
    deeper = trace_joint(build_model("llama3", "debug", device="meta", **{**TINY, "n_layers": 3}), _inputs(), lm_loss)
    shape, names = (2, 2, 2), ("dp", "cp", "tp")
    real = OpEnumerator._restricted_uncached
    asked: list[str] = []

    def counted(self, node, keys):
        asked.append(node.name)
        return real(self, node, keys)

    monkeypatch.setattr(OpEnumerator, "_restricted_uncached", counted)
    with fake_world(8):
        cm = CostModel("h100", shape, names)
        fresh_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        alone, _ = seeded_candidates(deeper, fresh_mesh, cm, radius=1)
        asked_alone = len(asked)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        seeded_candidates(jg, mesh, cm, radius=1)
        asked.clear()
        after, _ = seeded_candidates(deeper, mesh, cm, radius=1)
    assert asked_alone > 0 and len(asked) < asked_alone / 2, (len(asked), asked_alone)
    assert set(after.nodes) == set(alone.nodes)
    for name, c in after.nodes.items():
        assert [_key(s) for s in c.specs] == [_key(s) for s in alone.nodes[name].specs], name
    assert (after.coverage.dropped_strided, after.coverage.dropped_uneven) == \
        (alone.coverage.dropped_strided, alone.coverage.dropped_uneven)
