"""The mesh search with pipelines: pipelined candidates at the job's global batch, priced by their
stage plans and ranked with the rest; TorchTitan's recipe shapes priced beside the pick.

Planning tests use a two-layer LLaMA of width 64 on a fake world of 4 ranks (h100 profile),
in-process (workers=1).
"""

import dataclasses

import pytest

from parallel.auto.plan.pipeline_html import simulated_step_us
from parallel.auto.search.mesh_search import degrees_of, search_points, search_with_recipes
from parallel.auto.search.mesh_space import parse_mesh
from parallel.auto.search.pipeline_points import pipeline_meshes, pipeline_settings
from parallel.auto.search.point import PlanCache
from parallel.auto.search.recipe_shapes import compare_line, recipe_shapes
from parallel.auto.search.screen import REFINE_TOP, fsdp_parent, refinements, screen_request, unrefined_row
from trainer.auto_mode import base_job
from trainer.config import load_config

JOB = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--model.ffn_hidden_dim", "128", "--model.vocab_size", "256", "--training.seq_len", "32",
       "--training.local_batch_size", "2", "--training.global_batch_size", "8"]


def _job():
    return base_job(load_config("llama3_debug_auto", JOB, validate=False))


def test_pipelined_candidates_split_the_global_batch():
    points = search_points(_job(), 4, "h100", pipelines=True)
    piped = [p for p in points if p.pipeline is not None]
    assert {p.mesh.label for p in piped} == {"pp=2,dp_shard=2", "pp=2,tp=2"}  # 2 blocks + 2 units: at most pp 2
    assert {p.pipeline.schedule for p in piped} == {"1F1B", "Interleaved1F1B"}
    for p in piped:  # every data rank's share of the global batch, cut into the microbatches
        assert p.local_batch_size * p.pipeline.n_microbatches * p.data_degree == 8
        assert p.pipeline.n_microbatches in (2, 4) and p.micro_batches == 1 and not p.reject
    assert len({p.index for p in points}) == len(points)
    # by default pipelines are searched only where the world spans nodes (h100: 8 a node)
    assert not any(p.pipeline for p in search_points(_job(), 4, "h100"))


def test_pipeline_meshes_keep_tp_in_a_node_and_two_units_a_stage():
    labels = [s.label for s in pipeline_meshes(512, 8, 126)]
    assert "pp=8,dp_shard=8,tp=8" in labels and "pp=16,dp_shard=4,tp=8" in labels and "pp=2,dp_shard=256" in labels
    for s in pipeline_meshes(512, 8, 126):
        assert s.names[0] == "pp" and s.world == 512 and s.degree("tp") <= 8 and "cp" not in s.names
    assert {s.degree("pp") for s in pipeline_meshes(512, 8, 6)} == {2, 4}  # 8 units: at most 4 stages of two


def test_recipe_shapes_as_torchtitan_publishes_them():
    def shapes(flavor, world):
        return [(r.name, r.mesh.label, r.preset, r.schedule) for r in recipe_shapes("llama3", flavor, world)]

    assert shapes("405B", 512) == [
        ("FSDP", "dp_shard=512", "fsdp", ""), ("FSDP·TP8", "dp_shard=64,tp=8", "fsdp_tp", ""),
        ("FSDP8·TP8·PP8 Interleaved1F1B", "pp=8,dp_shard=8,tp=8", "fsdp_tp", "Interleaved1F1B")]
    assert shapes("70B", 64) == [("FSDP", "dp_shard=64", "fsdp", ""), ("FSDP·TP8", "dp_shard=8,tp=8", "fsdp_tp", "")]
    assert shapes("8B", 64) == [("FSDP", "dp_shard=64", "fsdp", "")]


def test_a_pipelined_pick_sets_the_pipeline_keys():
    row = {"mesh": "pp=4,dp_shard=8,tp=8", "pipeline": "Interleaved1F1B x8", "schedule": "Interleaved1F1B",
           "local_batch": 2, "micro_batches": 8}
    assert degrees_of(row) == {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 8,
                               "tensor_parallel_degree": 8, "context_parallel_degree": 1, "pipeline_parallel_degree": 4}
    assert pipeline_settings(row) == {"pipeline_parallel_schedule": "Interleaved1F1B",
                                      "pipeline_parallel_microbatch_size": 2}
    assert pipeline_settings({"mesh": "dp_shard=4"}) == {}


