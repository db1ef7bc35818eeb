"""The soak run's verdicts (tools/soak.py) from rows, without a run: the issue's 5 % limits and
the disk bound by keep_latest_k pass and fail where they should; its timeout's kill reaches a
worker in a session of its own (as torchrun starts them)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.soak import Disk, Row, descendants, kill_job, main, verdicts, window_ms

K = 3
DISK = Disk(peak_count=K + 1, peak_mib=150.0, end_mib=114.0, one_mib=38.0)


def rows(rss_growth: float = 0.0, time_growth: float = 0.0) -> list[Row]:
    """Rows at 500..3000; steps before 500 grow freely (warm-up), after it by the given fractions."""
    out = [Row(500, [600.0, 590.0], [15, 15], 114.0, 3, 400.0)]
    for step in range(1000, 3001, 500):
        f = (step - 1000) / 2000
        out.append(Row(step, [600.0, 590.0 * (1 + rss_growth * (step - 500) / 2500)], [15, 15], 114.0, 4,
                       400.0 * (1 + time_growth * f)))
    return [Row(100, [300.0, 300.0], [20, 20], 38.0, 1, 900.0), *out]


def by_name(rs: list[Row], disk: Disk = DISK, clock: str = "wall") -> dict[str, bool]:
    return {v.name.split(" (")[0]: v.ok for v in verdicts(rs, disk, K, clock=clock)}


def test_flat_rows_pass():
    assert by_name(rows()) == {"rss": True, "step time": True, "disk": True}


def test_rss_growth_after_warm_up_fails_above_5_percent():
    assert by_name(rows(rss_growth=0.03))["rss"]
    assert not by_name(rows(rss_growth=0.06))["rss"]  # one rank growing is enough


def test_step_time_drift_is_measured_from_the_window_after_warm_up():
    assert by_name(rows(time_growth=0.04))["step time"]
    assert not by_name(rows(time_growth=0.06))["step time"]
    assert by_name(rows(time_growth=-0.2))["step time"]  # faster is no drift to worry about
    text = next(v.text for v in verdicts(rows(time_growth=0.06), DISK, K) if v.name == "step time (wall)")
    assert "window to step 1000" in text and "+6.0%" in text


def test_the_cpu_clock_judges_cpu_time_per_step():
    rs = rows(time_growth=0.3)  # wall time slowed by other jobs' load, the CPU time per step flat
    for r in rs:
        r.cpu_ms = 800.0
    assert not by_name(rs)["step time"] and by_name(rs, clock="cpu")["step time"]
    rs[-1].cpu_ms = 800.0 * 1.06
    assert not by_name(rs, clock="cpu")["step time"]


def test_disk_is_bounded_by_keep_latest_k():
    assert not by_name(rows(), Disk(peak_count=K + 2, peak_mib=150.0, end_mib=114.0, one_mib=38.0))["disk"]
    assert not by_name(rows(), Disk(peak_count=K + 1, peak_mib=200.0, end_mib=114.0, one_mib=38.0))["disk"]
    assert not by_name(rows(), Disk())["disk"]  # no complete checkpoint was ever seen


def test_window_median_skips_steps_not_seen():
    times = {1: 0.0, 2: 0.5, 3: 1.0, 4: 3.0, 6: 3.5, 7: 4.0}
    assert window_ms(times, 0, 3) == pytest.approx(500.0)
    assert window_ms(times, 3, 7) == pytest.approx(1250.0)  # gaps 4-3 (2 s), 7-6 (0.5 s); not 6-4


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["--steps", "0"])
    assert e.value.code == 2


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_timeout_kills_workers_in_sessions_of_their_own():
    code = ("import subprocess, sys, time; w = subprocess.Popen(['sleep', '60'], start_new_session=True); "
            "print(w.pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    worker = int(launcher.stdout.readline())
    assert worker in descendants(launcher.pid)
    kill_job(launcher.pid)
    launcher.wait(timeout=10)
    deadline = time.time() + 10
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)
