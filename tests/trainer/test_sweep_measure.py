"""`scripts/sweep.py --measure` (tools/sweep_measure.py): which points run here, the measured
columns and note, the scatter's one point per distinct plan, exit 2 when nothing can run, and
(slow) a 4-point sweep end to end: two cpu points run on 2 gloo ranks, two h100 points listed
as not measured, the scatter's numbers the table's."""

from __future__ import annotations

import csv
import re

import pytest

from parallel.auto.search import report
from parallel.auto.search.spec import load_sweep
from tools import sweep
from tools.sweep_measure import runs_here, scatter_points
from trainer.auto_mode import load_base_job

SPEC = """
[sweep]
name = "tiny_cpu"
config = "llama3_debug"
[axes]
hardware = {hw}
n_layers = 1
dim = 64
n_heads = 4
n_kv_heads = 2
ffn_hidden_dim = 128
seq_len = 32
local_batch_size = 2
world_size = {world}
"""


def spec_file(tmp_path, hw='["cpu", "h100"]', world="2"):
    p = tmp_path / "tiny.toml"
    p.write_text(SPEC.format(hw=hw, world=world))
    return str(p)


def _row(i, mesh, measured=None, predicted=None, measure="", **kw):
    return {"index": i, "mesh": mesh, "hardware": "cpu", "world": 2, "global_batch": 4, "seq_len": 32,
            "status": "ok", "measured_ms": measured,
            "predicted_ms": predicted, "measure": measure, "predictor": "step simulation" if measured else None,
            **kw}


def test_only_cpu_points_within_the_rank_cap_run_here(tmp_path):
    points = load_sweep(spec_file(tmp_path, world="[2, 16]"), load_base_job).points
    why = {(p.hardware, p.mesh.world): runs_here(p) for p in points}
    assert why[("cpu", 2)] == ""
    assert why[("h100", 2)] == "planned for h100, not this machine (cpu)"
    assert why[("cpu", 16)] == "world 16 > 8 gloo ranks"
    shipped = load_sweep("llama3_debug_cpu", load_base_job).points  # the docs' --measure example
    assert len(shipped) == 6 and not any(runs_here(p) for p in shipped)


def test_measure_with_nothing_runnable_is_exit_2_before_planning(tmp_path, capsys):
    spec = spec_file(tmp_path, hw='"h100"')
    assert sweep.main([spec, "--measure", "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--measure: no point of" in err and "planned for h100" in err
    assert not (tmp_path / "out").exists()


def test_the_table_gains_measured_columns_only_when_measured():
    plain = [_row(0, "tp=2")]
    for r in plain:
        r.pop("measure")
    assert "measured ms" not in report.markdown_table(plain)
    assert "--measure" in report.measured_note(plain) and report.measured_note(plain) == report.PREDICTED_NOTE
    rows = [_row(0, "tp=2", 12.0, 8.0, "measured", measured_ratio=1.5),
            _row(1, "dp_shard=2", measure="not measured: planned for h100, not this machine (cpu)")]
    table = report.markdown_table(rows)
    assert "| predicted ms | measured ms | measured / predicted | measurement |" in table
    assert "| 8.00 | 12.00 | 1.50 | measured |" in table
    assert "| - | - | - | not measured: planned for h100" in table
    assert "step simulation" in report.measured_note(rows)


def test_the_scatter_has_one_point_per_distinct_plan(tmp_path):
    rows = [_row(0, "tp=2", 12.0, 8.0, "measured"), _row(1, "dp_shard=2", 20.0, 25.0, "measured"),
            _row(2, "dp_shard=2", 20.0, 26.0, "duplicate of #1 (same job, same placements)"),
            _row(3, "tp=2", measure="not measured: planned for h100")]
    points, dups = scatter_points(rows)
    assert [(p, m) for _, p, m in points] == [(8.0, 12.0), (25.0, 20.0)] and dups == {2: 1}
    line = sweep.scatter_line(rows, str(tmp_path), "t")
    assert "2 distinct plans; duplicates: #2 = #1" in line and "fewer than 3" in line
    svg = (tmp_path / "scatter.svg").read_text()
    assert svg.count("<circle ") == 2 and 'class="identity"' in svg


@pytest.mark.slow  # multi-process: plans 4 points, then runs 2 for real on 2 gloo ranks (~11 s)
def test_measure_end_to_end_on_two_ranks(tmp_path, capsys):
    out = tmp_path / "out"
    rc = sweep.main([spec_file(tmp_path), "--measure", "--measure-steps", "2", "--measure-warmup", "1", "--workers",
                     "1", "--no-compare", "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    rows = list(csv.DictReader((out / "rows.csv").open()))
    measured = [r for r in rows if r["measured_ms"]]
    assert sorted(r["mesh"] for r in measured) == ["dp_shard=2", "tp=2"]
    assert {r["hardware"] for r in measured} == {"cpu"}
    assert all(r["measure"].startswith("not measured: planned for h100") for r in rows if r["hardware"] == "h100")
    table = (out / "table.md").read_text()
    assert "measured ms" in table and table.count("not measured: planned for h100") == 2
    svg = (out / "scatter.svg").read_text()
    circles = re.findall(r'data-plan="#(\d+)[^"]*" data-predicted="([\d.e-]+)" data-measured="([\d.e-]+)"', svg)
    assert len(circles) == 2
    by_index = {r["index"]: r for r in rows}
    for i, pred, meas in circles:
        assert float(pred) == pytest.approx(float(by_index[i]["predicted_ms"]))
        assert float(meas) == pytest.approx(float(by_index[i]["measured_ms"]))
        assert f"| {float(meas):,.2f} |" in table
    assert f"wrote {out}/scatter.svg (step simulation vs measured, 2 distinct plans)" in text
