"""Sweep specs (validation, expansion), the plan cache, failing points, mesh search ranking.

Planning tests use a one-layer LLaMA of width 64 on fake worlds of 2 ranks (h100 profile),
in-process (workers=1): a few seconds each.
"""

import pytest

from parallel.auto.cost import load_hardware
from parallel.auto.search import point as sweep_point
from parallel.auto.search import spec as sweep_spec
from parallel.auto.search.mesh_search import degrees_of, rank_rows, ranked_table, search_meshes, search_points
from parallel.auto.search.point import PlanCache, point_key
from parallel.auto.search.report import PREDICTED_NOTE, markdown_table, svg_picture, write_csv, write_markdown
from parallel.auto.search.run import Progress, run_points
from parallel.auto.search.spec import SweepSpecError, more_micro_batches, with_global_batch
from trainer.auto_mode import base_job, load_base_job
from trainer.config import ConfigError, load_config


def load_sweep(spec: str):
    """A spec whose base job the trainer reads (as scripts/sweep.py loads it)."""
    return sweep_spec.load_sweep(spec, load_base_job)

TINY = """
[sweep]
name = "tiny"
config = "llama3_debug"
[axes]
hardware = "h100"
n_layers = 1
dim = 64
n_heads = 4
n_kv_heads = 2
ffn_hidden_dim = 128
seq_len = 32
local_batch_size = 1
"""


