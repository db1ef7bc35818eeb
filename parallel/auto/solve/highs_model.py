"""The reduced placement ILP as arrays, handed to HiGHS in one call (no per-variable Python objects).

Same formulation as solve/ilp.py (one-hot x per group, marginal y per edge class pair, the
parameter-memory budget row); building it through pulp costs ~2 s of Python on LLaMA 3 8B
4x8 (90 k variables), building these arrays ~0.1 s. Columns: every group's x (group
order, strategy order), then every edge's y (edge order, row-major class pairs).

The budget row holds to BUDGET_SLACK of the parameter total, not to HiGHS' feasibility
tolerance: in units of the total, that tolerance (1e-7) let an 8B plan keep a norm weight
unsharded (1.5 kB over a fully sharded budget), so the row is scaled (BUDGET_SCALE).
"""

from __future__ import annotations

from dataclasses import dataclass

import highspy
import numpy as np

from parallel.auto.solve.presolve import BUDGET_SCALE, BUDGET_SLACK


@dataclass
class ArrayModel:
    """The ILP in HiGHS' terms plus what is needed to read a plan back."""

    cost: np.ndarray  # per column
    integer: np.ndarray  # bool per column
    row_lower: np.ndarray
    row_upper: np.ndarray
    rows: np.ndarray  # coordinate form of the constraint matrix
    cols: np.ndarray
    vals: np.ndarray
    x_cols: dict[int, tuple[np.ndarray, int]]  # group -> (its finite strategies, first column)
    num_edge_vars: int

    @property
    def num_cols(self) -> int:
        return len(self.cost)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


class _Builder:
    def __init__(self) -> None:
        self.cost: list[np.ndarray] = []
        self.integer: list[np.ndarray] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.r: list[np.ndarray] = []
        self.c: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.n_cols = 0

    def columns(self, cost: np.ndarray, integer: bool) -> int:
        first = self.n_cols
        self.cost.append(np.asarray(cost, dtype=np.float64))
        self.integer.append(np.full(len(cost), integer))
        self.n_cols += len(cost)
        return first

    def rows(self, n: int, low: float, high: float) -> int:
        first = len(self.row_lower)
        self.row_lower += [low] * n
        self.row_upper += [high] * n
        return first

    def entries(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray | float) -> None:
        self.r.append(np.asarray(rows, dtype=np.int64))
        self.c.append(np.asarray(cols, dtype=np.int64))
        self.v.append(np.broadcast_to(np.asarray(vals, dtype=np.float64), np.shape(rows)))


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class PeakRow:
    """The recomputation choice's memory row (problem/recompute.py) in the model's terms:
    bytes per class pair of the edges that keep activations (by position in the edge list),
    bytes per strategy of the groups holding model states, and the limit."""

    edge_bytes: dict[int, np.ndarray]
    group_bytes: dict[int, np.ndarray]
    limit: float


PEAK_UNIT = float(2**30)
"""The peak row is in GiB: HiGHS' tolerance (1e-7 of a unit) is ~100 bytes."""


