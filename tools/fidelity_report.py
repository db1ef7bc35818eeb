"""The report of tools/fidelity.py: the table of plans (predicted, measured, ranks, the
repeats' spread), the predictors' scores, the goal's verdict, a suite's table and the scatter.
It reads the rows the timed job brought back; nothing here runs a plan."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallel.auto.plan.html import write_html
from parallel.auto.plan.pictures.scatter import scatter_svg
from tools import rank_stats as st


@dataclass(frozen=True)
class Goal:
    """The fidelity goal: the ILP objective's Spearman rho at least `rho` and the planner's
    regret (a fraction) at most `regret`, on the measured medians; `enforce`: a miss is exit 1."""

    rho: float = 0.9
    regret: float = 0.02
    enforce: bool = False

    def text(self) -> str:
        return f"ILP objective rho >= {self.rho:g}, planner regret <= {self.regret * 100:g}%"


@dataclass(frozen=True)
class Verdict:
    """One job's figures against the goal; `missed`: one phrase per figure that missed."""

    plans: int
    repeats: int
    rho: float
    rho_interval: tuple[float, float]
    regret: float
    regret_interval: tuple[float, float]
    missed: tuple[str, ...]

    @property
    def met(self) -> bool:
        return not self.missed


def _runs_ms(rows: dict, names: list[str]) -> list[list[float]]:
    """Each plan's repeated step figures in ms (one run: its one figure)."""
    return [[x * 1e3 for x in rows[n].get("runs_s", [rows[n]["step_s"]])] for n in names]


def _rho_interval(pred: list[float], meas: list[float], runs: list[list[float]]) -> tuple[float, float, str]:
    """rho's 95% bootstrap interval: over each plan's repeats when every plan has two or more,
    else over the plans (see the module docstring); with what it resampled."""
    if min(len(r) for r in runs) >= 2:
        return (*st.repeats_interval(runs, lambda m: st.spearman(pred, m)), "repeats")
    return (*st.spearman_interval(pred, meas), "plans")


def _scores(name: str, pred: list[float], meas: list[float], names: list[str], runs: list[list[float]]) -> str:
    best = min(pred)
    picked = [n for n, p in zip(names, pred) if p == best]
    rho, tau = st.spearman(pred, meas), st.kendall_tau_b(pred, meas)
    low, high, over = _rho_interval(pred, meas, runs)
    return (f"{name:<16} Spearman rho {rho:6.3f}   Kendall tau-b {tau:6.3f}   "
            f"mean APE {st.mean_ape(pred, meas):6.1f}%   median APE {st.median_ape(pred, meas):6.1f}%   "
            f"selection regret {st.selection_regret(pred, meas) * 100:5.1f}% (predicted best: {', '.join(picked)})   "
            f"rho 95% bootstrap interval [{low:.2f}, {high:.2f}] (over the {over})")


def judge(rows: dict, goal: Goal) -> Verdict:
    """The ILP objective's rho and the planner's regret on the measured medians, their 95%
    intervals (regret's only with repeats), and which of them missed the goal (nan misses)."""
    names = list(rows)
    meas = [rows[n]["step_s"] * 1e3 for n in names]
    obj = [rows[n]["objective_us"] / 1e3 for n in names]
    runs = _runs_ms(rows, names)
    rho, regret = st.spearman(obj, meas), st.regret_of(rows["auto"]["step_s"] * 1e3, meas)
    low, high, _ = _rho_interval(obj, meas, runs)
    i = names.index("auto")
    regret_iv = st.repeats_interval(runs, lambda m: st.regret_of(m[i], m))
    missed = []
    if not rho >= goal.rho:
        missed.append(f"ILP objective rho {rho:.3f} < {goal.rho:g}")
    if not regret <= goal.regret:
        missed.append(f"planner regret {regret * 100:.1f}% > {goal.regret * 100:g}%")
    return Verdict(len(names), min(len(r) for r in runs), rho, (low, high), regret, regret_iv, tuple(missed))


def goal_line(verdict: Verdict, goal: Goal) -> str:
    if verdict.met:
        return f"goal ({goal.text()}): met"
    return f"goal NOT met: {'; '.join(verdict.missed)} (goal: {goal.text()})"


def _print_table(rows: dict, names: list[str], out: Any) -> None:
    meas = [rows[n]["step_s"] * 1e3 for n in names]
    obj = [rows[n]["objective_us"] / 1e3 for n in names]
    sim = [rows[n]["predicted_s"] * 1e3 for n in names]
    runs = _runs_ms(rows, names)
    spread = max(len(r) for r in runs) > 1
    r_meas, r_obj, r_sim = st.average_ranks(meas), st.average_ranks(obj), st.average_ranks(sim)
    print(f"{'plan':<28} {'digest':<16} {'objective ms':>12} {'sim ms':>9} {'measured ms':>11} "
          f"{'rank obj':>8} {'rank sim':>8} {'rank meas':>9} {'meas/sim':>8}"
          + (f" {'runs min-max ms':>17}" if spread else ""), file=out)
    for i, n in enumerate(names):
        mark = "*" if rows[n].get("repriced") else ""
        print(f"{n:<28} {rows[n]['digest']:<16} {obj[i]:>11.1f}{mark:1} {sim[i]:>9.1f} {meas[i]:>11.1f} "
              f"{r_obj[i]:>8.1f} {r_sim[i]:>8.1f} {r_meas[i]:>9.1f} {meas[i] / sim[i]:>8.2f}"
              + (f" {f'{min(runs[i]):.1f}-{max(runs[i]):.1f}':>17}" if spread else ""), file=out)


