"""Dry run on a fake world (no real memory, no GPU) and recipe config errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.dry_run import dry_run, format_report

ROOT = Path(__file__).resolve().parents[3]


def _cfg(name, world, *overrides):
    return load_config(name, list(overrides), world_size=world)


def test_dry_run_fsdp_cp_tp_debug():
    cfg = _cfg("llama3_debug", 8, "--parallelism.tensor_parallel_degree", "2",
               "--parallelism.context_parallel_degree", "2", "--training.seq_len", "64",
               "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full")
    r = dry_run(cfg, 8)
    print(format_report(r))
    assert r.mesh == "dp_shard=2 x cp=2 x tp=2"
    full = 4 * 3_277_056  # fp32 bytes of the debug model (vocab 256)
    assert full / 8 <= r.param_bytes <= full / 4  # TP 2 x FSDP over dp_shard x cp (4)
    assert r.optim_bytes == 2 * r.param_bytes and r.grad_bytes == r.param_bytes
    axes = {axis for (_, axis) in r.collectives}
    kinds = {kind for (kind, _) in r.collectives}
    assert {"tp", "cp", "dp_shard_cp"} <= axes, r.collectives
    assert {"all_gather", "reduce_scatter"} <= kinds
    assert 0 < r.activation_bytes <= r.peak_fwd_bwd_bytes


def test_dry_run_expert_parallel_debug():
    cfg = _cfg("deepseek_v3_debug", 4, "--parallelism.expert_parallel_degree", "2",
               "--training.mixed_precision_param", "bfloat16", "--training.seq_len", "32",
               "--training.local_batch_size", "2")
    r = dry_run(cfg, 4)
    print(format_report(r))
    assert r.collectives[("all_to_all", "ep")][0] == 8  # 2 MoE layers x (dispatch, combine) x fwd/bwd
    assert ("all_gather", "dp_shard_mod_ep") in r.collectives  # experts' FSDP


@pytest.mark.parametrize("name,world,overrides,key", [
    ("llama3_debug", 3, ["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree"),
    ("llama3_debug", 2, ["--parallelism.context_parallel_degree", "2",
                         "--training.seq_len", "30"], "context_parallel_degree"),
    ("deepseek_v3_debug", 3, ["--parallelism.expert_parallel_degree", "3"], "expert_parallel_degree"),
    ("llama3_debug", 2, ["--parallelism.expert_parallel_degree", "2"], "expert_parallel_degree"),
])
def test_invalid_degrees_are_config_errors(name, world, overrides, key):
    cfg = _cfg(name, world, *overrides)
    with pytest.raises(ConfigError, match=f"parallelism.{key}"):
        dry_run(cfg, world)


@pytest.mark.slow
def test_dry_run_cli_llama3_8b_4x8():
    """``train.py --dry-run`` for LLaMA 3 8B on 32 fake ranks (FSDP 32, SAC per op)."""
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "llama3_8b.toml", "--dry-run", "--world-size", "32"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0
    assert "mesh dp_shard=32" in out.stdout
    params = [line for line in out.stdout.splitlines() if line.strip().startswith("parameters")]
    assert 0.9 < float(params[0].split()[1]) < 1.0  # 8.03e9 params x 4 bytes / 32 in GiB
    assert "all_gather     dp_shard" in out.stdout


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "examples").glob("*.toml")), ids=lambda p: p.stem)
def test_example_configs_load(path):
    import re

    world = int(re.search(r"nproc_per_node=(\d+)", path.read_text()).group(1))
    cfg = load_config(str(path), world_size=world)
    assert cfg.parallelism.mode == "manual"
