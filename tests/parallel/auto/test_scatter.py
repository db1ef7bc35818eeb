"""The predicted-vs-measured scatter: one circle per plan where its numbers put it, on axes
that share one scale from 0, and the y = x line from corner to corner."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from parallel.auto.plan.pictures.scatter import axis_top, nice_step, plot_position, scatter_svg

NS = "{http://www.w3.org/2000/svg}"
POINTS = [("fsdp", 41.2, 47.9), ("ddp", 38.0, 36.5), ("tp <1>", 12.0, 20.0)]


def _root(points=POINTS) -> ET.Element:
    return ET.fromstring(scatter_svg(points))


def test_one_circle_per_plan_placed_by_its_numbers():
    root = _root()
    top = float(root.get("data-top"))
    circles = root.findall(f".//{NS}circle")
    assert len(circles) == len(POINTS)
    for c, (name, pred, meas) in zip(circles, POINTS):
        assert c.get("data-plan") == name
        assert float(c.get("data-predicted")) == pred and float(c.get("data-measured")) == meas
        x, _ = plot_position(pred, top)
        _, y = plot_position(meas, top)
        assert float(c.get("cx")) == pytest.approx(x, abs=0.01) and float(c.get("cy")) == pytest.approx(y, abs=0.01)
        title = c.find(f"{NS}title").text
        assert title.startswith(f"{name}: predicted {pred:,.2f} ms, measured {meas:,.2f} ms")
    # a point measured slower than predicted lies above the diagonal (smaller y in SVG)
    fsdp = circles[0]
    assert float(fsdp.get("cy")) < plot_position(41.2, top)[1]


def test_the_identity_line_runs_from_the_origin_to_the_top_corner():
    root = _root()
    top = float(root.get("data-top"))
    ident = [e for e in root.iter(f"{NS}line") if e.get("class") == "identity"]
    assert len(ident) == 1
    x0, y0 = plot_position(0, top)
    x1, y1 = plot_position(top, top)
    got = [float(ident[0].get(k)) for k in ("x1", "y1", "x2", "y2")]
    assert got == pytest.approx([x0, y0, x1, y1], abs=0.01)
    assert top >= 47.9 and top == axis_top([v for _, p, m in POINTS for v in (p, m)])


def test_ticks_are_round_numbers_in_ms_and_the_axes_name_it():
    svg = scatter_svg(POINTS)
    assert "predicted step time (ms)" in svg and "measured step time (ms)" in svg
    labels = re.findall(r'font-size="10">([\d.]+)</text>', svg)
    assert sorted(set(labels), key=float) == ["0", "20", "40", "60"]  # both axes: 0 to 51.7 ms, rounded up
    assert nice_step(60) == 20 and nice_step(0.7) == 0.2 and nice_step(48) == 10


def test_no_points_still_draws_the_frame():
    root = _root([])
    assert root.findall(f".//{NS}circle") == [] and root.get("aria-label").endswith("0 plans")
