"""The plan's placements as a map: layer groups (rows) x parameters (columns), one small cell
per mesh axis inside each, so a glance shows which axis shards what.

A cell's colour is the parameter's storage on that axis (replicated, or sharded along dim k);
the strip under it is its gradient as the backward makes it: partial where it is reduced
over that axis (all-reduce, reduce-scatter), else the storage's colour. Repeated blocks are
one row with their count ('layers.0-31 ×32', as the tables fold them). A local_map region
(CP attention, MoE dispatch) is one cell of its own per layer group, coloured by the
placement it gives on each axis, its contract (what it takes and gives, what it gathers or
exchanges inside) in the hover title. On a diff page, cells that differ from the other plan
are outlined."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from parallel.auto.candidates.placements import placement_words
from parallel.auto.plan import Plan
from parallel.auto.plan.pictures.svg import esc, rect, svg, text
from parallel.auto.regions import declared, option_names
from parallel.auto.trace.joint import layer_prefix

REPLICATE, PARTIAL = "#d9d9d9", "#e15759"
SHARD = ("#4e79a7", "#59a14f", "#b07aa1", "#9c755f", "#76b7b2")
AX_W, CELL_H, GAP, LEFT, HEAD = 12, 18, 6, 170, 120
TOP = "(top level)"


def colour(p: str) -> str:
    """A placement word's colour: R grey, S(k) the k-th shard colour, partial red."""
    if p == "R":
        return REPLICATE
    m = re.fullmatch(r"S\((\d+)\)", p)
    if m:
        return SHARD[int(m.group(1)) % len(SHARD)]
    return PARTIAL if p.startswith(("P", "MP")) else "#fff"


def kind(p: str) -> str:
    """'replicate', 'shard dim k' or 'partial' (the legend's words)."""
    if p == "R":
        return "replicate"
    m = re.fullmatch(r"S\((\d+)\)", p)
    return f"shard dim {m.group(1)}" if m else "partial" if p.startswith(("P", "MP")) else p


def _range(group: str) -> list[str]:
    """'layers.0-3' -> the layers it folds."""
    m = re.fullmatch(r"(.*\.)(\d+)-(\d+)", group)
    return [f"{m.group(1)}{i}" for i in range(int(m.group(2)), int(m.group(3)) + 1)] if m else [group]


def contract(target: str, option: str, axis: str) -> str:
    """What a region takes and gives on one mesh axis when it runs `option` (its declaration's words)."""
    name = target.split(".")[1] if "." in target else target
    r = declared().get(name)
    if r is None:
        return f"{option} on {axis}"
    o = r.option(option)
    takes, gives = ", ".join(map(_short, o.inputs)), ", ".join(map(_short, o.outputs))
    words = f"{option} on {axis}: takes ({takes}), gives ({gives})"
    if o.gather:
        words += f", all-gathers its input{'s' if len(o.gather) > 1 else ''} {', '.join(map(str, o.gather))} " \
            "(from 0) along their sharded dim inside"
    if o.exchange is not None:
        words += ", exchanges tokens all-to-all inside (dispatch and combine)"
    return words


def _short(p: Any) -> str:
    name = type(p).__name__
    return "R" if name == "Replicate" else f"S({p.dim})" if name == "Shard" else "P"


def region_cells(plan: Plan) -> dict[tuple[str, str], list[dict[str, str]]]:
    """(layer, region name) -> per mesh axis {placement it gives, option, contract} of each
    forward region node of the plan."""
    out: dict[tuple[str, str], list[dict[str, str]]] = {}
    for n in plan.nodes.values():
        if n.phase != "fwd" or not n.target.startswith("autotitan."):
            continue
        opts = option_names(n.target, n.input_placements)
        if opts is None:
            continue
        layer = layer_prefix(n.module, innermost=True) or ""
        gives = placement_words(n.output_placements[0]) if n.output_placements else []
        out[(layer, n.target.split(".")[1])] = [
            {"placement": gives[ax] if ax < len(gives) else "?", "option": o,
             "contract": contract(n.target, o, name)}
            for ax, (o, name) in enumerate(zip(opts, plan.mesh_axis_names))]
    return out


Row = tuple[str, int, dict[str, list[dict[str, str]]]]


def map_rows(plan: Plan, param_rows: Callable[[Plan], list]) -> list[Row]:
    """(layer group, layers in it, column -> per-axis cells): the parameters as `param_rows`
    groups them, then the group's regions (column 'region <name>')."""
    regions = region_cells(plan)
    rows: list[Row] = []
    for group, items in param_rows(plan):
        layers = _range(group) if group != TOP else [""]
        cols: dict[str, list[dict[str, str]]] = {short: cells for short, _, cells in items}
        for (layer, name), cells in regions.items():
            if layer == layers[0]:
                cols[f"region {name}"] = cells
        rows.append((group, len(layers), cols))
    seen = {layer for group, _, _ in rows for layer in (_range(group) if group != TOP else [""])}
    for (layer, name), cells in regions.items():  # a region in a layer without parameters
        if layer not in seen:
            rows.append((layer or TOP, 1, {f"region {name}": cells}))
    return rows