def _print_failures(result: dict, out: Any) -> int:
    """The variants not planned and the duplicates; the number of distinct plans."""
    dups, failed = result["duplicates"], result["failed"]
    for n, why in failed.items():
        print(f"plan {n}: not planned ({why})", file=out)
    for n, same in dups.items():
        print(f"plan {n}: duplicate of {same} (placement digest {result['digests'][n]})", file=out)
    return len(result["digests"]) - len(dups)


def report_job(result: dict, min_plans: int, out: Any = sys.stdout,
               goal: Goal = Goal()) -> tuple[int, Verdict | None]:
    """Print the table and statistics, and judge the goal: (0, verdict); (1, verdict) when the
    goal is enforced and missed; (2, None) with fewer distinct plans than requested."""
    n_distinct = _print_failures(result, out)
    if n_distinct < min_plans:
        print(f"only {n_distinct} distinct plans of {len(result['digests']) + len(result['failed'])} variants "
              f"({len(result['duplicates'])} duplicates, {len(result['failed'])} not planned); {min_plans} were "
              "requested: no statistics over duplicates. Ask for fewer (--min-plans) or other plans (--plans)",
              file=out)
        return 2, None
    rows = result["rows"]
    names = sorted(rows, key=lambda n: rows[n]["step_s"])
    _print_table(rows, names, out)
    if any(r.get("repriced") for r in rows.values()):
        own, again = result.get("reprice_check", (None, None))
        print("* solved on another profile; its placements re-priced on the free plan's job and calibrated profile"
              + (f" (check: auto's objective {own / 1e3:.1f} ms, re-priced {again / 1e3:.1f} ms)" if again else ""),
              file=out)
    if result.get("reprice_error"):
        print(f"re-pricing failed ({result['reprice_error']}): plans of another profile keep its objective",
              file=out)
    meas, runs = [rows[n]["step_s"] * 1e3 for n in names], _runs_ms(rows, names)
    verdict = judge(rows, goal)
    print(f"\n{len(names)} distinct plans (measured best: {names[0]}"
          + (f"; medians of {verdict.repeats} runs each)" if verdict.repeats > 1 else ")"), file=out)
    for label, key, scale in (("ILP objective", "objective_us", 1e-3), ("step simulation", "predicted_s", 1e3)):
        print(_scores(label, [rows[n][key] * scale for n in names], meas, names, runs), file=out)
    low, high = verdict.regret_interval
    auto_ms = rows["auto"]["step_s"] * 1e3
    interval = "" if math.isnan(low) else f"; 95% bootstrap interval over the repeats [{low:.1%}, {high:.1%}]"
    print(f"planner regret {verdict.regret * 100:.1f}% (the free plan 'auto' measured {auto_ms:.1f} ms){interval}",
          file=out)
    print(goal_line(verdict, goal), file=out)
    return (1 if goal.enforce and not verdict.met else 0), verdict


def report(result: dict, min_plans: int, out: Any = sys.stdout, goal: Goal = Goal()) -> int:
    """`report_job`'s exit status alone."""
    return report_job(result, min_plans, out, goal)[0]


def write_scatter(result: dict, path: str | Path) -> Path:
    """The step simulation (x) against the measured median (y) of every timed plan, in ms, as
    an SVG with the y = x line (parallel/auto/plan/pictures/scatter.py)."""
    rows = result["rows"]
    points = [(n, r["predicted_s"] * 1e3, r["step_s"] * 1e3) for n, r in sorted(rows.items())]
    write_html(path, scatter_svg(points, title=f"step simulation vs measured ({len(points)} plans)"))
    return Path(path)


def suite_table(rows: list[tuple[str, int, Verdict | None, str]], goal: Goal, out: Any = sys.stdout) -> int:
    """One row a job (from its name, exit status, verdict, and why it has none: rho, its
    interval, regret, met or why not) and a summary line; the exit status: 2 when a job had
    too few distinct plans, 1 when any other missed, else 0."""
    print(f"\n{'job':<26} {'plans':>5} {'runs':>4} {'rho obj':>7} {'95% interval':>14} {'regret':>7} "
          f"{'95% interval':>16}  goal", file=out)
    for name, _rc, v, why in rows:
        if v is None:
            print(f"{name:<26} {'':>5} {'':>4} {'':>7} {'':>14} {'':>7} {'':>16}  NOT met: {why}", file=out)
            continue
        (lo, hi), (rlo, rhi) = v.rho_interval, v.regret_interval
        r_iv = "" if math.isnan(rlo) else f"[{rlo * 100:.1f}, {rhi * 100:.1f}]%"
        print(f"{name:<26} {v.plans:>5} {v.repeats:>4} {v.rho:>7.3f} {f'[{lo:.2f}, {hi:.2f}]':>14} "
              f"{v.regret * 100:>6.1f}% {r_iv:>16}  {'met' if v.met else 'NOT met: ' + '; '.join(v.missed)}",
              file=out)
    met = sum(1 for _, _, v, _ in rows if v is not None and v.met)
    print(f"{met} of {len(rows)} jobs met the goal ({goal.text()})", file=out)
    if any(rc == 2 for _, rc, _, _ in rows):
        return 2
    return 0 if met == len(rows) else 1