def build_array_model(unary: list[np.ndarray], edges: list, alive: list[int],
                      budget: tuple[dict[int, np.ndarray], float, float | None, float | None] | None,
                      peak: PeakRow | None = None) -> ArrayModel:
    """The ILP over the `alive` groups' finite strategies and the given edges (objects with
    u, v, cu, cv, cost); `budget`: (bytes per strategy of each parameter group, total bytes,
    low, high fraction of the total) or None; `peak`: the memory row of a solve that
    chooses recomputation, or None."""
    b = _Builder()
    x_cols: dict[int, tuple[np.ndarray, int]] = {}
    for g in alive:
        idx = np.flatnonzero(np.isfinite(unary[g]))
        first = b.columns(unary[g][idx], integer=True)
        x_cols[g] = (idx, first)
        row = b.rows(1, 1.0, 1.0)
        b.entries(np.full(len(idx), row), first + np.arange(len(idx)), 1.0)
    n_y = 0
    peak_row = b.rows(1, -np.inf, peak.limit / PEAK_UNIT) if peak is not None else None
    for pos, e in enumerate(edges):
        (su, fu), (sv, fv) = x_cols[e.u], x_cols[e.v]
        src_cls, src_of = np.unique(e.cu[su], return_inverse=True)  # classes present, each x's class position
        dst_cls, dst_of = np.unique(e.cv[sv], return_inverse=True)
        table = e.cost[np.ix_(src_cls, dst_cls)]
        ia, ib = np.nonzero(np.isfinite(table))  # row-major: a, then b
        first = b.columns(table[ia, ib], integer=False)
        n_y += len(ia)
        ms = b.rows(len(src_cls), 0.0, 0.0)  # sum_b y[a, b] - sum_{s in a} x[u, s] = 0
        md = b.rows(len(dst_cls), 0.0, 0.0)  # sum_a y[a, b] - sum_{t in b} x[v, t] = 0
        y = first + np.arange(len(ia))
        b.entries(ms + ia, y, 1.0)
        b.entries(md + ib, y, 1.0)
        b.entries(ms + src_of, fu + np.arange(len(su)), -1.0)
        b.entries(md + dst_of, fv + np.arange(len(sv)), -1.0)
        if peak_row is not None and pos in peak.edge_bytes:
            kept = peak.edge_bytes[pos][np.ix_(src_cls, dst_cls)][ia, ib] / PEAK_UNIT
            b.entries(np.full(len(ia), peak_row), y, kept)
    if peak_row is not None:
        for g, gb in peak.group_bytes.items():
            idx, first = x_cols[g]
            b.entries(np.full(len(idx), peak_row), first + np.arange(len(idx)), gb[idx] / PEAK_UNIT)
    if budget is not None:
        param_bytes, total, low, high = budget
        scale = BUDGET_SCALE / total
        row = b.rows(1, -np.inf if low is None else (low - BUDGET_SLACK) * BUDGET_SCALE,
                     np.inf if high is None else (high + BUDGET_SLACK) * BUDGET_SCALE)
        for g, pb in param_bytes.items():
            idx, first = x_cols[g]
            b.entries(np.full(len(idx), row), first + np.arange(len(idx)), pb[idx] * scale)
    cost = _cat(b.cost, np.float64)
    return ArrayModel(cost=cost, integer=_cat(b.integer, bool),
                      row_lower=np.asarray(b.row_lower, dtype=np.float64),
                      row_upper=np.asarray(b.row_upper, dtype=np.float64),
                      rows=_cat(b.r, np.int64), cols=_cat(b.c, np.int64), vals=_cat(b.v, np.float64),
                      x_cols=x_cols, num_edge_vars=n_y)


def to_highs_lp(m: ArrayModel, *, integer: bool) -> highspy.HighsLp:
    """A highspy.HighsLp (column-wise matrix, every column in [0, 1]) of `m`; `integer`
    False: its LP relaxation."""
    order = np.lexsort((m.rows, m.cols))
    counts = np.bincount(m.cols, minlength=m.num_cols)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = m.num_cols, m.num_rows
    lp.col_cost_ = m.cost
    lp.col_lower_ = np.zeros(m.num_cols)
    lp.col_upper_ = np.ones(m.num_cols)
    inf = highspy.kHighsInf
    lp.row_lower_ = np.where(np.isfinite(m.row_lower), m.row_lower, -inf)
    lp.row_upper_ = np.where(np.isfinite(m.row_upper), m.row_upper, inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = m.num_cols, m.num_rows
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lp.a_matrix_.index_ = m.rows[order].astype(np.int32)
    lp.a_matrix_.value_ = m.vals[order]
    if integer:
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[i] for i in m.integer.tolist()]
    return lp


def read_labels(m: ArrayModel, col_value: np.ndarray) -> dict[int, int]:
    """Each remaining group's strategy: its largest x (the lowest strategy index on a tie)."""
    out = {}
    for g, (idx, first) in m.x_cols.items():
        vals = col_value[first:first + len(idx)]
        out[g] = int(idx[int(np.argmax(vals))])
    return out
