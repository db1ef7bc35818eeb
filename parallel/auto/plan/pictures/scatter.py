"""Predicted against measured step time, one point per plan, and the y = x line: the picture
that says at a glance whether the cost model is right (points on the line), off by a factor
(points on a line of another slope) or ranks plans wrongly (points out of order).

    svg = scatter_svg([("fsdp", 41.2, 47.9), ("ddp", 38.0, 36.5)])   # (plan, predicted ms, measured ms)

Both axes share one linear scale from 0, so the y = x diagonal is at 45 degrees and a point's
distance above it is the model's underestimate. Each point is a `<circle>` whose `data-plan`,
`data-predicted` and `data-measured` carry its numbers (ms) and whose hover title names the
plan, so the picture can be checked from its DOM (scripts/fidelity.py, the sweep report).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .svg import data_attrs, esc, line, svg, text

WIDTH, HEIGHT = 480, 440
LEFT, TOP, SIDE = 70, 40, 340  # the square plot area: x LEFT..LEFT+SIDE, y TOP..TOP+SIDE
POINT = "#4477aa"


def nice_step(top: float, ticks: int = 5) -> float:
    """A tick step of 1, 2 or 5 x 10^k giving about `ticks` ticks up to `top`."""
    raw = max(top, 1e-12) / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def axis_top(values: Sequence[float]) -> float:
    """The axes' common end: the largest value with a margin, rounded up to a tick."""
    top = max([v for v in values if v > 0] + [1e-9]) * 1.08
    step = nice_step(top)
    return math.ceil(top / step) * step


def circle(cx: float, cy: float, r: float, fill: str, *, title: str = "", data: dict | None = None) -> str:
    """A point with a hover title (SVG's own tooltip) and its numbers as data-* attributes."""
    t = f"<title>{esc(title)}</title>" if title else ""
    return (f'<circle cx="{cx:.2f}" cy="{cy:.2f}" r="{r:.1f}" fill="{fill}" fill-opacity="0.75" class="point"'
            f"{data_attrs(data)}>{t}</circle>")


def _axes(top: float, unit: str) -> list[str]:
    """Frame, ticks and grid on both axes (the same scale), their labels."""
    out, step = [], nice_step(top)
    scale = SIDE / top
    for k in range(int(round(top / step)) + 1):
        v = k * step
        x, y = LEFT + v * scale, TOP + SIDE - v * scale
        out += [line(x, TOP, x, TOP + SIDE, stroke="#eee"), line(LEFT, y, LEFT + SIDE, y, stroke="#eee"),
                text(x, TOP + SIDE + 14, f"{v:g}", anchor="middle", size=10),
                text(LEFT - 6, y + 4, f"{v:g}", anchor="end", size=10)]
    out += [line(LEFT, TOP + SIDE, LEFT + SIDE, TOP + SIDE, stroke="#000"),
            line(LEFT, TOP, LEFT, TOP + SIDE, stroke="#000"),
            text(LEFT + SIDE / 2, TOP + SIDE + 34, f"predicted step time ({unit})", anchor="middle", size=12),
            f'<text x="18" y="{TOP + SIDE / 2:.2f}" text-anchor="middle" font-family="system-ui,sans-serif" '
            f'font-size="12" transform="rotate(-90 18 {TOP + SIDE / 2:.2f})">measured step time ({esc(unit)})</text>']
    return out


def scatter_svg(points: Sequence[tuple[str, float, float]], *, title: str = "step time: predicted vs measured",
                unit: str = "ms") -> str:
    """(plan, predicted, measured) points over the y = x line, both axes in `unit` from 0."""
    top = axis_top([v for _, p, m in points for v in (p, m)])
    body = [text(WIDTH / 2, 22, title, anchor="middle", size=14), *_axes(top, unit),
            f'<line x1="{LEFT}" y1="{TOP + SIDE}" x2="{LEFT + SIDE}" y2="{TOP}" stroke="#cc3311" '
            'stroke-dasharray="6,4" class="identity"><title>y = x: measured as predicted</title></line>',
            text(LEFT + SIDE - 4, TOP + 12, "y = x", anchor="end", fill="#cc3311", size=10)]
    for name, pred, meas in points:
        ratio = f"{meas / pred:.2f}" if pred > 0 else "-"
        body.append(circle(plot_position(pred, top)[0], plot_position(meas, top)[1], 4.5, POINT,
                           title=f"{name}: predicted {pred:,.2f} {unit}, measured {meas:,.2f} {unit} "
                                 f"(measured / predicted {ratio})",
                           data={"plan": name, "predicted": pred, "measured": meas}))
    return svg(WIDTH, HEIGHT, body, cls="scatter", label=f"{title}: {len(points)} plans",
               data={"unit": unit, "top": top})


def plot_position(value: float, top: float) -> tuple[float, float]:
    """Where `value` sits on (the x axis, the y axis) of a picture whose axes end at `top`."""
    return LEFT + value * SIDE / top, TOP + SIDE - value * SIDE / top


__all__ = ["axis_top", "circle", "nice_step", "plot_position", "scatter_svg"]
