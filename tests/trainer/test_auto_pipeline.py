"""Auto mode with a pipeline (trainer/auto_pipeline.py): each stage planned on the mesh without
its pp axis, run under torch.distributed.pipelining's schedules, logs the losses of one process
at the same global batch (rtol 1e-5): PP2 (1F1B) on 2 gloo ranks, resumed from its checkpoint
by a second job that replays its pipeline_plan.json; Interleaved1F1B (2 stages a rank);
PP2 x dp_shard 2 on 4 ranks. A model with a heavy output head is cut by the stages' predicted
times, not the recipe's equal units. Bad input: one config error each."""

import json

import pytest
import torch
from dist_utils import run_distributed

from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer

RTOL = 1e-5
FAST = ["--training.seq_len", "32", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false", "--optimizer.lr", "2e-3",
        "--parallelism.mode", "auto", "--parallelism.hardware", "h100"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


def _train(folder, extra, world, steps=4):
    torch.set_num_threads(1)
    cfg = load_config("llama3_debug", FAST + ["--job.dump_folder", folder, "--training.steps", str(steps)] + extra,
                      world_size=world)
    return Trainer(cfg).train()


def _check(reference, got, name):
    assert set(got) <= set(reference), (name, got)
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], rel=RTOL), (name, step, reference, got)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 4, 4 steps."""
    return _train(str(tmp_path_factory.mktemp("ref")), [], 1)


def _two_ranks(rank, world, folder):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    first = _train(f"{folder}/pp", PP2 + ckpt, world, steps=2)
    plan_file = f"{folder}/pp/llama3_debug/pipeline_plan.json"
    resumed = _train(f"{folder}/pp", PP2 + ckpt + ["--parallelism.plan_file", plan_file], world)
    looped = _train(f"{folder}/looped", PP2 + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], world)
    return first, resumed, looped


@pytest.mark.slow
def test_pp2_one_and_two_stages_a_rank_resumed_and_replayed_match_one_process(reference, tmp_path):
    for first, resumed, looped in run_distributed(_two_ranks, 2, str(tmp_path), timeout=300):
        assert list(first) == [1, 2] and list(resumed) == [3, 4]  # resumed at its step-2 checkpoint
        _check(reference, first | resumed, "pp2 1f1b, resumed")
        assert list(looped) == [1, 2, 3, 4]
        _check(reference, looped, "pp2 interleaved1f1b")
    run_dir = tmp_path / "pp" / "llama3_debug"
    saved = json.loads((run_dir / "pipeline_plan.json").read_text())
    assert saved["schedule"] == "1F1B" and [s["layers"] for s in saved["stages"]] == [[0, 1], [2, 3]]
    page = (run_dir / "pipeline_plan.html").read_text()
    assert 'class="pipeline-schedule"' in page and page.count('class="slot-F"') == 2 * 4  # 2 ranks x 4 microbatches
    assert (run_dir / "plan.stage1.html").exists() and (run_dir / "plan.stage1.json").exists()
    assert all(s["plan"]["mesh_axis_names"] == ["dp_shard"] for s in saved["stages"])  # planned without pp
    looped = json.loads((tmp_path / "looped" / "llama3_debug" / "pipeline_plan.json").read_text())
    assert [s["rank"] for s in looped["stages"]] == [0, 1, 0, 1]
    assert looped["predicted_step_us"] > 0


def _four_ranks(rank, world, folder):
    return _train(folder, PP2 + ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size",
                                 "2", "--parallelism.pipeline_parallel_microbatch_size", "1"], world)


@pytest.mark.slow
def test_pp2_with_dp_shard_2_on_4_ranks_matches_one_process(reference, tmp_path):
    for got in run_distributed(_four_ranks, 4, str(tmp_path), timeout=300):
        _check(reference, got, "pp2 x dp_shard 2")
        assert list(got) == [1, 2, 3, 4]
    saved = json.loads((tmp_path / "llama3_debug" / "pipeline_plan.json").read_text())
    assert all(s["plan"]["mesh_shape"] == [2] for s in saved["stages"])


def _heavy_head(rank, world, folder):
    _train(folder, PP2 + ["--model.vocab_size", "16384", "--training.seq_len", "256", "--parallelism.hardware", "cpu"],
           world, steps=1)


@pytest.mark.slow
def test_a_heavy_output_head_moves_blocks_to_the_first_stage(tmp_path):
    """A 16k vocabulary at 256 tokens a row makes the head the slowest unit (priced on the
    shipped `cpu` profile, where a matmul's time follows its flops): the cut by predicted times gives the
    last stage fewer blocks than the recipe's equal units (layers 0-1 | 2-3)."""
    run_distributed(_heavy_head, 2, str(tmp_path), timeout=300)
    saved = json.loads((tmp_path / "llama3_debug" / "pipeline_plan.json").read_text())
    first, last = (s["layers"] for s in saved["stages"])
    assert len(first) > len(last), saved["stages"]


@pytest.mark.parametrize("extra, key", [
    (PP2 + ["--parallelism.context_parallel_degree", "2"], "context_parallel_degree"),
    (PP2 + ["--parallelism.pipeline_parallel_microbatch_size", "3"], "pipeline_parallel_microbatch_size"),
])
def test_what_auto_pipelines_cannot_run_is_one_config_error(extra, key, tmp_path):
    with pytest.raises(ConfigError, match=f"'parallelism.{key}' = "):
        load_config("llama3_debug", FAST + ["--job.dump_folder", str(tmp_path)] + extra, world_size=4)


@pytest.mark.slow
def test_the_dry_run_plans_each_kind_of_stage_once_and_checks_each_stages_memory(capsys):
    """`train.py --dry-run` of an auto pipeline on a fake world (fake CUDA, h100): 4 stages of
    Interleaved1F1B on pp 2, stages 1 and 2 alike (one solve), a verdict per stage."""
    from trainer.dry_run_pipeline import dry_run_main

    cfg = load_config("llama3_debug_auto", PP2 + ["--parallelism.hardware", "h100", "--parallelism.pipeline_parallel_"
                                                 "schedule", "Interleaved1F1B", "--model.n_layers", "6"], world_size=4)
    assert dry_run_main(cfg, 4) == 0
    out = capsys.readouterr().out
    assert "dry run (auto mode, pipeline)" in out and "mesh pp=2 x dp_shard=2" in out
    assert "over 3 distinct stage plans" in out and "priced by stage 1's plan" in out, out
    assert out.count(": fits") == 4 and "pipeline: Interleaved1F1B, 4 stages on pp = 2" in out


@pytest.mark.slow
def test_stage_kinds_planned_in_worker_processes_are_the_plans_one_process_makes(capfd):
    """The dry run's kinds of stage solved side by side in spawned processes
    (trainer/stage_processes.py) come back as the plans one process makes: every stage's
    placements, recomputation, predicted time and peak; one progress line a kind."""
    from trainer.dry_run_pipeline import dry_run_pipeline

    cfg = load_config("llama3_debug_auto", PP2 + ["--parallelism.hardware", "h100", "--model.n_layers", "6",
                                                 "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                                 "--activation_checkpoint.mode", "auto"], world_size=4)
    alone, _ = dry_run_pipeline(cfg, 4, workers=1)
    assert "planned in" not in capfd.readouterr().err
    side_by_side, _ = dry_run_pipeline(cfg, 4, workers=2)
    err = capfd.readouterr().err
    assert err.count("[dry run] pipeline stage") == 3 and "(3/3 kinds" in err and "2 processes" in err, err

    def decided(plan):
        return [(s.index, s.layers, s.rank, s.plan.objective_us, s.plan.recompute,
                 {k: v for k, v in s.plan.to_json().items() if k not in ("timings", "memory")},
                 s.peak_bytes(plan.in_flight(s.index))) for s in plan.stages]

    assert decided(side_by_side) == decided(alone)
    assert side_by_side.step_us == alone.step_us and side_by_side.p2p_us == alone.p2p_us
