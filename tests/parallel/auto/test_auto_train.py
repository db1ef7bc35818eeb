"""Trainer with `[parallelism] mode = "auto"` on 2 gloo ranks (torchrun): the plan is
logged and saved, losses equal a 1-rank run on the same global batch, a DCP checkpoint
resumes (replaying the saved plan with `parallelism.plan_file`), and a plan made for
another model is refused. DeepSeek-V3 and Qwen3-MoE (q/k norms, as Qwen3's) run through
train.py too; Qwen3's dense plans are checked against one rank in test_apply.py."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import FAST, make_config, read_grad_norms, read_losses

ROOT = Path(__file__).resolve().parents[3]

SPLIT = ["--lr_scheduler.decay_steps", "6"]
TOL = 1e-4
CK = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def torchrun(tmp_path, job, extra, nproc=2, config="llama3_debug", check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), "--config", config, *FAST, "--training.local_batch_size", "2", *SPLIT,
           "--parallelism.mode", "auto", "--job.dump_folder", str(tmp_path), "--job.name", job, *extra]
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    if check:
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.mark.slow
def test_auto_mode_matches_one_rank_resumes_and_replays(tmp_path):
    from trainer.trainer import Trainer

    # two blocks (the flavor has four) keep the repeated-layer planning and halve each run's trace
    small = ["--model.n_layers", "2"]
    # reference: 1 rank, local batch 4 = the 2-rank global batch (2 x 2)
    ref = Trainer(make_config(tmp_path, extra=[*small, "--training.steps", "3"] + SPLIT, job="ref")).train()
    ref_gn = read_grad_norms(tmp_path, "ref")

    r = torchrun(tmp_path, "auto", [*small, "--training.steps", "2", *CK])
    out = r.stdout + r.stderr
    assert "auto-parallel plan solved by" in out and "parameter memory per device" in out
    assert out.index("auto-parallel plan") < out.index("step 1 |")  # plan summary, then the log
    assert "step graph traced" in out  # each rank ran its whole step as one local graph ...
    assert "runtime: 2 steps as one step graph per rank, 0 deviations from the plan" in out  # ... as planned
    plan_path = tmp_path / "auto" / "plan.json"
    plan = json.loads(plan_path.read_text())
    assert plan["mesh_shape"] == [2] and plan["mesh_axis_names"] == ["dp_shard"]
    two = read_losses(tmp_path, "auto")
    assert sorted(two) == [1, 2]
    diff = max(abs(two[s] - ref[s]) for s in two)
    print(f"auto 2 ranks vs 1 rank: max |dloss| = {diff:.2e} over 2 steps")
    assert diff < TOL, (two, ref)
    gn = read_grad_norms(tmp_path, "auto")
    assert max(abs(gn[s] - ref_gn[s]) for s in gn) < 1e-3 * max(ref_gn.values())

    # resume from the step-2 checkpoint for step 3, replaying the saved plan (no solve)
    saved = tmp_path / "saved_plan.json"
    shutil.copy(plan_path, saved)
    r = torchrun(tmp_path, "auto", [*small, "--training.steps", "3", *CK, "--parallelism.plan_file", str(saved)])
    out = r.stdout + r.stderr
    assert f"loaded from {saved}" in out and "solved by" not in out
    assert re.search(r"resumed from \S+step-2 at step 2", out), out[-3000:]
    resumed = read_losses(tmp_path, "auto")
    assert sorted(resumed) == [1, 2, 3]
    diff = max(abs(resumed[s] - ref[s]) for s in resumed)
    print(f"auto resumed at step 2: max |dloss| = {diff:.2e} over 3 steps")
    assert diff < TOL, (resumed, ref)

    # a plan made for another model is refused
    r = torchrun(tmp_path, "qwen", ["--training.steps", "1", "--parallelism.plan_file", str(saved)],
                 config="qwen3_debug", check=False)
    assert r.returncode != 0
    assert "different model" in r.stdout + r.stderr


@pytest.mark.slow
def test_deepseek_v3_auto_mode_with_moe_through_train_py_matches_one_rank(tmp_path):
    """The third model family: DeepSeek-V3 with an MoE layer (its token dispatch planned as the
    moe_dispatch local_map region, no `.tolist()` under fake tensors), losses equal to 1 rank."""
    from trainer.trainer import Trainer

    small = ["--model.n_layers", "2", "--training.steps", "3"]  # 1 dense + 1 MoE layer
    ref = Trainer(make_config(tmp_path, "deepseek_v3_debug", extra=[*small, *SPLIT], job="ref")).train()
    r = torchrun(tmp_path, "auto", small, config="deepseek_v3_debug_auto")
    out = r.stdout + r.stderr
    assert "auto-parallel plan solved by" in out
    assert "moe.experts.w1:" in out and "(region moe_dispatch" in out  # the summary says where the experts went
    assert "runtime: 3 steps as one step graph per rank, 0 deviations from the plan" in out
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    assert any("autotitan.moe_dispatch" in n["target"] for n in plan["nodes"])
    two = read_losses(tmp_path, "auto")
    diff = max(abs(two[s] - ref[s]) for s in two)
    print(f"deepseek_v3 auto 2 ranks vs 1 rank: max |dloss| = {diff:.2e} over {len(two)} steps")
    assert sorted(two) == [1, 2, 3] and diff < TOL, (two, ref)


@pytest.mark.slow
def test_qwen3_moe_auto_mode_through_train_py_matches_one_rank(tmp_path):
    """Qwen3-MoE (q/k norms, MoE in every layer, normalised top-k): its dispatch planned as the
    moe_dispatch region, on a mesh whose axis is `ep` (`expert_parallel_degree` 2 in auto mode:
    a data axis the planner places on), losses equal to 1 rank."""
    from trainer.trainer import Trainer

    small = ["--model.n_layers", "2", "--training.steps", "3"]
    ref = Trainer(make_config(tmp_path, "qwen3_moe_debug", extra=[*small, *SPLIT], job="ref")).train()
    r = torchrun(tmp_path, "auto", [*small, "--parallelism.expert_parallel_degree", "2"], config="qwen3_moe_debug_auto")
    out = r.stdout + r.stderr
    assert "world 2, mesh ep=2," in out  # the planner chooses what the experts do there
    assert re.search(r"moe.experts.w1: [\w -]+ \(region moe_dispatch, stored .+\) on ep\n", out), out[-3000:]
    assert "runtime: 3 steps as one step graph per rank, 0 deviations from the plan" in out
    two = read_losses(tmp_path, "auto")
    diff = max(abs(two[s] - ref[s]) for s in two)
    print(f"qwen3_moe auto 2 ranks vs 1 rank: max |dloss| = {diff:.2e} over {len(two)} steps")
    assert sorted(two) == [1, 2, 3] and diff < TOL, (two, ref)
