"""tools/fidelity.py: its statistics against hand-computed values (ties included), the
plan digest that deduplicates its plans, exit 2 when too few distinct plans remain, and
(slow) the script end to end on a tiny job (2 gloo ranks, 3 plans)."""

from __future__ import annotations

import io
import math
import random
import re
import sys
from pathlib import Path

import pytest

from tools import rank_stats as st

ROOT = Path(__file__).resolve().parents[2]


def _fidelity():
    from tools import fidelity  # the spawned ranks unpickle its job from tools.fidelity

    return fidelity


def test_average_ranks_share_the_mean_rank_of_a_tie():
    assert st.average_ranks([10, 20, 20, 30]) == [1, 2.5, 2.5, 4]
    assert st.average_ranks([5, 5, 5, 1]) == [3, 3, 3, 1]


def test_spearman_does_not_break_a_tie_in_the_measured_order():
    # ordinal ranks in listing order would give [1, 2, 3] vs [1, 2, 3]: rho = 1
    pred, meas = [1.0, 1.0, 2.0], [1.0, 2.0, 3.0]
    assert st.spearman(pred, meas) == pytest.approx(math.sqrt(3) / 2)  # 1.5 / sqrt(1.5 * 2)
    assert st.spearman(pred[::-1], meas[::-1]) == pytest.approx(math.sqrt(3) / 2)
    # ties on both sides: ranks [1, 2.5, 2.5, 4] vs [1, 3, 2, 4]: 4.5 / sqrt(4.5 * 5)
    assert st.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert st.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_kendall_is_tau_b():
    # one tie in the prediction: 2 concordant pairs of 3, denominator sqrt((3 - 1) * 3); tau-a would be 2/3
    assert st.kendall_tau_b([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))
    # a tie on each side: 4 concordant, sqrt(5 * 5)
    assert st.kendall_tau_b([1, 1, 2, 3], [1, 2, 2, 3]) == pytest.approx(0.8)
    assert st.kendall_tau_b([1, 1, 2, 3], [3, 2, 2, 1]) == pytest.approx(-0.8)
    assert st.kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)


def test_rho_has_a_seeded_bootstrap_interval_around_it():
    rng = random.Random(0)
    a = [rng.random() for _ in range(10)]
    b = [x + rng.gauss(0, 0.2) for x in a]
    low, high = st.spearman_interval(a, b)
    assert -1 <= low <= st.spearman(a, b) <= high <= 1
    assert (low, high) == st.spearman_interval(a, b)  # seeded: the same data, the same interval
    assert all(math.isnan(x) for x in st.spearman_interval([1, 2], [2, 1]))  # two pairs: no interval


def test_mean_and_median_ape_are_different_numbers():
    pred, meas = [110.0, 90.0, 100.0], [100.0, 100.0, 50.0]
    assert st.ape(pred, meas) == pytest.approx([10, 10, 100])
    assert st.mean_ape(pred, meas) == pytest.approx(40.0)
    assert st.median_ape(pred, meas) == pytest.approx(10.0)


def test_regrets():
    meas = [10.0, 12.0, 8.0]
    assert st.selection_regret([3, 1, 2], meas) == pytest.approx(12 / 8 - 1)
    assert st.selection_regret([1, 1, 2], meas) == pytest.approx(11 / 8 - 1)  # a tie: the mean of the tied
    assert st.selection_regret([2, 3, 1], meas) == 0.0
    assert st.regret_of(10.0, meas) == pytest.approx(0.25)


def test_distinct_keeps_the_first_of_each_digest_and_lists_the_rest():
    kept, dups = st.distinct({"auto": "a", "budget_1.0": "a", "ddp": "b", "fsdp": "c", "x": "b"})
    assert kept == ["auto", "ddp", "fsdp"]
    assert dups == {"budget_1.0": "auto", "x": "ddp"}


