"""Changing the job's shape mid-run: `training.seq_len_schedule` (validated before any work;
in auto mode re-planned in memory, losses equal to a restart from a checkpoint with the new
plan) and resuming an auto-mode checkpoint on another world size (re-planned, losses as
one rank's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_utils import run_distributed
from torch.distributed.tensor import Shard

from trainer.config import ConfigError, load_config

TINY = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden_dim", "128", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_steps", "20", "--optimizer.lr", "2e-3",
        "--parallelism.hardware", "cpu"]
RTOL = 1e-4


def _bad(schedule: str, *extra: str, world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", ["--training.seq_len_schedule", schedule, *extra], world_size=world)
    return str(e.value)


def test_schedule_is_parsed_and_read_per_step():
    cfg = load_config("llama3_debug", ["--training.seq_len_schedule", "[[0, 64], [3, 128]]"], world_size=1)
    t = cfg.training
    assert t.seq_len_schedule == [[0, 64], [3, 128]]
    assert [t.seq_len_at(s) for s in range(5)] == [64, 64, 64, 128, 128] and t.seq_lens() == [64, 128]
    assert "seq_len_schedule = [[0, 64], [3, 128]]" in cfg.to_toml()


def test_bad_schedules_are_one_clear_error():
    key = "'training.seq_len_schedule' = "
    msg = _bad("[[0, 64], [3, 128], [3, 256]]")
    assert key in msg and "strictly increasing (3 then 3)" in msg
    msg = _bad("[[0, 64], [5, 128], [2, 256]]")
    assert "strictly increasing (5 then 2)" in msg
    assert "must start at step 0" in _bad("[[1, 64]]")
    msg = _bad("[[0, 64], [3, 100000]]")
    assert "seq_len 100000 at step 3 exceeds max_seq_len" in msg and "model.max_seq_len" in msg
    assert "entry 1 ([3]) is not [step, seq_len]" in _bad("[[0, 64], [3]]")
    msg = _bad("[[0, 64], [3, 102]]", "--parallelism.context_parallel_degree", "2",
               "--parallelism.data_parallel_shard_degree", "1", world=2)
    assert "seq_len 102 at step 3" in msg and "multiple of 4" in msg
    assert "has the wrong type; expected a list" in _bad("[[0, 64")


def test_a_length_the_corpus_cannot_fill_is_refused_before_the_model(tmp_path):
    from trainer.trainer import Trainer

    text = tmp_path / "small.txt"
    text.write_text("x" * 3000)
    cfg = load_config("llama3_debug", [*TINY, "--training.seq_len_schedule", "[[0, 32], [2, 1024]]",
                                       "--data.path", str(text), "--training.local_batch_size", "4",
                                       "--job.dump_folder", str(tmp_path)], world_size=1)
    with pytest.raises(ConfigError, match="'training.seq_len_schedule'.*fewer than one global batch"):
        Trainer(cfg)


def _train(tmp: str, job: str, world: int, extra: list[str], constraints=None) -> tuple[dict, object]:
    from trainer.config import load_config
    from trainer.trainer import Trainer

    tr = Trainer(load_config("llama3_debug", [*TINY, "--job.dump_folder", tmp, "--job.name", job, *extra],
                             world_size=world), plan_constraints=constraints)
    return tr.train(), tr


def _fsdp_at_64(autop) -> None:
    """Free (data parallel) at seq 32, FSDP at 64: the change must move every parameter and
    AdamW moment from Replicate to Shard(0)."""
    from parallel.auto.search import presets

    if autop.graph.input_shapes[0][0][1] == 64:
        presets.fsdp(autop)


def _schedule_worker(rank: int, world: int, tmp: str) -> dict:
    auto = ["--parallelism.mode", "auto", "--training.local_batch_size", "2", "--checkpoint.interval", "3"]
    sched, tr = _train(tmp, "scheduled", world, [*auto, "--training.seq_len_schedule", "[[0, 32], [3, 64]]",
                                                 "--training.steps", "6", "--checkpoint.enable", "false"], _fsdp_at_64)
    plans = {s: p.input_shapes for s, p in tr.parallelizer.plans.items()}
    placements = {s: set(p.param_placements().values()) for s, p in tr.parallelizer.plans.items()}
    first, _ = _train(tmp, "restarted", world, [*auto, "--training.seq_len", "32", "--training.steps", "3",
                                                "--checkpoint.enable", "true"], _fsdp_at_64)
    second, tr2 = _train(tmp, "restarted", world, [*auto, "--training.seq_len", "64", "--training.steps", "6",
                                                   "--checkpoint.enable", "true"], _fsdp_at_64)
    # replan = "replay" at 64, then back to 32: the job's own plan for 32, from its cache
    replayed, tr3 = _train(tmp, "replayed", world, [*auto, "--training.seq_len_schedule", "[[0, 32], [3, 64], [5, 32]]",
                                                    "--training.steps", "6", "--checkpoint.enable", "false",
                                                    "--parallelism.replan", "replay"], _fsdp_at_64)
    replay = {"losses": replayed, "origin": tr3.parallelizer.origin, "solver_64": tr3.parallelizer.plans[64].solver,
              "placements": {s: set(p.param_placements().values()) for s, p in tr3.parallelizer.plans.items()}}
    moments = {(tuple(v.placements) == tuple(p.placements), tuple(v.placements))
               for p, st in tr.optimizer.state.items() for v in st.values() if v.ndim > 0}
    return {"scheduled": sched, "restarted": {**first, **second}, "plans": plans, "placements": placements,
            "moments": moments, "replay": replay,
            "same_plan": tr2.model.plan.param_placements() == tr.model.plan.param_placements()}


@pytest.mark.slow
def test_schedule_replans_in_memory_and_equals_a_restart(tmp_path):
    out = run_distributed(_schedule_worker, 2, str(tmp_path), timeout=600)[0]
    sched, restarted = out["scheduled"], out["restarted"]
    print("scheduled", sched, "\nrestarted", restarted)
    assert sorted(sched) == sorted(restarted) == [1, 2, 3, 4, 5, 6]
    for s in sched:
        assert sched[s] == pytest.approx(restarted[s], rel=RTOL), s
    assert out["plans"] == {32: [[[4, 32], "torch.int64"]] * 2, 64: [[[4, 64], "torch.int64"]] * 2}
    assert out["same_plan"]
    assert out["placements"][32] == {"(R)"} and "(R)" not in out["placements"][64]  # data parallel, then FSDP
    assert {m[0] for m in out["moments"]} == {True}  # AdamW's moments followed their parameters
    assert {m[1] for m in out["moments"]} <= {(Shard(0),), (Shard(1),)}
    # replan = "replay": the seq-32 placements kept at 64 (no solve, so no FSDP), the same numbers;
    # back at 32 for step 6 the job takes the plan it made for 32
    replay = out["replay"]
    assert replay["placements"] == {32: {"(R)"}, 64: {"(R)"}}
    assert replay["origin"].startswith("taken from this job's plan") and replay["solver_64"] == "replay"
    for s in range(1, 6):
        assert replay["losses"][s] == pytest.approx(sched[s], rel=RTOL), s


def _resume_worker(rank: int, world: int, tmp: str, steps: int) -> dict:
    plan_file = str(Path(tmp) / "resume" / "plan.json") if steps > 2 else ""
    extra = ["--parallelism.mode", "auto", "--training.local_batch_size", str(4 // world), "--training.seq_len", "32",
             "--training.steps", str(steps), "--checkpoint.enable", "true", "--checkpoint.interval", "2",
             "--parallelism.plan_file", plan_file]
    losses, tr = _train(tmp, "resume", world, extra)
    return {"losses": losses, "origin": tr.parallelizer.origin, "mesh": list(tr.mesh.shape)}


@pytest.mark.slow
def test_resume_on_another_world_size_replans_and_continues(tmp_path):
    """4 ranks train steps 1-2, 2 ranks resume for 3-4, 4 ranks again for 5-6 (the run's
    plan.json, made for the previous mesh, is re-planned, not refused); global batch 4
    throughout, losses as one rank's."""
    from trainer.trainer import Trainer

    ref = Trainer(load_config("llama3_debug", [*TINY, "--job.dump_folder", str(tmp_path), "--job.name", "one",
                                               "--training.local_batch_size", "4", "--training.seq_len", "32",
                                               "--training.steps", "6"], world_size=1)).train()
    losses = {}
    for world, until in ((4, 2), (2, 4), (4, 6)):
        out = run_distributed(_resume_worker, world, str(tmp_path), until, timeout=600)[0]
        print(world, out)
        assert sorted(out["losses"]) == list(range(until - 1, until + 1))
        assert out["mesh"] == [world] and out["origin"].startswith("solved by")
        losses.update(out["losses"])
    assert sorted(losses) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    for s in ref:
        assert losses[s] == pytest.approx(ref[s], rel=RTOL), s
