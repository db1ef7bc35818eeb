"""Dry run on a fake world (no real memory, no GPU): the documented dry run of every example
config, the exact parameter shards of a 3-D recipe, and degrees that do not fit."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from models import build_model
from parallel._torch import fake_world
from parallel.mesh import CP, DP_SHARD, DP_SHARD_CP, EP, build_mesh, mesh_shape
from parallel.recipes import RecipeError, apply_recipe
from trainer.config import ConfigError, load_config
from trainer.dry_run import dry_run, format_report

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "configs" / "examples").glob("*.toml"))


def _cfg(name, world, *overrides):
    return load_config(name, list(overrides), world_size=world)


def _expected_param_bytes(cfg, tp: int, shard: int) -> int:
    """fp32 bytes of this rank's parameter shards: TP splits everything but the norms (which
    it keeps replicated), FSDP then splits every parameter over ``shard`` ranks."""
    model = build_model(cfg.model.name, cfg.model.flavor)
    n = model.args.num_params()
    norms = sum(p.numel() for name, p in model.named_parameters() if name.endswith("norm.weight")) if tp > 1 else 0
    return 4 * ((n - norms) // (tp * shard) + norms // shard)


def test_dry_run_fsdp_cp_tp_debug():
    cfg = _cfg("llama3_debug", 8, "--parallelism.tensor_parallel_degree", "2",
               "--parallelism.context_parallel_degree", "2", "--training.seq_len", "64",
               "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full")
    r = dry_run(cfg, 8)
    print(format_report(r))
    assert r.mesh == "dp_shard=2 x cp=2 x tp=2"
    assert r.param_bytes == _expected_param_bytes(cfg, tp=2, shard=4)  # TP 2 x FSDP over dp_shard x cp
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
    assert r.param_bytes == _expected_param_bytes(cfg, tp=1, shard=4)  # experts: ep 2 x FSDP 2


def _documented_dry_run(path: Path) -> tuple[int, list[str]]:
    """(world size, overrides) of the ``python train.py ... --dry-run`` line in the header."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip().rstrip("\\"))
    text = " ".join(header)
    assert "python train.py" in text, f"{path.name}: the header documents no dry run"
    args = shlex.split(re.sub(r"\(.*?\)", " ", text[text.index("python train.py"):]))[2:]
    world = int(args[args.index("--world-size") + 1])
    skip = {"--dry-run", "--world-size", str(world), "--config", args[args.index("--config") + 1]}
    return world, [a for a in args if a not in skip]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_config_loads_and_dry_runs(path):
    """The dry run each example documents works, on the mesh of its degrees, with every
    mesh axis communicating and the parameters sharded over the data and tensor axes."""
    world, overrides = _documented_dry_run(path)
    assert f"nproc_per_node={world}" in path.read_text()
    cfg = load_config(str(path), overrides, world_size=world)
    assert cfg.parallelism.mode == "manual"
    r = dry_run(cfg, world)
    print(format_report(r))
    shape, names = mesh_shape(cfg.parallelism.degrees, world)
    assert r.mesh == " x ".join(f"{n}={s}" for n, s in zip(names, shape))
    deg = dict(zip(names, shape))
    axes = set(names) | ({EP} if cfg.parallelism.degrees.expert_parallel_degree > 1 else set())
    if {DP_SHARD, CP} <= axes:
        axes = (axes - {DP_SHARD, CP}) | {DP_SHARD_CP}
    assert axes <= {axis for (_, axis) in r.collectives}, r.collectives
    shard = deg.get(DP_SHARD, 1) * deg.get(CP, 1)
    whole = _expected_param_bytes(cfg, tp=deg.get("tp", 1), shard=shard)
    if "pp" in deg:  # the simulated rank holds its pipeline stages only (tests/parallel/recipes/test_pp.py)
        assert 0 < r.param_bytes < whole
    else:
        assert r.param_bytes == whole


# (config, world, overrides, the [parallelism] key the error names)
BAD_DEGREES = [
    ("llama3_debug", 3, ["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree"),
    ("llama3_debug", 2, ["--parallelism.context_parallel_degree", "2",
                         "--training.seq_len", "30"], "context_parallel_degree"),
    ("deepseek_v3_debug", 3, ["--parallelism.expert_parallel_degree", "3"], "expert_parallel_degree"),
    ("llama3_debug", 2, ["--parallelism.expert_parallel_degree", "2"], "expert_parallel_degree"),
    ("deepseek_v3_debug", 4, ["--parallelism.expert_parallel_degree", "2",
                              "--parallelism.data_parallel_replicate_degree", "2"], "expert_parallel_degree"),
    ("llama3_debug", 4, ["--parallelism.data_parallel_replicate_degree", "2",  # DDP does not compose with TP
                         "--parallelism.tensor_parallel_degree", "2"], "data_parallel_replicate_degree"),
]


@pytest.mark.parametrize("name,world,overrides,key", BAD_DEGREES)
def test_invalid_degrees_are_recipe_errors(name, world, overrides, key):
    """The recipes raise their own error, naming the key, before touching the model."""
    cfg = _cfg(name, world, *overrides)
    model = build_model(cfg.model.name, cfg.model.flavor)
    with fake_world(world):
        mesh = build_mesh(cfg.parallelism.degrees, world, "cpu")
        with pytest.raises(RecipeError) as err:
            apply_recipe(model, mesh, cfg)
    assert err.value.key == key and str(err.value).startswith(f"'parallelism.{key}' = "), err.value
    assert not any(hasattr(p, "placements") for p in model.parameters())  # nothing applied yet


@pytest.mark.parametrize("name,world,overrides,key", BAD_DEGREES)
def test_invalid_degrees_are_config_errors(name, world, overrides, key):
    """The trainer (here its dry run) reports a recipe error as a config error."""
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