def _axis_cell(x: float, y: float, c: dict[str, str], axis: str, col: str, group: str, changed: bool) -> list[str]:
    """One parameter (or region) on one mesh axis: the storage's colour, the gradient's strip."""
    if "option" in c:  # a region: the placement it gives, its contract
        p = c["placement"]
        return [rect(x, y, AX_W - 1, CELL_H, colour(p), cls="map-region", title=f"{group} {col}: {c['contract']}",
                     data={"group": group, "column": col, "axis": axis, "placement": p, "kind": kind(p),
                           "option": c["option"], "changed": int(changed)})]
    store = c["store"]
    reduced = c["reduce"] in ("all-reduce", "reduce-scatter", "partial")
    grad = "P" if reduced else c["grad"] if c["grad"] not in ("-", "?") else store
    title = (f"{group} {col} on {axis}: {c['fwd']}, stored {store}; grad {c['grad']}, {c['reduce']}")
    return [rect(x, y, AX_W - 1, CELL_H * 0.7, colour(store), cls="map-cell", title=title,
                 data={"group": group, "column": col, "axis": axis, "placement": store, "kind": kind(store),
                       "grad": kind(grad), "changed": int(changed)}),
            rect(x, y + CELL_H * 0.7, AX_W - 1, CELL_H * 0.3, colour(grad), cls="map-grad", title=title)]


def placement_map(plan: Plan, param_rows: Callable[[Plan], list], other: Plan | None = None) -> str:
    """The map (see the module docstring); `other`: the other side of a diff (differing cells outlined)."""
    rows = map_rows(plan, param_rows)
    theirs = {(g, col): cells for g, _, cols in map_rows(other, param_rows) for col, cells in cols.items()} \
        if other is not None else {}
    columns: list[str] = []
    for _, _, cols in rows:
        columns += [c for c in cols if c not in columns]
    axes = plan.mesh_axis_names
    col_w = AX_W * len(axes) + GAP
    width = LEFT + col_w * len(columns) + 20
    body = [_column_head(LEFT + i * col_w + col_w / 2, HEAD, c) for i, c in enumerate(columns)]
    y = HEAD + 6.0
    for group, count, cols in rows:
        label = f"{group} ×{count}" if count > 1 else group
        body.append(text(4, y + CELL_H - 5, label))
        for i, col in enumerate(columns):
            cells = cols.get(col)
            if cells is None:
                continue
            changed = other is not None and theirs.get((group, col)) != cells
            x = LEFT + i * col_w
            for ax, c in enumerate(cells):
                body += _axis_cell(x + ax * AX_W, y, c, axes[ax] if ax < len(axes) else "?", col, group, changed)
            if changed:
                body.append(_outline(x, y, len(cells)))
        y += CELL_H + 6
    body += _legend(y + 8, axes)
    return svg(max(width, 600), y + 58, body, cls="placement-map", label="placements: layer groups by parameters",
               data={"rows": len(rows), "columns": len(columns), "axes": ",".join(axes)})


def _outline(x: float, y: float, n_axes: int) -> str:
    """The frame around a cell that differs from the other plan's."""
    return (f'<rect x="{x - 1.5:.2f}" y="{y - 1.5:.2f}" width="{AX_W * n_axes + 2:.2f}" height="{CELL_H + 3:.2f}" '
            'fill="none" stroke="#d00" stroke-width="2" class="map-changed"/>')


def _column_head(x: float, y: float, name: str) -> str:
    short = name.removesuffix(".weight")
    return (f'<text x="{x:.2f}" y="{y:.2f}" transform="rotate(-50 {x:.2f} {y:.2f})" fill="#222" '
            f'font-family="system-ui,sans-serif" font-size="11">{esc(short)}</text>')


def _legend(y: float, axes: list[str]) -> list[str]:
    items = [(REPLICATE, "replicate"), *[(SHARD[k], f"shard dim {k}") for k in range(3)], (PARTIAL, "partial")]
    out, x = [], 4.0
    for c, words in items:
        out += [rect(x, y, 10, 10, c), text(x + 14, y + 9, words)]
        x += 14 + 6.5 * len(words) + 12
    out.append(text(4, y + 26, f"each cell: one small square per mesh axis ({', '.join(axes)}), coloured by the "
                    "parameter's storage on it;", fill="#555", size=10))
    out.append(text(4, y + 40, "the strip below: its gradient from the backward (partial: reduced over that axis)",
                    fill="#555", size=10))
    return out


def map_note(plan: Plan) -> str:
    """The words under the map: what a region cell says."""
    if not plan.regions:
        return ""
    return (f'<p class="note">regions ({esc(", ".join(plan.regions))}): one cell per layer group, coloured by '
            "the placement the region gives on each axis; hover for its contract (what it takes and gives)</p>")


__all__ = ["colour", "contract", "kind", "map_note", "map_rows", "placement_map", "region_cells"]
