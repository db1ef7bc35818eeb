"""Every planner setting reaches the planner from every entry point: the trainer, scripts/plan.py,
a sweep point and the mesh search. Each test sets one PlannerConfig field to a value other than
its default (through the job's TOML keys, as a user does) and records the PlannerConfig the
planner is built with (AutoParallel replaced by a recorder that finds no plan); the cache key
of a sweep point changes with it too."""

from types import SimpleNamespace

import pytest
import torch

import parallel.auto.request as request
from parallel.auto.config import PlannerConfig, planner_fields
from parallel.auto.cost import load_hardware
from parallel.auto.problem.placement_problem import PlanningError
from parallel.auto.search import point as sweep_point
from parallel.auto.search.mesh_search import search_meshes
from parallel.auto.search.point import PlanCache
from parallel.auto.search.spec import expand_points
from trainer import auto_mode as auto
from trainer import dry_run_auto
from trainer.config import ConfigError, load_config

TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--training.seq_len", "16", "--training.local_batch_size", "1", "--parallelism.hardware", "h100"]
# one value per field, none the default; every field of PlannerConfig must be here
VALUES = {"hardware": "a100", "solver": "mrf", "time_limit": 12.5, "mrf_patience": 7, "mrf_polish": False,
          "repeated_blocks": False, "split_seeding": True,
          "split_seeding_radius": 1, "split_seeding_rounds": 3, "memory_budget_low": 0.05, "memory_budget_high": 0.5,
          "memory_limit_gib": 33.0, "memory_estimate": False, "moe_imbalance_factor": 2.0, "optimizer": "for-loop"}


class Recorder:
    """Stands in for AutoParallel: records the settings it is built with, finds no plan."""

    seen: list[PlannerConfig] = []

    def __init__(self, model, inputs, mesh, *, planner, **_):
        Recorder.seen.append(planner)
        self.input_fn, self.graph, self.memory_high, self.constraints = inputs, None, None, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_input_constraints(self, placements):
        pass

    def add_parameter_memory_constraint(self, low=None, high=None):
        self.memory_high = high

    def cost_model(self):
        return SimpleNamespace(hw=load_hardware("h100"))

    def optimize_placement(self, verbose=True, warm_start=None):
        raise PlanningError("recorded")


@pytest.fixture
def recorder(monkeypatch):
    Recorder.seen = []
    monkeypatch.setattr(request, "AutoParallel", Recorder)
    return Recorder.seen


def test_every_field_is_tested():
    assert {f.name for f in planner_fields()} == set(VALUES)
    assert all(getattr(PlannerConfig(), k) != v for k, v in VALUES.items())


def _flags(key, value) -> list[str]:
    if key == "optimizer":
        return ["--optimizer.implementation", value]
    flags = ["--parallelism." + key, str(value).lower() if isinstance(value, bool) else str(value)]
    if key == "memory_budget_low":  # low must not exceed high: keep a high set too
        flags += ["--parallelism.memory_budget_high", "1.0"]
    return flags


def _job(key, value):
    return load_config("llama3_debug_auto", TINY + _flags(key, value), world_size=2)


FIELDS = sorted(VALUES)


@pytest.mark.parametrize("key", FIELDS)
def test_the_trainer_passes_the_setting(recorder, key):
    mesh = SimpleNamespace(mesh_dim_names=("dp_shard",), shape=(2,), ndim=1)
    batch = (torch.zeros(1, 16, dtype=torch.long),) * 2
    with pytest.raises(ConfigError, match="recorded"):
        auto.auto_parallelize_for_training(torch.nn.Linear(2, 2), mesh, _job(key, VALUES[key]), batch)
    assert getattr(recorder[-1], key) == VALUES[key]


def _plan_script():
    from tools import plan

    return plan


@pytest.mark.parametrize("key", FIELDS)
def test_plan_py_passes_the_setting(recorder, key):
    argv = ["--config", "llama3_debug_auto", "--mesh", "2", *TINY, *_flags(key, VALUES[key])]
    with pytest.raises(PlanningError, match="recorded"):
        _plan_script().main(argv)
    assert getattr(recorder[-1], key) == VALUES[key]


def test_plan_py_shorthands_override_the_config_and_leave_the_rest(recorder):
    argv = ["--config", "llama3_debug_auto", "--mesh", "2", *TINY, "--parallelism.split_seeding_rounds", "2",
            "--parallelism.time_limit", "30", "--time-limit", "7"]
    with pytest.raises(PlanningError):
        _plan_script().main(argv)
    assert (recorder[-1].split_seeding_rounds, recorder[-1].time_limit) == (2, 7.0)