def spec_file(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def quiet():
    return Progress(0, out=lambda s: None)


@pytest.mark.parametrize("extra, match", [
    ("[axes]\nworld_size = [4]\nbogus = 3", r"s\.toml: unknown key 'axes\.bogus' = 3; keys of \[axes\]: model, flavor"),
    ("[sweep]\nnmae = 'x'\n[axes]\nworld_size = [4]", r"unknown key 'sweep\.nmae' = 'x'; keys of \[sweep\]: name"),
    ("[axes]\nworld_size = [8, 12]\nhardware = 'h100'",
     r"'axes\.world_size' has the value 12 \(h100\): world size 12 is not a whole number of nodes of 8"),
    ("[axes]\nmesh = ['3x4']\nhardware = 'h100'",
     r"'axes\.mesh' has the value '3x4' \(h100\): world size 12 is not a whole number of nodes of 8"),
    ("[axes]\nworld_size = [4]\nhardware = 'h100'\nseq_len = [128, 4096]",
     r"'axes\.seq_len' has the value 4096: llama3/debug takes at most max_seq_len = 2048"),
    ("[axes]\nworld_size = [4]\nhardware = 'h100'\nmesh = ['2x4']",
     r"'axes\.mesh' has the value '2x4' \(8 devices\), not one of"),
    ("[axes]\nworld_size = [4]\nac_mode = 'some'", r"'axes\.ac_mode' has the value 'some': must be one of none"),
    ("[axes]\nworld_size = [4]\nmemory_budget_high = ['1/0']", r"memory_budget_high' has the value '1/0'"),
    ("[axes]\nworld_size = [4]\nflavor = '9B'", r"'axes\.flavor' has the value '9B': no such flavor of llama3"),
    ("[axes]\nhardware = 'h100'\nseq_len = 64", r"names neither world_size nor mesh"),
    ("[axes]\nworld_size = [4]\nhardware = 'auto'", r"'axes\.hardware' has the value 'auto'"),
])
def test_spec_errors_name_file_key_value(tmp_path, extra, match):
    text = ("[sweep]\nconfig = 'llama3_debug'\n" if "[sweep]" not in extra else "") + extra
    if "config" not in text:
        text = text.replace("[sweep]", "[sweep]\nconfig = 'llama3_debug'", 1)
    with pytest.raises(SweepSpecError, match=match):
        load_sweep(spec_file(tmp_path, text))


def test_expansion_is_the_cartesian_product(tmp_path):
    text = TINY.replace("seq_len = 32\nlocal_batch_size = 1", "seq_len = [32, 64]\nlocal_batch_size = [1, 2]")
    spec = load_sweep(spec_file(tmp_path, text + "world_size = [4, 8]\nmesh = ['auto', '2x2']\n"))
    # meshes of 4 on a node of 8: 4 (dp_shard=4, tp=4, dp_shard=2,tp=2, dp_replicate=2,dp_shard=2) + the explicit 2x2
    # (the same as dp_shard=2,tp=2, planned again under its own index); 8: 7 meshes
    assert len(spec.points) == (4 + 1 + 7) * 2 * 2
    assert [p.index for p in spec.points] == list(range(len(spec.points)))
    assert spec.x == "world_size"
    p = spec.points[0]
    assert dict(p.model_args) == {"n_layers": 1, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden_dim": 128}
    assert {q.global_batch for q in spec.points if q.mesh.label == "tp=4"} == {1, 2}  # tp alone: one batch


def test_shipped_specs_expand():
    assert len(load_sweep("llama3_8b_meshes100").points) == 100
    assert [p.mesh.world for p in load_sweep("llama3_8b_ladder").points] == [8, 16, 32, 64, 128]
    t7 = load_sweep("llama3_70b_table7").points
    assert [p.memory_high for p in t7] == [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]


@pytest.mark.slow
def test_cache_hit_replans_nothing_and_trace_is_reused(tmp_path, monkeypatch):
    spec = load_sweep(spec_file(tmp_path, TINY + "mesh = '2'\nmemory_budget_high = ['1/2', 1.0]\n"))
    cache = PlanCache(tmp_path / "cache")
    rows = run_points(spec.points, workers=1, cache=cache, progress=quiet())
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert [r["cached"] for r in rows] == [False, False]
    assert rows[1]["trace_reused"] and not rows[0]["trace_reused"]  # same model and shapes, another budget: one trace
    assert rows[0]["tokens_per_s"] == pytest.approx(2 * 32 / (rows[0]["objective_us"] * 1e-6))
    assert 0 < rows[0]["mfu"] < 1 and rows[0]["mem_kind"] == "peak" and rows[0]["oom"] is False
    assert cache.plan(rows[0]["key"]).objective_us == rows[0]["objective_us"]

    def boom(point):
        raise AssertionError("planned again")

    monkeypatch.setattr(sweep_point, "_plan_and_row", boom)
    again = run_points(spec.points, workers=1, cache=cache, progress=quiet())
    assert [r["cached"] for r in again] == [True, True]
    assert [r["step_ms"] for r in again] == [r["step_ms"] for r in rows]


@pytest.mark.slow  # plans two points, then each again alone
def test_points_on_one_mesh_share_candidates_pricing_and_warm_starts(tmp_path, monkeypatch):
    """Two budgets on one 2x2 mesh (a tight one, then the full memory): one enumeration, one
    pricing, the second solve warm-started from the point before, and each point's plan the one
    it gets planned alone."""
    from parallel.auto import api
    from parallel.auto.candidates import strategies
    from parallel.auto.problem import formulation

    budgets = "mesh = 'dp_shard=2,tp=2'\nmemory_budget_high = ['1/4', 1.0]\n"
    spec = load_sweep(spec_file(tmp_path, TINY + budgets))
    calls = {"enumerated": 0, "priced": 0, "starts": []}

    def counted(name, real):
        def wrapper(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return wrapper

    monkeypatch.setattr(strategies, "build_candidates", counted("enumerated", strategies.build_candidates))
    monkeypatch.setattr(formulation, "decision_groups", counted("priced", formulation.decision_groups))
    real_solve = api.solve

    def solve(prob, *a, start=None, **kw):
        calls["starts"].append(start is not None)
        return real_solve(prob, *a, start=start, **kw)

    monkeypatch.setattr(api, "solve", solve)
    shared_cache = PlanCache(tmp_path / "shared")
    shared = run_points(spec.points, workers=1, cache=shared_cache, progress=quiet())
    assert [r["status"] for r in shared] == ["ok"] * 2
    assert calls["enumerated"] == 1 and calls["priced"] == 1
    assert calls["starts"][0] is False and all(calls["starts"][1:]) and len(calls["starts"]) >= 2

    alone_cache = PlanCache(tmp_path / "alone")
    for p, row in zip(spec.points, shared):
        sweep_point._TRACES.clear()
        sweep_point._NEIGHBOURS.clear()
        mine = sweep_point.plan_point(p, alone_cache)
        assert mine["objective_us"] == pytest.approx(row["objective_us"], rel=1e-9)
        assert alone_cache.plan(mine["key"]).placement_digest() == shared_cache.plan(row["key"]).placement_digest()
        assert mine["mem_gib"] == row["mem_gib"]
    assert calls["enumerated"] == 3  # planned alone: one enumeration each


def test_the_longest_points_are_handed_out_first(tmp_path):
    """A worker handed the 3-D mesh last would finish long after the other: heaviest first."""
    from parallel.auto.search import run

    meshes = "mesh = ['2', 'dp_shard=2,tp=2', 'dp_replicate=2,dp_shard=2,tp=2', 'tp=2']\n"
    spec = load_sweep(spec_file(tmp_path, TINY + meshes))
    groups = run._groups(spec.points, workers=2)
    assert sorted(p.index for g in groups for p in g) == [0, 1, 2, 3]
    assert [len(g[0].mesh.shape) for g in groups] == [3, 2, 1, 1]


def test_failing_point_is_a_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    spec = load_sweep(spec_file(tmp_path, TINY + "mesh = ['2', 'tp=2']\n"))
    real = sweep_point._plan_and_row

    def flaky(point):
        if point.index == 0:
            raise RuntimeError("planner exploded")
        return real(point)

    monkeypatch.setattr(sweep_point, "_plan_and_row", flaky)
    rows = run_points(spec.points, workers=1, cache=PlanCache(tmp_path / "c"), progress=quiet())
    assert rows[0]["status"] == "error: RuntimeError: planner exploded" and rows[0]["step_ms"] is None
    assert rows[1]["status"] == "ok"
    table = markdown_table(rows)
    assert "error: RuntimeError: planner exploded" in table and table.count("\n") == 3
    write_csv(rows, tmp_path / "rows.csv")
    assert (tmp_path / "rows.csv").read_text().count("\n") == 3
    svg = svg_picture(rows, "mesh", "t")
    assert svg.startswith("<svg") and svg.count("<circle") == 2  # one point per panel: the failed one has none


TINY_JOB = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
            "--model.ffn_hidden_dim", "128", "--training.seq_len", "32", "--training.local_batch_size", "2"]


@pytest.mark.slow  # plans 3 meshes, then 3 more under a tiny memory limit
def test_mesh_search_ranks_and_drops(tmp_path):
    cfg = load_config("llama3_debug_auto", TINY_JOB, validate=False)
    cache = PlanCache(tmp_path / "cache")
    rows = search_meshes(base_job(cfg), 2, "h100", workers=1, cache=cache, out=lambda s: None)
    assert sorted(r["mesh"] for r in rows) == ["cp=2", "dp_shard=2", "tp=2"]  # cp: seq 32 splits in 2 x 2 chunks
    assert [r["rank"] for r in rows] == [1, 2, 3]
    by = {r["mesh"]: r for r in rows}
    # one global batch (local 2 x world 2) for every mesh: local batch = 4 / its data degree
    assert {r["global_batch"] for r in rows} == {4}
    assert (by["dp_shard=2"]["local_batch"], by["tp=2"]["local_batch"], by["cp=2"]["local_batch"]) == (2, 4, 4)
    # tp=2 beats dp_shard=2 at this size: on the h100 profile every kernel of this 64-wide model costs its launch
    # floor, so halving the batch saves no compute; tp=2's inputs are replicated and its plan replicates the whole
    # step (no collective), while dp_shard=2 must all-reduce its gradients. The old ranking (tokens/s at each mesh's
    # own global batch: dp_shard=2 stepped twice the tokens) put dp_shard=2 first.
    print("ranked:", [(r["mesh"], round(r["step_ms"], 4), r["compute_us"], r["comm_us"]) for r in rows])
    assert by["tp=2"]["comm_us"] == 0 < by["dp_shard=2"]["comm_us"]
    assert by["tp=2"]["compute_us"] == pytest.approx(by["dp_shard=2"]["compute_us"], rel=0.01)
    order = [r["mesh"] for r in rows]
    assert order.index("tp=2") < order.index("dp_shard=2")
    assert degrees_of(rows[0])["data_parallel_shard_degree"] * degrees_of(rows[0])["tensor_parallel_degree"] == 2
    assert degrees_of(by["cp=2"])["context_parallel_degree"] == 2
    tiny = load_hardware("h100").replace(memory_bytes=1024, memory_limit_bytes=1024)  # nothing fits in 1 KiB
    dropped = search_meshes(base_job(cfg), 2, tiny, workers=1, cache=cache, out=lambda s: None)
    assert [r["rank"] for r in dropped] == ["-"] * 3 and {r["status"] for r in dropped} == {"OOM"}
    # more micro-batches were tried before giving up: down to one sample per micro-batch
    assert {r["mesh"]: (r["local_batch"], r["micro_batches"]) for r in dropped} == {
        "dp_shard=2": (1, 2), "tp=2": (1, 4), "cp=2": (1, 4)}
    # the planner tried to fit (re-solved as sharded as it could) and says by how much it missed
    assert all(r["oom"] and r["mem_kind"] == "peak" and r["mem_gib"] > 0 for r in dropped)
    assert all("memory limit" in r["detail"] or "limit" in r["detail"] for r in dropped)


@pytest.mark.slow  # plans 3 meshes, then cp=2 twice more under a memory limit
def test_mesh_search_accumulates_where_memory_requires(tmp_path):
    # AC fixed: with mode "auto" the planner meets the lower limit by recomputing instead
    cfg = load_config("llama3_debug_auto", [*TINY_JOB, "--model.vocab_size", "4096", "--training.seq_len", "256",
                                            "--activation_checkpoint.mode", "none"], validate=False)
    cache = PlanCache(tmp_path / "cache")
    job = base_job(cfg)
    rows = {r["mesh"]: r for r in search_meshes(job, 2, "h100", workers=1, cache=cache, out=lambda s: None)
            if r["mesh"] in ("cp=2", "dp_shard=2")}
    # a limit below cp=2's peak at its local batch of 4, above dp_shard=2's at 2: cp=2 must accumulate
    # (tp=2 no longer serves: its plan splits the batch over tp and peaks where dp_shard=2 does)
    big, small = rows["cp=2"]["mem_gib"] * 2**30, rows["dp_shard=2"]["mem_gib"] * 2**30
    assert small < big
    limit = int((big + small) / 2)
    hw = load_hardware("h100").replace(memory_bytes=limit, memory_limit_bytes=limit)
    again = {r["mesh"]: r for r in search_meshes(job, 2, hw, workers=1, cache=cache, out=lambda s: None)}
    cp = again["cp=2"]
    print({m: (r["status"], r["local_batch"], r["micro_batches"], r["mem_gib"]) for m, r in again.items()})
    assert again["dp_shard=2"]["micro_batches"] == 1 and again["dp_shard=2"]["status"] == "ok"
    assert cp["status"] == "ok" and cp["micro_batches"] > 1 and cp["local_batch"] * cp["micro_batches"] == 4
    assert cp["mem_gib"] * 2**30 <= limit
    # its step is every micro-batch's step graph, the gradient reductions once
    plan, m = cache.plan(cp["key"]), cp["micro_batches"]
    assert cp["step_ms"] == pytest.approx((plan.objective_us * m - plan.grad_reduction_us * (m - 1)) / 1e3)
    assert cp["step_ms"] * 1e3 < plan.objective_us * m
    assert cp["tokens_per_s"] == pytest.approx(4 * 256 / (cp["step_ms"] / 1e3))


def test_a_mesh_that_cannot_divide_the_global_batch_is_a_row(tmp_path):
    cfg = load_config("llama3_debug_auto", [*TINY_JOB, "--training.global_batch_size", "3"], validate=False)
    job = base_job(cfg)
    assert job.global_batch_size == 3
    points = search_points(job, 4, "h100")
    by = {p.mesh.label: p for p in points}
    assert by["dp_shard=4"].reject == "not run: global batch 3 is not divisible by the data degree 4 (dp_shard=4)"
    assert by["dp_shard=2,tp=2"].reject.endswith("the data degree 2 (dp_shard=2)")
    assert not by["tp=4"].reject and by["tp=4"].local_batch_size == 3 and by["tp=4"].micro_batches == 1
    rejected = [p for p in points if p.reject]
    rows = run_points(rejected, workers=1, cache=PlanCache(tmp_path / "c"), progress=quiet())
    assert [r["status"] for r in rows] == [p.reject for p in rejected] and all(r["step_ms"] is None for r in rows)
    ranked = rank_rows(rejected, rows)
    assert [r["rank"] for r in ranked] == ["-"] * len(rejected)
    table = ranked_table(ranked)
    assert "not divisible by the data degree 4" in table and "| 3 x 32 |" in table


def test_micro_batches_pay_the_gradient_reductions_once(tmp_path):
    """A step of 2 micro-batches is predicted as the step graph twice less one set of gradient
    reductions (the runtime reduces the summed gradients once); on a data-parallel mesh of a
    dense model every reduction is a gradient's, the parameter gathers are not."""
    cfg = load_config("llama3_debug_auto", [*TINY_JOB, "--training.global_batch_size", "4"], validate=False)
    point = {p.mesh.label: p for p in search_points(base_job(cfg), 2, "h100")}["dp_shard=2"]
    two = with_global_batch(point, 4, 2)
    (row,) = run_points([two], workers=1, cache=PlanCache(tmp_path / "c"), progress=quiet())
    assert (row["status"], row["micro_batches"], row["local_batch"]) == ("ok", 2, 1)
    grads = row["grad_reduction_us"]
    plan = PlanCache(tmp_path / "c").plan(row["key"])
    # told apart by the kind of collective (not by what consumes it): every reduction here is a gradient's
    reductions = sum(us for k, us in plan.comm_us.items() if k.split("@")[0] in ("reduce_scatter", "all_reduce"))
    assert 0 < grads == pytest.approx(reductions) and grads < row["comm_us"]  # the gathers are paid per micro-batch
    assert row["step_ms"] * 1e3 == pytest.approx(2 * row["objective_us"] - grads)
    assert row["step_ms"] * 1e3 < 2 * row["objective_us"]


def test_fixed_global_batch_sets_each_meshs_local_batch():
    cfg = load_config("llama3_debug_auto", [*TINY_JOB, "--training.global_batch_size", "16"], validate=False)
    points = {p.mesh.label: p for p in search_points(base_job(cfg), 8, "h100")}
    for label, local in [("dp_shard=8", 2), ("dp_shard=4,tp=2", 4), ("dp_shard=2,tp=4", 8), ("tp=8", 16),
                         ("dp_replicate=2,dp_shard=4", 2), ("dp_shard=2,cp=2,tp=2", 8)]:
        p = points[label]
        assert (p.local_batch_size, p.micro_batches, p.global_batch, p.reject) == (local, 1, 16, ""), label
        assert p.micro_global_batch == local * p.data_degree  # what is traced: one micro-batch of every data rank
    more = more_micro_batches(points["dp_shard=2,tp=4"])  # 8 per data rank: 2 micro-batches of 4
    assert (more.local_batch_size, more.micro_batches, more.global_batch) == (4, 2, 16)
    assert point_key(more) != point_key(points["dp_shard=2,tp=4"])
    assert more_micro_batches(points["dp_shard=8"]).micro_batches == 2
    assert more_micro_batches(with_global_batch(points["dp_shard=8"], 16, 2)) is None  # 1 sample a micro-batch
    default = {p.mesh.label: p for p in search_points(base_job(load_config("llama3_debug_auto", TINY_JOB,
                                                                           validate=False)), 8, "h100")}
    assert {p.global_batch for p in default.values()} == {2 * 8}  # default: local batch x world size


def test_sweep_global_batch_axis(tmp_path):
    text = TINY.replace("local_batch_size = 1", "global_batch_size = [4]") + "world_size = [4]\n"
    spec = load_sweep(spec_file(tmp_path, text))
    assert {(p.mesh.label, p.local_batch_size) for p in spec.points} == {
        ("dp_shard=4", 1), ("tp=4", 4), ("dp_shard=2,tp=2", 2), ("dp_replicate=2,dp_shard=2", 1)}
    with pytest.raises(SweepSpecError, match="both local_batch_size and global_batch_size"):
        load_sweep(spec_file(tmp_path, text.replace("global_batch_size = [4]",
                                                    "global_batch_size = [4]\nlocal_batch_size = 2")))


@pytest.mark.slow  # spawns worker processes
def test_worker_processes_report_every_point(tmp_path):
    spec = load_sweep(spec_file(tmp_path, TINY + "mesh = ['2', 'tp=2']\n"))
    lines = []
    rows = run_points(spec.points, workers=2, cache=PlanCache(tmp_path / "c"), progress=Progress(2, out=lines.append))
    assert [r["mesh"] for r in rows] == ["dp_shard=2", "tp=2"]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert lines[-1].startswith("[sweep] 2/2 done (0 cached, 0 failed)") and "ETA" in lines[0]


@pytest.mark.parametrize("overrides, match", [
    (["--parallelism.mesh", "dp4"], r"'parallelism\.mesh' = 'dp4': must be \"auto\""),
    (["--parallelism.mesh", "auto", "--parallelism.mode", "manual"],
     r"'parallelism\.mesh' = 'auto': .*mode = \"auto\""),
    (["--parallelism.mesh", "auto", "--parallelism.tensor_parallel_degree", "2"],
     r"'parallelism\.tensor_parallel_degree' = 2: is set, but mesh = \"auto\" chooses the degrees"),
])
def test_mesh_auto_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("llama3_debug_auto", overrides, world_size=2)
    assert load_config("llama3_debug_auto", ["--parallelism.mesh", "auto"], world_size=2).parallelism.mesh == "auto"


def test_the_table_says_its_numbers_are_predicted_and_where_the_measured_scatter_is(tmp_path):
    """A sweep runs nothing: no measured column, no predicted-vs-measured scatter; the note says so."""
    rows = [{"index": 0, "model": "llama3", "global_batch": 8, "seq_len": 128, "step_ms": 12.5, "status": "ok"}]
    write_markdown(rows, tmp_path / "table.md", title="t")
    text = (tmp_path / "table.md").read_text()
    assert PREDICTED_NOTE in text and "scripts/fidelity.py" in PREDICTED_NOTE and "| 12.5 |" in text


def test_sweep_compares_its_best_point_with_the_fsdp_preset(tmp_path, capsys):
    """scripts/sweep.py plans its best point again with the FSDP preset (cached under its own key)
    and draws both plans side by side: two step timelines, two placements maps, one line."""
    import re

    from tools import sweep

    spec = spec_file(tmp_path, TINY + "mesh = '2'\n")
    out, args = tmp_path / "out", ["--workers", "1", "--cache-dir", str(tmp_path / "cache")]
    assert sweep.main([spec, "--out", str(out), *args]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("best vs FSDP preset at "))
    assert re.search(r"best [\d.]+ ms, FSDP preset [\d.]+ ms per step predicted \(the table's\), "
                     r"(the preset's step is [\d.]+x the best's|the best plan IS the FSDP preset's)", line), line
    assert line.endswith(f"wrote {out}/best_vs_preset.html")
    page = (out / "best_vs_preset.html").read_text(encoding="utf-8")
    assert "<h2>FSDP preset: " in page and "<h2>best: " in page and "cannot-draw" not in page
    assert len(re.findall(r'<svg[^>]* class="timeline"', page)) == 2  # both plans' simulated steps, saved and loaded
    assert len(re.findall(r'<svg[^>]* class="placement-map"', page)) == 2
    assert page.count('class="lane" data-lane="compute"') == 2 and page.count('class="lane" data-lane="dp_shard"') == 2
    rows = (out / "rows.csv").read_text()
    assert rows.count("\n") == 2 and "preset" not in rows.splitlines()[0]  # the preset point is not a row
    # run again: both plans from the cache; the same page
    assert sweep.main([spec, "--out", str(out), *args]) == 0
    assert "[sweep] 1/1 done (1 cached" in capsys.readouterr().err


def test_a_preset_that_plans_the_best_placements_says_so(tmp_path, monkeypatch):
    """A preset that constrains nothing plans the free plan again: the line says it is the same."""
    from parallel.auto.search.compare import best_vs_preset

    monkeypatch.setitem(sweep_point.PRESETS, "fsdp", lambda autop: None)
    spec = load_sweep(spec_file(tmp_path, TINY + "mesh = '2'\n"))
    cache = PlanCache(tmp_path / "cache")
    rows = run_points(spec.points, workers=1, cache=cache, progress=quiet())
    line = best_vs_preset(spec.points, rows, cache, tmp_path / "out", progress=quiet())
    assert "the best plan IS the FSDP preset's (same placements)" in line
    assert (tmp_path / "out" / "best_vs_preset.html").exists()
    nothing = [{**rows[0], "status": "OOM", "oom": True}]
    assert best_vs_preset(spec.points, nothing, cache, tmp_path / "none") == \
        "best vs FSDP preset: skipped (no point fits: nothing to compare)"
    assert not (tmp_path / "none").exists()
