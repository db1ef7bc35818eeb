"""tools/fidelity.py: its statistics against hand-computed values (ties included), the
plan digest that deduplicates its plans, exit 2 when too few distinct plans remain, and
(slow) the script end to end on a tiny job (2 gloo ranks, 3 plans, 2 repeats); the repeats'
medians, their bootstrap intervals, the goal's exit status and the issue-49 suite on synthetic
figures."""

from __future__ import annotations

import io
import math
import random
import re
import statistics
import sys
from pathlib import Path

import pytest

from tools import fidelity_report as rep
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
    """2 gloo ranks, 3 plans, 2 repeats, run as a user runs it: its rank statistics equal scipy's over the
    ranks it prints (which are scipy's ranks of the printed values wherever those differ), its
    APE and regrets equal the table's arithmetic within what printing 0.1 ms can move them."""
    import os
    import subprocess

    from scipy import stats

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = ["--model", "none", "--model.n_layers", "1", "--model.dim", "64", "--training.seq_len", "32",
           "--training.local_batch_size", "2", "--steps", "3", "--warmup", "1", "--plan-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fidelity.py"), "--mesh", "2",
                        "--plans", "auto,fsdp,tp", "--repeats", "2", *job],
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
    # --repeats 2: two interleaved runs a plan, their min-max around the printed median
    assert "medians of 2 runs each" in r.stdout and "(over the repeats)" in r.stdout
    for parts in (ln.split() for ln in r.stdout.splitlines()):
        if len(parts) == 10 and parts[0] in table:  # a table row: 9 columns and the runs' min-max
            low, high = map(float, parts[-1].replace(",", "").split("-"))
            assert low - 0.05 <= table[parts[0]][2] <= high + 0.05, parts


# --- repeats, the goal and the suite (issue 49) ---

def _noisy_runs(n_plans: int, repeats: int, noise: float, seed: int = 0) -> tuple[list[float], list[list[float]]]:
    """Predictions 1..n and each plan's `repeats` step figures around 10 * its prediction."""
    rng = random.Random(seed)
    pred = [float(i + 1) for i in range(n_plans)]
    return pred, [[10 * p + rng.gauss(0, noise) for _ in range(repeats)] for p in pred]


@pytest.mark.slow
def test_the_repeats_interval_resamples_each_plans_runs_and_holds_rho():
    pred, runs = _noisy_runs(8, 5, noise=8.0)
    meds = [statistics.median(r) for r in runs]
    rho = st.spearman(pred, meds)
    low, high = st.repeats_interval(runs, lambda m: st.spearman(pred, m))
    assert -1 <= low <= rho <= high <= 1 and low < high
    assert (low, high) == st.repeats_interval(runs, lambda m: st.spearman(pred, m))  # seeded
    # runs that never move: every resample has the same medians, the interval is the point
    steady = [[10 * p] * 3 for p in pred]
    assert st.repeats_interval(steady, lambda m: st.spearman(pred, m)) == (1.0, 1.0)
    # noisier runs, a wider interval
    _, loud = _noisy_runs(8, 5, noise=30.0)
    low2, high2 = st.repeats_interval(loud, lambda m: st.spearman(pred, m))
    assert high2 - low2 > high - low
    # one run a plan, or fewer than 3 plans: no interval over the repeats
    assert all(math.isnan(x) for x in st.repeats_interval([[1.0], [2.0], [3.0]], max))
    assert all(math.isnan(x) for x in st.repeats_interval([[1.0, 2.0], [2.0, 3.0]], max))


def test_the_planners_regret_interval_contains_its_regret():
    meds_runs = [[10.0, 10.4, 9.8], [10.1, 10.6, 9.9], [14.0, 15.0, 14.5]]
    meds = [statistics.median(r) for r in meds_runs]
    regret = st.regret_of(meds[1], meds)
    low, high = st.repeats_interval(meds_runs, lambda m: st.regret_of(m[1], m))
    assert regret == pytest.approx(10.1 / 10.0 - 1)
    assert low <= regret <= high and low >= 0


def _repeated_rows(runs: dict[str, list[float]], obj: dict[str, float]) -> dict:
    rows = _rows({n: statistics.median(r) for n, r in runs.items()}, obj, obj)
    for n, r in runs.items():
        rows[n]["runs_s"] = [x / 1e3 for x in r]
    return rows