def _plan(out: str, objective: float, constraints: list[str]):
    from parallel.auto.plan.data import NodePlan, Plan

    nodes = {"w": NodePlan("w", "placeholder", "w", "param w", "fwd", "", 0, [], [], [out]),
             "mm": NodePlan("mm", "op", "aten.mm", "", "fwd", "", 1, ["x", "w"], ["(S(0),)", out], ["(S(0),)"])}
    return Plan(nodes=nodes, objective_us=objective, compute_us=1.0, comm_us={}, comm_bytes={}, solver="highs",
                status="optimal", timings={"solve": objective}, num_vars=2, fingerprint="f", input_shapes=[],
                mesh_shape=[2], mesh_axis_names=["dp_shard"], hardware="cpu", torch_version="x",
                constraints=constraints)


def test_placement_digest_sees_placements_only():
    base = _plan("(R,)", 10.0, [])
    assert _plan("(R,)", 12.0, ["budget high 1.0"]).placement_digest() == base.placement_digest()
    assert _plan("(S(0),)", 10.0, []).placement_digest() != base.placement_digest()


def _rows(meas: dict[str, float], obj: dict[str, float], sim: dict[str, float]) -> dict:
    return {n: {"step_s": meas[n] / 1e3, "objective_us": obj[n] * 1e3, "predicted_s": sim[n] / 1e3,
                "digest": n, "repriced": False} for n in meas}


def test_too_few_distinct_plans_is_exit_2_naming_the_duplicates():
    fid = _fidelity()
    result = {"digests": {"auto": "a", "budget_1.0": "a", "fsdp": "c"}, "duplicates": {"budget_1.0": "auto"},
              "failed": {"tp": "ConfigError: no plan"}, "rows": {}}
    out = io.StringIO()
    assert fid.report(result, 3, out) == 2
    text = out.getvalue()
    assert "plan budget_1.0: duplicate of auto" in text
    assert "plan tp: not planned (ConfigError: no plan)" in text
    assert "only 2 distinct plans" in text and "Spearman" not in text


def test_report_scores_both_predictors_and_the_planner():
    fid = _fidelity()
    meas = {"auto": 12.0, "fsdp": 10.0, "ddp": 16.0}
    obj = {"auto": 5.0, "fsdp": 6.0, "ddp": 7.0}  # the objective ranks auto first: regret 12/10 - 1
    sim = {"auto": 11.0, "fsdp": 11.0, "ddp": 20.0}  # a tie for the best: (12 + 10) / 2 / 10 - 1
    result = {"digests": {n: n for n in meas}, "duplicates": {}, "failed": {}, "rows": _rows(meas, obj, sim)}
    out = io.StringIO()
    assert fid.report(result, 3, out) == 0
    text = out.getvalue()
    ilp = next(ln for ln in text.splitlines() if ln.startswith("ILP objective"))
    sim_line = next(ln for ln in text.splitlines() if ln.startswith("step simulation"))
    assert "Spearman rho  0.500" in ilp and "Kendall tau-b  0.333" in ilp and "selection regret  20.0%" in ilp
    assert "mean APE   51.5%" in ilp  # (7/12 + 4/10 + 9/16) / 3
    assert "Spearman rho  0.866" in sim_line and "selection regret  10.0%" in sim_line
    assert "median APE   10.0%" in sim_line  # 8.3 %, 10 %, 25 %
    assert "planner regret 20.0%" in text and "NOT met" in text


def test_the_scatter_has_a_point_per_timed_plan_at_its_simulated_and_measured_ms(tmp_path):
    fid = _fidelity()
    meas, sim = {"auto": 12.0, "fsdp": 10.0, "ddp": 16.0}, {"auto": 11.0, "fsdp": 11.0, "ddp": 20.0}
    result = {"rows": _rows(meas, {n: 1.0 for n in meas}, sim)}
    svg = fid.write_scatter(result, tmp_path / "s.svg").read_text()
    points = re.findall(r'<circle [^>]*data-plan="(\w+)" data-predicted="([\d.]+)" data-measured="([\d.]+)"', svg)
    assert sorted((n, float(p), float(m)) for n, p, m in points) == sorted((n, sim[n], meas[n]) for n in meas)
    assert 'class="identity"' in svg


