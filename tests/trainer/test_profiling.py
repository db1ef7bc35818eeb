"""[profiling]: per-rank Chrome traces of the chosen steps, with the step's ops and its
collectives in them, in manual and auto mode on 2 gloo ranks (gloo shows no collective on
1 rank); the CPU memory table; bad settings are one config error naming the key."""

import json
from pathlib import Path

import pytest
from profiled_jobs import MODES, PROFILE, TINY, two_rank_profiled_jobs
from trainer_helpers import make_config

from trainer.config import ConfigError
from trainer.trainer import Trainer


def _names(trace: Path) -> set[str]:
    return {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}


def _collectives(names: set[str]) -> set[str]:
    return {n for n in names if n.startswith(("gloo:", "c10d::", "_c10d_functional::"))}


@pytest.mark.slow
def test_traces_of_the_chosen_steps_hold_ops_and_collectives_in_both_modes():
    tmp, results = two_rank_profiled_jobs()
    for out in results:
        assert all(out[m + "_steps"] == [1, 2, 3] for m in MODES), out
    for mode in MODES:
        root = tmp / mode / "profile_traces"
        # profile_freq 2 over 3 steps: step 2 only, one trace per rank
        assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.json")) == [
            "iteration_2/rank0_trace.json", "iteration_2/rank1_trace.json"]
        for rank in (0, 1):
            names = _names(root / "iteration_2" / f"rank{rank}_trace.json")
            assert "aten::mm" in names, (mode, sorted(names)[:50])
            # the backend's own events of the step's gradient/loss reductions, and of FSDP's
            # parameter gathers (the auto plan on 2 ranks replicates the weights: no gathers)
            wanted = {"gloo:all_reduce"} | ({"gloo:all_gather"} if mode == "manual" else set())
            assert wanted <= names, (mode, sorted(_collectives(names)))


def test_cpu_memory_table_and_trace_memory_events(tmp_path):
    """One process: the trace of step 2 carries the profiler's memory events, and the memory
    table of that step lists the matmuls' allocations."""
    cfg = make_config(tmp_path, extra=[*TINY, *PROFILE, "--training.steps", "2",
                                       "--profiling.enable_memory_snapshot", "true"])
    Trainer(cfg).train()
    assert "[memory]" in _names(tmp_path / "run" / "profile_traces" / "iteration_2" / "rank0_trace.json")
    table = (tmp_path / "run" / "memory_snapshot" / "iteration_2" / "rank0_memory.txt").read_text()
    assert "Self CPU Mem" in table and "aten::mm" in table


@pytest.mark.parametrize("extra, key", [
    (["--profiling.profile_freq", "0"], "'profiling.profile_freq' = 0"),
    (["--profiling.save_traces_folder", ""], "'profiling.save_traces_folder' = ''"),
])
def test_bad_settings_are_one_config_error(tmp_path, extra, key):
    """Refused when the config loads (a folder that is not inside the run folder) or when the
    trainer starts (the profiler's own settings), with one error naming the key."""
    with pytest.raises(ConfigError, match=key):
        Trainer(make_config(tmp_path, extra=[*TINY, *PROFILE, *extra]))


def test_an_unwritable_traces_folder_is_a_config_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "traces").write_text("a file, not a folder")
    cfg = make_config(tmp_path, extra=[*TINY, *PROFILE, "--training.steps", "1",
                                       "--profiling.save_traces_folder", "traces"])
    with pytest.raises(ConfigError, match="'profiling.save_traces_folder' = 'traces': cannot write"):
        Trainer(cfg).train()


def test_cuda_memory_snapshots_at_the_profiled_steps(tmp_path, monkeypatch):
    """The CUDA branch without a GPU: the allocator's history is recorded for the whole run and
    dumped after every profile_freq-th step (counted from a resumed step), per rank."""
    import torch

    from trainer import profiling

    calls = []
    monkeypatch.setattr(profiling.T, "record_cuda_memory_history", lambda on: calls.append(("record", on)))
    monkeypatch.setattr(profiling.T, "dump_cuda_memory_snapshot", lambda path: calls.append(("dump", path)))
    cfg = make_config(tmp_path, extra=["--profiling.enable_memory_snapshot", "true", "--profiling.profile_freq", "2"])
    with profiling.StepProfiler(cfg, tmp_path / "run", 3, torch.device("cuda"), start_step=1) as prof:
        for _ in range(4):  # steps 2..5
            prof.step()
    folder = tmp_path / "run" / "memory_snapshot"
    assert calls == [("record", True), ("dump", str(folder / "iteration_2" / "rank3_memory_snapshot.pickle")),
                     ("dump", str(folder / "iteration_4" / "rank3_memory_snapshot.pickle")), ("record", False)]
