"""Other work on the host when a job starts (cost/contention.py): the ranks share the cores
with it, so the step is predicted that much slower; the factor lives on the in-memory profile
only, and the cached file keeps the quiet machine's figures."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from parallel.auto.cost import CostModel, load_hardware
from parallel.auto.cost.contention import contention_factor
from parallel.auto.cost.hardware import profile_from_dict, profile_to_toml
from parallel.auto.cost.simulate import simulate_step

try:
    import tomllib
except ImportError:  # pragma: no cover
    import tomli as tomllib  # type: ignore[no-redef]


def test_the_factor_is_the_runnable_threads_over_the_cores():
    # 2 one-thread ranks on 2 cores beside a process spinning on one: 3 threads share 2 cores
    assert contention_factor(0.5, 2, threads_per_rank=1, cores=2) == pytest.approx(1.45)
    assert contention_factor(0.04, 2, threads_per_rank=1, cores=2) == 1.0  # housekeeping, not load
    assert contention_factor(0.5, 1, threads_per_rank=1, cores=4) == 1.0  # free cores left: no slowdown
    assert contention_factor(0.0, 4, threads_per_rank=1, cores=2) == 2.0  # more ranks than cores


def test_the_simulation_and_its_timeline_scale_and_the_cached_file_never_holds_it():
    gm = make_fx(lambda x: (x @ x).relu())(torch.randn(256, 256))
    cm = CostModel("cpu", (1,))
    quiet = simulate_step(gm, cm, {})
    cm.hw = cm.hw.replace(contention=1.5, correction={"step_time_ratio": 1.2, "job": "j"})
    busy = simulate_step(gm, cm, {})
    assert busy.step_us == pytest.approx(1.8 * quiet.step_us) and busy.contention == 1.5
    assert busy.timeline.step_us == pytest.approx(busy.step_us)
    assert max(e.end_us for e in busy.timeline.events) == pytest.approx(busy.step_us)
    assert "x 1.50 (other work on the host" in busy.summary() and "x 1.20" in busy.summary()
    again = profile_from_dict(tomllib.loads(profile_to_toml(cm.hw)))
    assert again.contention == 1.0 and load_hardware("cpu").contention == 1.0