@pytest.mark.slow  # plans 14 meshes and 8 pipelined points of a 2-layer model, and the FSDP recipe shape
def test_the_search_prices_pipelines_with_the_rest(tmp_path, capsys):
    from tools import plan as plan_script

    cache = PlanCache(tmp_path / "cache")
    # as a user runs it: the ranked table, the recipe shape beside the pick, the pick's plan written
    assert plan_script.main(["--config", "llama3_debug_auto", *JOB, "--mesh", "auto", "--world-size", "4",
                             "--hardware", "h100", "--pipelines", "--workers", "1", "--cache-dir", str(cache.folder),
                             "--out", str(tmp_path / "best.json")]) == 0
    printed = capsys.readouterr().out
    assert "| pp=2,dp_shard=2 | 1F1B x2 |" in printed and "TorchTitan's recipe shapes" in printed
    assert "FSDP (dp_shard=4): " in printed and "best mesh: " in printed and (tmp_path / "best.json").exists()
    found = search_with_recipes(_job(), 4, "h100", workers=1, cache=cache, pipelines=True, out=lambda s: None)
    assert all(r["cached"] for r in found.rows if r["rank"] != "-")  # the script's plans, read back
    rows, recipes = found.rows, found.recipes
    assert not found.screened and found.best is rows[0]  # 4 devices: planned in full, no screen
    ranked = [r for r in rows if r["rank"] != "-"]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    steps = [r["step_ms"] for r in ranked]
    assert steps == sorted(steps)  # one global batch for all: ranked by the step
    piped = [r for r in ranked if r.get("pipeline")]
    assert len(piped) == 8 and len(ranked) > len(piped)  # planned and ranked with the meshes without pp
    for r in piped:
        plan = cache.pipeline_plan(r["key"])
        assert plan is not None and plan.schedule == r["schedule"] and plan.n_microbatches == r["micro_batches"]
        assert r["step_ms"] * 1e3 == pytest.approx(plan.step_us)
        assert len(plan.stages) == (2 if r["schedule"] == "1F1B" else 4)
        # the price holds the schedule's bubble: a simulation of 1F1B (an independent walk of the
        # microbatches through the stages; looped schedules are not simulated) never takes longer
        simulated = simulated_step_us(plan)
        if r["schedule"] == "1F1B":
            assert simulated is not None and 0 < simulated <= plan.step_us * (1 + 1e-9)
        assert r["bubble_ms"] > 0
    # more microbatches of the same mesh and schedule: a smaller bubble each
    by = {(r["mesh"], r["schedule"], r["micro_batches"]): r for r in piped}
    for (mesh, schedule, n), r in by.items():
        if n == 4:
            assert r["bubble_ms"] < by[(mesh, schedule, 2)]["bubble_ms"]
    # the recipe shape (FSDP on dp_shard=4) is planned under its preset: every block weight FSDP-gathered
    (shape, row), = recipes
    assert shape.name == "FSDP" and row["status"] == "ok" and row["preset"] == "fsdp"
    assert "dp_shard: FSDP (all-gather)" in row["summary"] and "data parallel" not in row["summary"]
    best = next(r for r in rows if r["rank"] == 1)
    assert f"{row['step_ms'] / best['step_ms']:.2f}x faster" in compare_line(best, recipes)
    # the free plan of the same mesh may choose the recipe's placements: it is never predicted slower
    free = next(r for r in rows if r["mesh"] == "dp_shard=4")
    assert free["step_ms"] <= row["step_ms"] * (1 + 1e-6)


