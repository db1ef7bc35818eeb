"""The peak's parts as bars: what a person checks first when a plan does not fit.

One stacked bar of the five parts of `MemoryEstimate` (they sum to the peak) against the
limit's marker, the step's phases with the one the peak falls in filled, and the activations
per transformer block: those saved when the forward ends, those alive at the peak, and what
the backward recomputes instead of keeping (activation checkpointing). Repeated blocks with
the same figures fold into one row with their count. Every bar carries `data-bytes`, so a
test (or a reader of the DOM) checks the picture against the estimate."""

from __future__ import annotations

import re

from parallel.auto.cost.memory import OUTSIDE, MemoryEstimate, format_bytes
from parallel.auto.plan.pictures.svg import esc, line, rect, svg, text

PARTS = (("params", "params_bytes", "#4e79a7", "parameters and buffers"),
         ("grads", "grads_bytes", "#f28e2b", "gradients"),
         ("optimizer", "optimizer_bytes", "#e15759", "optimizer state"),
         ("activations", "activations_bytes", "#76b7b2", "activations"),
         ("transient", "transient_bytes", "#edc948", "transient"))
PHASES = ("forward", "backward", "gradient reduction", "optimizer")
SAVED, AT_PEAK, RECOMPUTED = "#59a14f", "#76b7b2", "#bab0ac"
WIDTH, LEFT, BAR_W = 800, 150, 520
BLOCK_W = 460  # the per-block bars leave room for their figures
FAR_LIMIT = 4.0  # a limit beyond this many peaks is drawn off the scale (the parts would be slivers)


def _scale(est: MemoryEstimate) -> tuple[float, bool]:
    """(bytes per pixel's denominator: the bytes the bar's full width stands for, limit on the scale)."""
    peak = max(est.peak_bytes, 1)
    if est.limit_bytes and est.limit_bytes <= FAR_LIMIT * peak:
        return max(peak, est.limit_bytes) * 1.02, True
    return peak * 1.02, False


