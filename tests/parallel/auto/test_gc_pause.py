"""Planning runs with Python's cyclic collector paused, and gives it back as it found it."""

from __future__ import annotations

import gc

import pytest
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto import api
from parallel.auto.api import fake_world
from parallel.auto.config import PlannerConfig
from parallel.auto.request import PlanRequest, planning
from parallel.auto.trace.gc_pause import collector_paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_pause_restores_the_collector_after_an_error_and_leaves_an_off_collector_off(collector_on):
    with pytest.raises(ValueError):
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():  # nested: still paused after the inner one ends
                pass
            assert not gc.isenabled()
            raise ValueError("planning failed")
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off itself keeps it off
    with collector_paused():
        pass
    assert not gc.isenabled()


@pytest.mark.slow
def test_every_planning_stage_runs_paused_and_the_collector_is_back_after(collector_on, monkeypatch):
    seen: dict[str, list[bool]] = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, []).append(gc.isenabled())
            return fn(*args, **kwargs)
        monkeypatch.setattr(api, name, wrapped)

    for name in ("trace_joint", "build_problem", "trace_step", "apply_plan"):
        spy(name, getattr(api, name))
    request = PlanRequest(local_batch_size=2, seq_len=32, planner=PlannerConfig(hardware="h100"))
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with planning(build_model("llama3", "debug", device="meta", n_layers=2), mesh, request) as autop:
            plan = autop.optimize_placement(verbose=False)
        assert gc.isenabled()
        model = build_model("llama3", "debug", device="meta", n_layers=2)
        with api.AutoParallel(model, autop.input_fn, mesh, loss_fn=api.lm_loss,  # the API without planning()
                              planner=request.planner) as direct:
            direct.apply_placement(plan)
            assert gc.isenabled()  # between calls, the user's code runs with it on
    # traced twice (planning(), then the API alone), solved and estimated once, applied once
    assert sorted(seen) == ["apply_plan", "build_problem", "trace_joint", "trace_step"]
    assert len(seen["trace_joint"]) == 2 and len(seen["apply_plan"]) == 1
    assert not any(v for values in seen.values() for v in values), seen
    assert gc.isenabled()
