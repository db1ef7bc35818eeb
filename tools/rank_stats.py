"""The statistics of tools/fidelity.py: rank correlations from `scipy.stats`, errors and regrets.

* `average_ranks`: ties share the mean of the ranks they span (`scipy.stats.rankdata`): a tie
  is never broken by the other variable's order, which would inflate a rank correlation;
* `spearman`: Spearman's rho with average ranks for ties (`scipy.stats.spearmanr`);
* `spearman_interval`: a bootstrap confidence interval for rho (`scipy.stats.bootstrap`, the
  (predicted, measured) pairs resampled together): what another draw of *plans* could give;
* `repeats_interval`: a bootstrap confidence interval for any statistic of the plans' median
  step times when each plan was timed several times (`scipy.stats.bootstrap` with one sample
  per plan, unpaired: each plan's repeats resampled on their own, the predictions fixed):
  what another round of *runs* of the same plans could give, i.e. the run-to-run noise;
* `kendall_tau_b`: Kendall's tau-b (`scipy.stats.kendalltau(variant="b")`);
* `ape`: absolute percentage errors |predicted - measured| / measured, their mean (MAPE)
  and median (MdAPE) reported separately;
* `selection_regret`: measured time of the plan a predictor ranks first / the measured
  best - 1 (a tie for the predicted best: the mean over the tied plans, what a random pick
  among them would cost).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Sequence

from scipy import stats


def average_ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, tied values given the mean of the positions they occupy."""
    return [float(r) for r in stats.rankdata(xs, method="average")]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho with average ranks for ties (both sides); nan when a side is constant."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        return float(stats.spearmanr(a, b).statistic)


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b: ties in either variable leave the pair neither concordant nor
    discordant and shrink the denominator; nan when a side is constant."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.kendalltau(a, b, variant="b").statistic)


def _rho_or_zero(a: Sequence[float], b: Sequence[float]) -> float:
    """rho of one bootstrap resample; a resample with a constant side (the same plan drawn
    every time) orders nothing: 0, not nan, so that it cannot void the whole interval."""
    rho = spearman(a, b)
    return 0.0 if math.isnan(rho) else rho


def spearman_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95,
                      n_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval for Spearman's rho over the pairs (a[i], b[i]); (nan, nan)
    below 3 pairs. Seeded: the same data give the same interval."""
    if len(a) < 3:
        return math.nan, math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's note on a degenerate resample distribution
        res = stats.bootstrap((list(a), list(b)), _rho_or_zero, paired=True, vectorized=False,
                              confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                              rng=seed)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def repeats_interval(runs: Sequence[Sequence[float]], statistic: Callable[[list[float]], float],
                     confidence: float = 0.95, n_resamples: int = 2000,
                     seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic(medians)`, `runs[i]` being plan i's repeated
    step figures and `medians[i]` their median: every resample draws each plan's repeats with
    replacement, independently of the other plans (`scipy.stats.bootstrap`, one sample per
    plan, `paired=False`). (nan, nan) below 3 plans or 2 repeats a plan. Seeded.

    Why over the repeats and not over the plans: the plans are not a random sample of a
    population (they are the variants this script builds, the same every run), and the goal is
    about *this* set of plans ranking the same way run after run; what moves between runs is
    the clock, and resampling each plan's repeats draws exactly that. A resample with a
    constant side scores 0 (`_rho_or_zero`), not nan."""
    if len(runs) < 3 or min(len(r) for r in runs) < 2:
        return math.nan, math.nan

    def on_medians(*samples: Sequence[float]) -> float:
        value = statistic([float(statistics.median(s)) for s in samples])
        return 0.0 if math.isnan(value) else value

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's note on a degenerate resample distribution
        res = stats.bootstrap(tuple(list(r) for r in runs), on_medians, paired=False, vectorized=False,
                              confidence_level=confidence, n_resamples=n_resamples, method="percentile",
                              rng=seed)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


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