def peak_bar(est: MemoryEstimate) -> str:
    """The stacked bar of the peak's parts, the limit's marker and the phases of the step."""
    full, on_scale = _scale(est)
    px = BAR_W / full
    body, x = [text(4, 30, "at the peak")], float(LEFT)
    for name, attr, colour, words in PARTS:
        b = getattr(est, attr)
        body.append(rect(x, 16, b * px, 22, colour, cls="mem-part", title=f"{words}: {format_bytes(b)}",
                         data={"part": name, "bytes": b}))
        x += b * px
    body.append(text(x + 4, 31, f"peak {format_bytes(est.peak_bytes)}"))
    body.append(_limit_marker(est, px, on_scale))
    y = 62
    for i, (_, attr, colour, words) in enumerate(PARTS):  # the legend, with each part's bytes
        lx, ly = LEFT + (i % 3) * 210, y + (i // 3) * 16
        body += [rect(lx, ly - 9, 10, 10, colour), text(lx + 14, ly, f"{words} {format_bytes(getattr(est, attr))}")]
    body += _phase_strip(est.phase, y + 40)
    return svg(WIDTH, y + 58, body, cls="memory-peak", label=f"memory at the peak: {est.summary()}",
               data={"peak-bytes": est.peak_bytes, "phase": est.phase, "limit-bytes": est.limit_bytes})


def _limit_marker(est: MemoryEstimate, px: float, on_scale: bool) -> str:
    if not est.limit_bytes:
        return text(LEFT, 12, "no memory limit", fill="#777", size=10)
    words = f"limit {format_bytes(est.limit_bytes)}"
    if on_scale:
        lx = LEFT + est.limit_bytes * px
        over = "" if est.fits else " (exceeded)"
        return (f'<g class="mem-limit" data-bytes="{est.limit_bytes}" data-on-scale="1">'
                + line(lx, 10, lx, 44, stroke="#c00", dash="4 2")
                + text(lx, 9, words + over, anchor="middle", fill="#c00", size=10) + "</g>")
    times = est.limit_bytes / max(est.peak_bytes, 1)
    lx = LEFT + BAR_W
    return (f'<g class="mem-limit" data-bytes="{est.limit_bytes}" data-on-scale="0">'
            + line(lx, 10, lx, 44, stroke="#c00", dash="1 3")
            + text(lx, 9, f"{words} ({times:,.0f}× the peak, off the scale) →", anchor="end", fill="#c00", size=10)
            + "</g>")


def _phase_strip(phase: str, y: float) -> list[str]:
    """The step's phases in order, the peak's filled."""
    out = [text(4, y + 12, "peak in the")]
    w = BAR_W / len(PHASES)
    for i, name in enumerate(PHASES):
        hit = name == phase
        out.append(rect(LEFT + i * w, y, w - 4, 16, "#c00" if hit else "#eee", cls="mem-phase",
                        title=f"{name}{': the peak' if hit else ''}", data={"phase": name, "peak": int(hit)}))
        out.append(text(LEFT + i * w + (w - 4) / 2, y + 12, name, anchor="middle", fill="#fff" if hit else "#555"))
    return out


def _layer_key(name: str) -> tuple:
    m = re.match(r"(.*)\.(\d+)$", name)
    return (name == OUTSIDE, m.group(1) if m else name, int(m.group(2)) if m else -1)


def _first_layer(row: str) -> str:
    """A row's (first) layer: 'layers.0-3' -> 'layers.0'."""
    return re.sub(r"-\d+$", "", row)


def block_rows(est: MemoryEstimate) -> list[tuple[str, int, tuple[int, int, int]]]:
    """(layer or 'layers.0-3', count, (saved, at the peak, recomputed) bytes of each) with
    consecutive blocks of the same figures (and checkpointing choice) folded; values outside
    the blocks last."""
    series = (est.saved_by_block, est.activations_by_block, est.recomputed_by_block)
    names = sorted({k for s in series for k in s}, key=_layer_key)
    rows: list[tuple[str, int, tuple[int, int, int]]] = []
    for name in names:
        v = tuple(s.get(name, 0) for s in series)
        m = re.match(r"(.*)\.(\d+)$", name)
        if rows and m:
            prev, count, pv = rows[-1]
            pm = re.match(r"(.*)\.(\d+)(?:-(\d+))?$", prev)
            same_ac = est.recompute_by_block.get(name) == est.recompute_by_block.get(_first_layer(prev))
            if (pm and pm.group(1) == m.group(1) and pv == v and same_ac
                    and int(pm.group(3) or pm.group(2)) + 1 == int(m.group(2))):
                rows[-1] = (f"{pm.group(1)}.{pm.group(2)}-{m.group(2)}", count + 1, v)
                continue
        rows.append((name, 1, v))
    return rows


def blocks_chart(est: MemoryEstimate) -> str:
    """Activations per block: saved when the forward ends, alive at the peak, and recomputed in
    the backward (bars of one block each; a folded row's count is in its label)."""
    rows = block_rows(est)
    top = max((max(s + r, p) for _, _, (s, p, r) in rows), default=1) or 1
    px = BLOCK_W / (top * 1.02)
    body = _blocks_legend(est)
    y = 56
    for name, count, (saved, at_peak, recomputed) in rows:
        label = f"{name} ×{count}" if count > 1 else name
        choice = est.recompute_by_block.get(_first_layer(name))
        label += f" (AC {choice})" if choice else ""
        body.append(text(4, y + 10, label))
        common = {"block": name, "count": count, **({"ac": choice} if choice else {})}
        body.append(rect(LEFT, y, saved * px, 9, SAVED, cls="mem-saved", data={**common, "bytes": saved},
                         title=f"{label}: saved when the forward ends {format_bytes(saved)} each"))
        body.append(rect(LEFT + saved * px, y, recomputed * px, 9, RECOMPUTED, cls="mem-recomputed",
                         data={**common, "bytes": recomputed},
                         title=f"{label}: recomputed in the backward {format_bytes(recomputed)} each"))
        body.append(rect(LEFT, y + 10, at_peak * px, 5, AT_PEAK, cls="mem-at-peak", data={**common, "bytes": at_peak},
                         title=f"{label}: alive at the peak {format_bytes(at_peak)} each"))
        body.append(text(LEFT + max(saved + recomputed, at_peak) * px + 4, y + 10,
                         f"{format_bytes(saved)}" + (f" + {format_bytes(recomputed)}" if recomputed else ""),
                         fill="#555", size=10))
        y += 20
    return svg(WIDTH, y + 4, body, cls="memory-blocks", label="activations per transformer block",
               data={"activations-bytes": est.activations_bytes, "saved-bytes": est.saved_bytes,
                     "recompute": est.recompute})


def _blocks_legend(est: MemoryEstimate) -> list[str]:
    items = [(SAVED, f"saved when the forward ends (total {format_bytes(est.saved_bytes)})"),
             (AT_PEAK, f"alive at the peak (total {format_bytes(est.activations_bytes)})"),
             (RECOMPUTED, "recomputed in the backward")][:3 if est.recomputed_by_block else 2]
    out = []
    for i, (colour, words) in enumerate(items):
        out += [rect(LEFT, 6 + 15 * i, 10, 10, colour), text(LEFT + 14, 15 + 15 * i, words)]
    return out


def recompute_note(est: MemoryEstimate) -> str:
    """What the page can say about activation checkpointing, in words."""
    rec = sum(est.recomputed_by_block.values())
    if est.recompute in ("", "none") and not rec:
        policy = "not recorded" if not est.recompute else "off"
        return f"activation checkpointing {policy}: the backward recomputes nothing."
    return (f"activation checkpointing: {esc(est.recompute or 'not recorded')}. The backward recomputes values "
            f"of {format_bytes(rec)} that it reads (the grey bars): without recomputation the forward would keep "
            "about that much more, an estimate read off this step's graph (the step without recomputation is "
            "not traced).")


def memory_pictures(est: MemoryEstimate | None) -> str:
    """The memory section's body: the bars, or why there are none."""
    if est is None:
        return ('<p class="note">no memory estimate with this plan (planned with memory_estimate = false): '
                "no memory bars to draw</p>")
    out = [peak_bar(est)]
    if not (est.saved_by_block or est.activations_by_block):
        out.append('<p class="note">activations per block: not recorded in this plan (written before the '
                   "estimate kept them); re-plan to see them</p>")
        return "\n".join(out)
    if not est.activations_by_block:
        out.append(f'<p class="note">no activations alive at the peak (in the {esc(est.phase)})</p>')
    out += [blocks_chart(est), f'<p class="note">{recompute_note(est)} Activations are counted by '
            "the block that made them; values made outside the blocks (embedding, head, loss) are "
            f"{esc(OUTSIDE)}.</p>"]
    return "\n".join(out)


__all__ = ["block_rows", "blocks_chart", "memory_pictures", "peak_bar", "recompute_note"]