def test_the_screen_is_a_cheaper_request_of_the_same_cost_model():
    job = _job()
    fast = screen_request(job.request)
    assert job.request.planner.memory_estimate and job.request.runtime.ac_mode == "auto"
    assert fast.planner.solver == "mrf" and not fast.planner.memory_estimate and fast.runtime.ac_mode == "full"
    # what prices a plan is unchanged: hardware, shapes, precision, the rest of the runtime
    assert fast.planner.hardware == job.request.planner.hardware and fast.mp_policy == job.request.mp_policy
    assert (fast.local_batch_size, fast.seq_len) == (job.request.local_batch_size, job.request.seq_len)
    assert fast.runtime.overlap == job.request.runtime.overlap
    exact = job.request.planner.replace(solver="ilp")  # a solver the job names is kept
    assert screen_request(dataclasses.replace(job.request, planner=exact)).planner.solver == "ilp"


@pytest.mark.slow  # screens the meshes of 8 devices (4 of them HSDP) and plans the 2 leaders in full
def test_a_screened_search_plans_its_leaders_in_full(tmp_path):
    found = search_with_recipes(_job(), 8, "h100", workers=1, cache=PlanCache(tmp_path / "cache"), pipelines=False,
                                screen=True, verify=2, out=lambda s: None)
    assert found.screened
    screened = {r["mesh"]: r for r in found.rows}
    assert {r["ac_mode"] for r in found.rows} == {"full"}  # the job's "auto" fixed for the screen
    # HSDP meshes are screened only as refinements of the first: of each leading FSDP parent's HSDP
    # meshes, the one whose replica (the mesh without dp_replicate) is nearest a node of 8 (on 8
    # devices: the largest); the rest say why
    hsdp = [parse_mesh(m) for m in screened if "dp_replicate" in m]
    top = [r["mesh"] for r in found.rows if r["rank"] != "-" and "dp_replicate" not in r["mesh"]][:REFINE_TOP]
    expected = set()
    for parent in top:
        kids = [m for m in hsdp if fsdp_parent(m).label == parent]
        if kids:
            expected.add(max(kids, key=lambda m: m.world // m.degree("dp_replicate")).label)
    planned = {m.label for m in hsdp if not screened[m.label]["status"].startswith("not screened")}
    assert planned == expected, (planned, expected)  # here none: no leader has a data axis
    assert all(screened[m.label]["status"].startswith("not screened") for m in hsdp if m.label not in planned)
    # the two leaders are planned again with the job's whole request: its recomputation choice, its estimate
    leaders = [r["mesh"] for r in found.rows if r["rank"] != "-"][:2]
    assert sorted(r["mesh"] for r in found.verified) == sorted(leaders)
    assert {r["ac_mode"] for r in found.verified} == {"auto"} and {r["mem_kind"] for r in found.verified} == {"peak"}
    assert found.best is found.verified[0] and found.best["rank"] == 1
    (shape, full), = found.verified_recipes
    assert shape.name == "FSDP" and full["ac_mode"] == "auto" and full["status"] == "ok"


def test_an_hsdp_refinement_per_leader_its_replica_a_node():
    job = base_job(load_config("llama3_405b_h100", [], validate=False))
    later = [p for p in search_points(job, 512, "h100", pipelines=False) if fsdp_parent(p.mesh) is not None]
    leaders = ["dp_shard=128,tp=4", "cp=128,tp=4", "dp_shard=64,tp=8"]
    chosen, skipped = refinements(later, [{"mesh": m, "rank": i + 1} for i, m in enumerate(leaders)], gpus_per_node=8)
    # dp_shard=128,tp=4 has six HSDP children (dp_replicate 2 .. 64): a replica of 2 x 4 is a node;
    # cp=128,tp=4 has none; dp_shard=64,tp=8's smallest replica is two nodes (dp_shard 2 x tp 8)
    assert sorted(p.mesh.label for p in chosen) == ["dp_replicate=32,dp_shard=2,tp=8",
                                                    "dp_replicate=64,dp_shard=2,tp=4"]
    assert len(chosen) + len(skipped) == len(later)
    why = {p.mesh.label: unrefined_row(p, chosen)["status"] for p in skipped}
    assert "only dp_replicate=64,dp_shard=2,tp=4 is screened" in why["dp_replicate=2,dp_shard=64,tp=4"]
    assert "not among the screen's" in why["dp_replicate=2,dp_shard=256"]