def test_judge_takes_the_medians_and_names_each_missed_figure():
    fid = _fidelity()
    runs = {"auto": [10.0, 11.0, 30.0], "fsdp": [12.0, 13.0, 9.0], "ddp": [20.0, 21.0, 22.0], "tp": [25.0, 26.0, 24.0]}
    obj = {"auto": 1.0, "fsdp": 2.0, "ddp": 3.0, "tp": 4.0}  # medians 11, 12, 21, 25: rho 1, regret 0
    v = rep.judge(_repeated_rows(runs, obj), fid.Goal())
    assert v.rho == pytest.approx(1.0) and v.regret == 0.0 and v.met and v.repeats == 3 and v.plans == 4
    assert v.rho_interval[0] <= v.rho <= v.rho_interval[1]
    obj_bad = {"auto": 2.0, "fsdp": 1.0, "ddp": 4.0, "tp": 3.0}  # ddp and tp swapped: rho 1 - 6 * 2 / 60
    runs_bad = {**runs, "auto": [13.0, 13.2, 13.1]}  # the free plan 13.1 vs the best 12: 9.2 %
    v = rep.judge(_repeated_rows(runs_bad, obj_bad), fid.Goal())
    assert not v.met and v.regret == pytest.approx(13.1 / 12 - 1)
    assert v.missed == ("ILP objective rho 0.800 < 0.9", "planner regret 9.2% > 2%")
    assert rep.judge(_repeated_rows(runs_bad, obj_bad), fid.Goal(rho=0.5, regret=0.1)).met
    line = rep.goal_line(v, fid.Goal())
    assert line.startswith("goal NOT met: ILP objective rho 0.800 < 0.9; planner regret 9.2% > 2%")


@pytest.mark.slow
def test_report_with_repeats_prints_the_spread_and_enforces_the_goal():
    fid = _fidelity()
    runs = {"auto": [13.0, 13.2, 13.1], "fsdp": [12.0, 13.0, 9.0], "ddp": [20.0, 21.0, 22.0]}
    obj = {"auto": 1.0, "fsdp": 2.0, "ddp": 3.0}
    result = {"digests": {n: n for n in runs}, "duplicates": {}, "failed": {}, "rows": _repeated_rows(runs, obj)}
    out = io.StringIO()
    assert fid.report(result, 3, out) == 0  # the goal is said, not enforced
    text = out.getvalue()
    assert "runs min-max ms" in text and "9.0-13.0" in text and "medians of 3 runs each" in text
    assert "(over the repeats)" in text and "95% bootstrap interval over the repeats" in text
    assert _table(text)["fsdp"][2] == 12.0  # the measured column is the median
    out = io.StringIO()
    rc, verdict = fid.report_job(result, 3, out, fid.Goal(enforce=True))
    assert rc == 1 and not verdict.met
    # auto and fsdp swapped in the measured order: rho 1 - 6 * 2 / 24
    assert "goal NOT met: ILP objective rho 0.500 < 0.9; planner regret 9.2% > 2%" in out.getvalue()
    assert fid.report(result, 3, io.StringIO(), fid.Goal(regret=0.1, rho=0.4, enforce=True)) == 0


def test_one_run_keeps_todays_report_and_the_plans_bootstrap():
    fid = _fidelity()
    meas, obj = {"auto": 10.0, "fsdp": 12.0, "ddp": 16.0}, {"auto": 1.0, "fsdp": 2.0, "ddp": 3.0}
    result = {"digests": {n: n for n in meas}, "duplicates": {}, "failed": {}, "rows": _rows(meas, obj, obj)}
    out = io.StringIO()
    assert fid.report(result, 3, out, fid.Goal(enforce=True)) == 0
    text = out.getvalue()
    assert "runs min-max" not in text and "(over the plans)" in text and "goal (" in text and ": met" in text


