"""scripts/bench_first_run.py's verdict: medians per condition against issue 52's goal (the
runs themselves are a benchmark, not a test)."""

from __future__ import annotations

from tools.bench_first_run import report


def _row(cond: str, first: float | None, second: float | None) -> dict:
    return {"condition": cond, "pair": 0, "first": first, "recorded": "", "second": second, "recorded_2": "",
            "seconds": 1.0}


def test_goal_met_on_the_medians_of_both_conditions(capsys):
    rows = [_row("loaded", 1.3, 1.0), _row("loaded", 1.2, 1.05), _row("loaded", 1.1, 0.95),
            _row("quiet", 1.0, 1.0), _row("quiet", 0.9, 1.02), _row("quiet", 1.24, 0.98)]
    assert report(rows) == 0
    out = capsys.readouterr().out
    assert "| loaded | 3 | 1.2 (1.3, 1.2, 1.1) | 1.0 (1.0, 1.05, 0.95) |" in out and "met" in out


def test_goal_not_met_when_a_median_is_outside_or_missing(capsys):
    assert report([_row("loaded", 1.3, 1.0), _row("loaded", 1.4, 1.0), _row("quiet", 1.0, 1.0)]) == 1
    assert report([_row("quiet", 1.0, 1.15)]) == 1  # the second run outside 0.9-1.1
    assert report([_row("quiet", None, 1.0)]) == 1  # no prediction line read
    assert "NOT met" in capsys.readouterr().out