def _table(stdout: str) -> dict[str, tuple[float, ...]]:
    """plan -> (objective ms, simulated ms, measured ms, rank obj, rank sim, rank meas) from the
    script's printed table."""
    rows, inside = {}, False
    for line in stdout.splitlines():
        if line.startswith("plan ") and "objective ms" in line:
            inside = True
            continue
        if inside:
            parts = line.split()
            if len(parts) < 8:
                break
            rows[parts[0]] = tuple(float(x.rstrip("*").replace(",", "")) for x in parts[2:8])
    return rows


def _slack(num: float, den: float) -> float:
    """How far 100 * (num / den) can move, in points, when both were printed to 0.1 ms, plus the
    percentage's own printing (0.05)."""
    return 0.05 + 100 * 0.05 * (1 / den + num / den**2)


_STAT = re.compile(r"Spearman rho\s+(-?[\d.]+)\s+Kendall tau-b\s+(-?[\d.]+)\s+mean APE\s+([\d.]+)%.*"
                   r"selection regret\s+([\d.]+)%")


@pytest.mark.slow
def test_the_script_on_a_tiny_job_prints_statistics_a_library_recomputes(tmp_path):
    """2 gloo ranks, 3 plans, run as a user runs it: its rank statistics equal scipy's over the
    ranks it prints (which are scipy's ranks of the printed values wherever those differ), its
    APE and regrets equal the table's arithmetic within what printing 0.1 ms can move them."""
    import os
    import subprocess

    from scipy import stats

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = ["--model", "none", "--model.n_layers", "1", "--model.dim", "64", "--training.seq_len", "32",
           "--training.local_batch_size", "2", "--steps", "3", "--warmup", "1", "--plan-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fidelity.py"), "--mesh", "2",
                        "--plans", "auto,fsdp,tp", *job],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    table = _table(r.stdout)
    assert sorted(table) == ["auto", "fsdp", "tp"], r.stdout[-3000:]
    names = sorted(table)
    obj, sim, meas, r_obj, r_sim, r_meas = ([table[n][i] for n in names] for i in range(6))
    # The table prints 0.1 ms: two values apart by less can print equal. The ranks it prints come
    # from the unrounded values; where the printed values are distinct they must be scipy's ranks,
    # and the rank statistics are recomputed from them (they depend on nothing else).
    for values, ranks in ((obj, r_obj), (sim, r_sim), (meas, r_meas)):
        if len(set(values)) == len(values):
            assert ranks == list(stats.rankdata(values)), (values, ranks, r.stdout[-3000:])
    best = min(meas)
    for label, pred, r_pred in (("ILP objective", obj, r_obj), ("step simulation", sim, r_sim)):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(label))
        rho, tau, mape, regret = map(float, _STAT.search(line).groups())
        assert rho == pytest.approx(stats.spearmanr(r_pred, r_meas)[0], abs=1.5e-3), line
        assert tau == pytest.approx(stats.kendalltau(r_pred, r_meas)[0], abs=1.5e-3), line
        slack = max(_slack(p, m) for p, m in zip(pred, meas))
        assert mape == pytest.approx(100 * sum(abs(p - m) / m for p, m in zip(pred, meas)) / 3, abs=slack), line
        low = [m for rp, m in zip(r_pred, meas) if rp == min(r_pred)]  # every plan of a tie for the predicted best
        assert regret == pytest.approx(100 * (sum(low) / len(low) / best - 1), abs=_slack(max(low), best)), line
    assert (tmp_path / "fidelity_scatter.svg").read_text().count("<circle ") == 3
    planner = float(re.search(r"planner regret ([\d.]+)%", r.stdout).group(1))
    auto = table["auto"][2]
    assert planner == pytest.approx(100 * (auto / best - 1), abs=_slack(auto, best))
