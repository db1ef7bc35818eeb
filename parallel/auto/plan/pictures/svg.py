"""The SVG elements the plan page's pictures are made of: rectangles with a hover title,
text, and the frame around them. Every element a test or a reader may look up carries
`data-*` attributes with its numbers, so the page can be checked from its DOM."""

from __future__ import annotations

import html
from typing import Any

FONT = 'font-family="system-ui,sans-serif" font-size="11"'


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def data_attrs(data: dict[str, Any] | None) -> str:
    """` data-k="v"` for each item (numbers as given, so a reader gets them back exactly)."""
    return "".join(f' data-{esc(k)}="{esc(v)}"' for k, v in (data or {}).items())


def rect(x: float, y: float, w: float, h: float, fill: str, *, title: str = "", cls: str = "",
         data: dict[str, Any] | None = None) -> str:
    """A filled rectangle; `title` shows on hover (SVG's own tooltip, no script)."""
    c = f' class="{esc(cls)}"' if cls else ""
    t = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.0):.2f}" height="{h:.2f}" fill="{fill}"{c}'
            f"{data_attrs(data)}>{t}</rect>")


def text(x: float, y: float, s: Any, *, anchor: str = "start", fill: str = "#222", size: int = 11) -> str:
    return (f'<text x="{x:.2f}" y="{y:.2f}" text-anchor="{anchor}" fill="{fill}" '
            f'font-family="system-ui,sans-serif" font-size="{size}">{esc(s)}</text>')


def line(x1: float, y1: float, x2: float, y2: float, *, stroke: str = "#888", dash: str = "") -> str:
    d = f' stroke-dasharray="{dash}"' if dash else ""
    return f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" stroke="{stroke}"{d}/>'


def svg(width: float, height: float, body: list[str], *, cls: str, label: str,
        data: dict[str, Any] | None = None) -> str:
    """The picture's frame: a sized, labelled <svg> (role img, so screen readers name it)."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="{esc(cls)}" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}"{data_attrs(data)}>'
            + "".join(body) + "</svg>")


__all__ = ["data_attrs", "esc", "line", "rect", "svg", "text"]