def test_time_repeats_interleaves_rounds_and_takes_the_median(monkeypatch):
    fid = _fidelity()
    calls = []

    def fake_round(built, warmup, steps):
        calls.append(warmup)
        k = len(calls)
        return {n: {"step_s": k * (i + 1), "tokens": 8, "losses": [float(k)], "tokens_per_s": 0.0}
                for i, n in enumerate(built)}

    monkeypatch.setattr(fid, "time_round_robin", fake_round)
    rows = fid.time_repeats({"a": None, "b": None}, warmup=2, steps=3, repeats=3)
    assert calls == [2, 0, 0]  # the warm-up in the first round only
    assert rows["a"]["runs_s"] == [1, 2, 3] and rows["a"]["step_s"] == 2
    assert rows["b"]["runs_s"] == [2, 4, 6] and rows["b"]["step_s"] == 4 and rows["b"]["tokens_per_s"] == 2.0
    assert rows["a"]["losses"] == [1.0, 2.0, 3.0]


def test_goal_flags_and_bad_repeats(capsys):
    fid = _fidelity()
    args, _ = fid._parse(["--repeats", "3", "--goal-rho", "0.8", "--goal-regret", "5"])
    assert args.repeats == 3 and args.goal == fid.Goal(0.8, 0.05, enforce=False)
    assert fid._parse(["--goal"])[0].goal.enforce
    assert fid._parse(["--suite", "issue49"])[0].goal.enforce  # a suite always checks its goal
    with pytest.raises(SystemExit) as e:
        fid._parse(["--repeats", "0"])
    assert e.value.code == 2
    assert fid.main(["--plans", "auto,nonsense"]) == 2
    assert "unknown plan(s) ['nonsense']" in capsys.readouterr().err


def test_the_issue49_suite_spans_three_families_two_meshes_two_lengths_and_loads():
    fid = _fidelity()
    jobs = fid.SUITES["issue49"]
    assert len(jobs) == 5
    assert {j.config.split("_")[0] for j in jobs} == {"llama3", "qwen3", "deepseek"}
    assert {fid.fidelity_mesh(j.mesh).names for j in jobs} == {("dp_shard",), ("dp_shard", "tp")}
    args, _ = fid._parse(["--suite", "issue49", "--plan-dir", "/tmp/p"])
    seqs = set()
    for job in jobs:
        jargs = fid._suite_args(args, job)
        flags, err = fid._job_flags(jargs, list(job.flags))
        assert err is None, (job.name, err)
        assert jargs.plan_dir == f"/tmp/p/{job.name}" and jargs.nproc == 4
        seqs.add(flags[len(flags) - 1 - flags[::-1].index("--training.seq_len") + 1])
    assert seqs == {"128", "1024"}


def _verdict(fid, met: bool):
    return fid.Verdict(10, 3, 0.95 if met else 0.5, (0.9, 1.0), 0.0, (0.0, 0.01),
                       () if met else ("ILP objective rho 0.500 < 0.9",))


def test_the_suite_table_has_a_row_a_job_and_its_exit_status(monkeypatch):
    fid = _fidelity()
    goal = fid.Goal(enforce=True)
    out = io.StringIO()
    assert fid.suite_table([("a", 0, _verdict(fid, True), ""), ("b", 0, _verdict(fid, True), "")], goal, out) == 0
    assert "2 of 2 jobs met the goal" in out.getvalue()
    out = io.StringIO()
    assert fid.suite_table([("a", 0, _verdict(fid, True), ""), ("b", 1, _verdict(fid, False), "")], goal, out) == 1
    row = next(ln for ln in out.getvalue().splitlines() if ln.startswith("b "))
    assert "0.500" in row and "[0.90, 1.00]" in row and "NOT met: ILP objective rho 0.500 < 0.9" in row
    rows = [("a", 1, None, "failed (rank 1 failed)"), ("b", 2, None, "too few distinct plans")]
    assert fid.suite_table(rows, goal, io.StringIO()) == 2
    # run_suite: every job runs even after one misses; the table decides the exit status
    ran = []

    def fake_run_job(jargs, flags, extra):
        ran.append(jargs.config)
        return (1, _verdict(fid, False)) if jargs.config == "qwen3_debug" else (0, _verdict(fid, True))

    monkeypatch.setattr(fid, "run_job", fake_run_job)
    args, extra = fid._parse(["--suite", "issue49"])
    assert fid.run_suite(args, extra) == 1
    assert len(ran) == 5
