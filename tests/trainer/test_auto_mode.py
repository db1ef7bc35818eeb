"""trainer/auto_mode.py without a process group: the job's planning request reaches AutoParallel,
and the planner's errors become ConfigErrors naming the key (stub planner, stub mesh)."""

from types import SimpleNamespace

import pytest
import torch

import parallel.auto.request as request
import trainer.auto_mode as auto
from parallel.auto.problem.placement_problem import MemoryLimitError, PlanningError
from trainer.config import ConfigError, load_config

MESH = SimpleNamespace(mesh_dim_names=("dp_shard",), shape=(2,), ndim=1)
BATCH = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))


class NoPlan:
    """Records how it was built and what was asked; finds no plan."""

    seen: dict = {}

    def __init__(self, model, inputs, mesh, **kwargs):
        NoPlan.seen = {"inputs": inputs, **kwargs}
        self.input_fn = inputs

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_input_constraints(self, placements):
        NoPlan.seen["input_placements"] = placements

    def add_parameter_memory_constraint(self, low=None, high=None):
        NoPlan.seen["memory"] = (low, high)

    def optimize_placement(self, verbose=True):
        raise PlanningError("parameter memory constraint (low=None, high=0.1) cannot all hold")


def test_knobs_reach_the_planner_and_no_plan_names_the_budget(monkeypatch):
    monkeypatch.setattr(request, "AutoParallel", NoPlan)
    cfg = load_config("llama3_debug_auto", [
        "--parallelism.hardware", "h100", "--parallelism.solver", "mrf", "--parallelism.split_seeding", "true",
        "--parallelism.split_seeding_radius", "1", "--parallelism.split_seeding_rounds", "2",
        "--parallelism.time_limit", "12.5",
        "--parallelism.repeated_blocks", "false", "--parallelism.memory_budget_high", "0.1",
        "--training.mixed_precision_param", "bfloat16"], world_size=2)
    with pytest.raises(ConfigError) as e:
        auto.auto_parallelize_for_training(torch.nn.Linear(2, 2), MESH, cfg, BATCH)
    s = NoPlan.seen
    p = s["planner"]
    assert (p.hardware, p.solver, p.split_seeding, p.split_seeding_radius, p.split_seeding_rounds, p.time_limit,
            p.repeated_blocks) == ("h100", "mrf", True, 1, 2, 12.5, False)
    assert s["mp_policy"].param_dtype == torch.bfloat16 and s["mp_policy"].reduce_dtype == torch.float32
    assert (p.memory_budget_low, p.memory_budget_high) == (None, 0.1)
    assert [tuple(x.shape) for x in s["inputs"]] == [(4, 8), (4, 8)]  # global batch: 2 data ranks
    msg = str(e.value)
    assert "llama3_debug_auto.toml: 'parallelism.memory_budget_high' = 0.1" in msg
    assert "cannot all hold" in msg and "unset it" in msg


def test_corrupt_plan_file_fails_before_tracing(monkeypatch, tmp_path):
    monkeypatch.setattr(request, "AutoParallel", None)  # never reached
    bad = tmp_path / "plan.json"
    bad.write_text("\x00 not json")
    cfg = load_config("llama3_debug_auto", ["--parallelism.plan_file", str(bad)], world_size=2)
    with pytest.raises(ConfigError, match=r"'parallelism.plan_file' = '.*plan.json': .*not a plan file"):
        auto.auto_parallelize_for_training(torch.nn.Linear(2, 2), MESH, cfg, BATCH)


def test_fp32_training_gives_the_planner_no_policy():
    cfg = load_config("llama3_debug_auto", world_size=2)
    assert auto.planner_mp_policy(cfg.training) is None


class OverLimit(NoPlan):
    def optimize_placement(self, verbose=True):
        raise MemoryLimitError("no plan fits in the memory limit: predicted peak 92.30 GiB per device (...) > "
                               "79.60 GiB (memory_limit_gib 79.6); use activation checkpointing")


@pytest.mark.parametrize("limit", [None, "79.6"])
def test_memory_limit_reaches_the_planner_and_its_error_names_the_key(monkeypatch, limit):
    monkeypatch.setattr(request, "AutoParallel", OverLimit)
    args = ["--parallelism.hardware", "h100", "--optimizer.implementation", "for-loop",
            "--parallelism.memory_budget_high", "1.0"]
    cfg = load_config("llama3_debug_auto", args + (["--parallelism.memory_limit_gib", limit] if limit else []),
                      world_size=2)
    with pytest.raises(ConfigError) as e:
        auto.auto_parallelize_for_training(torch.nn.Linear(2, 2), MESH, cfg, BATCH)
    assert NoPlan.seen["planner"].memory_limit_gib == (float(limit) if limit else None)
    assert NoPlan.seen["planner"].optimizer == "for-loop"
    key = "'parallelism.memory_limit_gib' = 79.6" if limit else "'parallelism.hardware' = 'h100' (the profile's"
    assert f"llama3_debug_auto.toml: {key}" in str(e.value) and "use activation checkpointing" in str(e.value)


def test_memory_limit_must_be_positive():
    with pytest.raises(ConfigError, match=r"'parallelism.memory_limit_gib' = 0.0: must be > 0 GiB"):
        load_config("llama3_debug_auto", ["--parallelism.memory_limit_gib", "0"], world_size=2)


def test_cp_in_auto_mode_needs_two_chunks_per_cp_rank(monkeypatch):
    monkeypatch.setattr(request, "AutoParallel", None)  # never reached
    cfg = load_config("llama3_debug_auto", ["--parallelism.context_parallel_degree", "2",
                                            "--training.seq_len", "30"], world_size=2)
    mesh = SimpleNamespace(mesh_dim_names=("cp",), shape=(2,), ndim=1)
    with pytest.raises(ConfigError, match=r"'parallelism.context_parallel_degree' = 2: .*seq_len = 30 must be a "
                                          r"multiple of 4"):
        auto.auto_parallelize_for_training(torch.nn.Linear(2, 2), mesh, cfg, BATCH)
