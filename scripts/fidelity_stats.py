"""The statistics of scripts/fidelity.py, written out so that each is the one it is named.

* `average_ranks`: ties share the mean of the ranks they span (a tie is never broken by
  the other variable's order, which would inflate a rank correlation);
* `spearman`: Pearson's correlation of the average ranks (Spearman's rho with ties);
* `kendall_tau_b`: (concordant - discordant) / sqrt((n0 - ties in a) (n0 - ties in b));
* `ape`: absolute percentage errors |predicted - measured| / measured, their mean (MAPE)
  and median (MdAPE) reported separately;
* `selection_regret`: measured time of the plan a predictor ranks first / the measured
  best - 1 (a tie for the predicted best: the mean over the tied plans, what a random pick
  among them would cost).

No scipy: it is not a dependency; the test checks these against hand-computed values.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence


def average_ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, tied values given the mean of the positions they occupy."""
    order = sorted(range(len(xs)), key=xs.__getitem__)
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _pearson(a: Sequence[float], b: Sequence[float]) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / var if var else math.nan  # a constant variable: no correlation is defined


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho with average ranks for ties (both sides)."""
    return _pearson(average_ranks(a), average_ranks(b))


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b: ties in either variable leave the pair neither concordant nor
    discordant and shrink the denominator."""
    conc = disc = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        ties_a += da == 0
        ties_b += db == 0
        if da and db:
            conc += (da > 0) == (db > 0)
            disc += (da > 0) != (db > 0)
    n0 = len(a) * (len(a) - 1) // 2
    den = math.sqrt((n0 - ties_a) * (n0 - ties_b))
    return (conc - disc) / den if den else math.nan


def ape(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """Absolute percentage error of each prediction, in percent of the measurement."""
    return [abs(p - m) / m * 100 for p, m in zip(predicted, measured)]


def mean_ape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    return statistics.fmean(ape(predicted, measured))


def median_ape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    return statistics.median(ape(predicted, measured))


def selection_regret(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Measured time of the predicted-best plan / the measured best - 1 (a fraction)."""
    best = min(predicted)
    picked = [m for p, m in zip(predicted, measured) if p == best]
    return statistics.fmean(picked) / min(measured) - 1


def regret_of(measured_choice: float, measured: Sequence[float]) -> float:
    """Measured time of one chosen plan / the measured best - 1 (the planner's own regret)."""
    return measured_choice / min(measured) - 1


def distinct(digests: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The first name of each digest (in the given order), and every later name -> the
    name it duplicates."""
    first: dict[str, str] = {}
    dups: dict[str, str] = {}
    for name, d in digests.items():
        if d in first:
            dups[name] = first[d]
        else:
            first[d] = name
    return list(first.values()), dups