@pytest.mark.parametrize("key", FIELDS)
def test_a_sweep_point_passes_the_setting_and_keys_its_cache_on_it(recorder, key):
    job = auto.base_job(_job(key, VALUES[key]))
    (point,) = expand_points({"mesh": ["2"]}, job, "test")
    row = sweep_point.plan_point(point, cache=None)
    assert row["status"] == "no plan: recorded"
    assert getattr(recorder[-1], key) == VALUES[key]
    default = auto.base_job(load_config("llama3_debug_auto", TINY, world_size=2))
    if key == "memory_budget_low":  # its job sets a high budget too: compare with that alone
        default = auto.base_job(_job("memory_budget_high", 1.0))
    (plain,) = expand_points({"mesh": ["2"]}, default, "test")
    assert sweep_point.point_key(point) != sweep_point.point_key(plain)


@pytest.mark.parametrize("key", FIELDS)
def test_the_mesh_search_passes_the_setting(recorder, key, tmp_path):
    job = auto.base_job(_job(key, VALUES[key]))
    cache = PlanCache(tmp_path)  # an empty cache: every mesh is planned here, in this process
    rows = search_meshes(job, 2, job.request.planner.hardware, workers=1, cache=cache, out=lambda s: None)
    assert rows and all(r["status"] == "no plan: recorded" for r in rows)
    assert recorder and all(getattr(p, key) == VALUES[key] for p in recorder)


def test_an_edit_of_the_planner_source_changes_the_cache_key(monkeypatch):
    job = auto.base_job(load_config("llama3_debug_auto", TINY, world_size=2))
    (point,) = expand_points({"mesh": ["2"]}, job, "test")
    before = sweep_point.point_key(point)
    monkeypatch.setattr(request, "source_hash", lambda: "edited")
    assert sweep_point.point_key(point) != before


# one setting changed (and hardware named, or "auto": chosen for the job), through every entry point
ONE_CHANGE = ["--parallelism.split_seeding_radius", "3", "--parallelism.memory_limit_gib", "50"]


def _entry_point_planners(recorder, hardware: str) -> dict[str, PlannerConfig]:
    """The PlannerConfig the planner is built with, from each entry point, for one job."""
    flags = [*TINY, *ONE_CHANGE, "--parallelism.hardware", hardware]
    cfg = load_config("llama3_debug_auto", flags, world_size=2)
    mesh = SimpleNamespace(mesh_dim_names=("dp_shard",), shape=(2,), ndim=1, device_type="cpu")
    batch = (torch.zeros(1, 16, dtype=torch.long),) * 2
    out = {}
    with pytest.raises(ConfigError, match="recorded"):  # the trainer: its config -> request
        auto.auto_parallelize_for_training(torch.nn.Linear(2, 2), mesh, cfg, batch)
    out["trainer"] = recorder[-1]
    sim, _ = dry_run_auto.simulated_job(cfg, 2, torch.device("cpu"))  # the dry run's copy of the job
    with pytest.raises(ConfigError, match="recorded"):
        auto.auto_parallelize_for_training(torch.nn.Linear(2, 2), mesh, sim, batch)
    out["dry run"] = recorder[-1]
    with pytest.raises(PlanningError, match="recorded"):  # scripts/plan.py's job and request
        _plan_script().main(["--config", "llama3_debug_auto", "--mesh", "2", *flags])
    out["plan.py"] = recorder[-1]
    if hardware != "auto":  # a sweep plans for named profiles only
        (point,) = expand_points({"mesh": ["2"]}, auto.base_job(cfg), "test")
        assert sweep_point.plan_point(point, cache=None)["status"] == "no plan: recorded"
        out["sweep point"] = recorder[-1]
    return out


def test_one_setting_through_every_entry_point_resolves_to_one_value(recorder):
    planners = _entry_point_planners(recorder, "a100")
    expected = PlannerConfig(hardware="a100", split_seeding_radius=3, memory_limit_gib=50.0)
    assert planners == {name: expected for name in planners}


def test_hardware_auto_is_resolved_once_to_the_same_value(recorder, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOTITAN_CACHE", str(tmp_path))  # nothing measured: the fake world's cpu profile
    planners = _entry_point_planners(recorder, "auto")
    resolved = request.resolve_planner(PlannerConfig(split_seeding_radius=3, memory_limit_gib=50.0), 2, "cpu")
    assert resolved.hardware == load_hardware("cpu")  # a concrete profile, what the plan records
    assert planners["trainer"] == planners["plan.py"] == resolved
    # the dry run prices "auto" as the simulated device's shipped profile (a CPU job: cpu; CUDA: h100)
    assert planners["dry run"] == resolved.replace(hardware="cpu")
    cuda, _ = dry_run_auto.simulated_job(load_config("llama3_debug_auto", TINY[:-2], world_size=2), 8,
                                         torch.device("cuda"))
    assert cuda.parallelism.planner.hardware == request.SIMULATED_GPU_PROFILE == "h100"
    assert request.resolve_planner(resolved, 2, "cpu") is resolved  # concrete: nothing left to resolve
