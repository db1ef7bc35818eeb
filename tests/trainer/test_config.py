"""Config parsing, overrides and every ConfigError case (no process group needed)."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from trainer.config import CONFIGS_DIR, ConfigError, JobConfig, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
ALL_CONFIGS = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))  # the main job's config among them


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_shipped_config_loads(name):
    cfg = load_config(name, world_size=64)
    assert cfg.model.flavor
    assert (CONFIGS_DIR / f"{name}.toml").is_file()


def test_bare_name_with_and_without_toml_and_path():
    a = load_config("llama3_debug", world_size=1)
    b = load_config("llama3_debug.toml", world_size=1)
    c = load_config(str(CONFIGS_DIR / "llama3_debug.toml"), world_size=1)
    assert a.to_dict() == b.to_dict() == c.to_dict()
    assert a.model.name == "llama3" and a.model.flavor == "debug"


def test_missing_config_lists_known():
    with pytest.raises(ConfigError, match="not found.*llama3_debug"):
        load_config("nope_config")


def test_overrides_forms():
    cfg = load_config("llama3_debug", ["--training.steps", "7", "--optimizer.lr=0.01",
                                       "--checkpoint.enable", "false", "--metrics.enable_tensorboard",
                                       "--parallelism.memory_budget_low", "12.5",
                                       "--job.name", "x y"], world_size=1)
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == 0.01
    assert cfg.checkpoint.enable is False
    assert cfg.metrics.enable_tensorboard is True
    assert cfg.parallelism.planner.memory_budget_low == 12.5
    assert cfg.parallelism.planner.memory_budget_high is None
    assert cfg.job.name == "x y"
    assert parse_overrides(["--a.b", "1", "--c.d=x", "--e.f"]) == [
        ("a", "b", "1"), ("c", "d", "x"), ("e", "f", None)]


def test_one_dataclass_per_section():
    cfg = JobConfig()
    sections = ["job", "model", "training", "optimizer", "lr_scheduler", "parallelism",
                "activation_checkpoint", "checkpoint", "metrics", "data", "validation", "comm", "profiling"]
    assert list(cfg.to_dict()) == sections
    assert len({type(getattr(cfg, s)) for s in sections}) == len(sections)
    keys = cfg.to_dict()["parallelism"]  # flat, as in the TOML file: the planner's settings are keys of it
    for key in ("mode", "data_parallel_replicate_degree", "data_parallel_shard_degree",
                "tensor_parallel_degree", "context_parallel_degree", "expert_parallel_degree",
                "enable_sequence_parallel", "hardware", "plan_file", "memory_budget_low",
                "memory_budget_high", "solver", "moe_imbalance_factor"):
        assert key in keys, key
    assert "optimizer" not in keys and "planner" not in keys  # [optimizer] implementation sets the planner's


def test_unknown_section(tmp_path):
    path = write(tmp_path, "[trainingg]\nsteps = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert path in msg and "trainingg" in msg and "known sections" in msg


def test_unknown_key(tmp_path):
    path = write(tmp_path, "[training]\nstepz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert path in msg and "training.stepz" in msg and "3" in msg and "steps" in msg


def test_unknown_key_on_command_line():
    with pytest.raises(ConfigError, match=r"llama3_debug.toml.*--training.stepz.*training.stepz"):
        load_config("llama3_debug", ["--training.stepz", "3"])
    with pytest.raises(ConfigError, match=r"unknown section \[nope\]"):
        load_config("llama3_debug", ["--nope.steps", "3"])


@pytest.mark.parametrize("text,key,value", [
    ('[training]\nsteps = "ten"\n', "training.steps", "'ten'"),
    ("[training]\nsteps = 2.5\n", "training.steps", "2.5"),
    ("[checkpoint]\nenable = 1\n", "checkpoint.enable", "1"),
    ("[job]\nname = 3\n", "job.name", "3"),
    ("[optimizer]\nlr = true\n", "optimizer.lr", "True"),
])
def test_wrong_type(tmp_path, text, key, value):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert path in msg and key in msg and value in msg and "wrong type" in msg


def test_wrong_type_on_command_line():
    with pytest.raises(ConfigError, match=r"training.steps.*'abc'.*wrong type.*integer"):
        load_config("llama3_debug", ["--training.steps", "abc"])
    with pytest.raises(ConfigError, match=r"checkpoint.enable.*'maybe'.*true/false"):
        load_config("llama3_debug", ["--checkpoint.enable", "maybe"])
    with pytest.raises(ConfigError, match=r"training.steps.*needs a value"):
        load_config("llama3_debug", ["--training.steps"])


def test_int_accepted_for_float(tmp_path):
    cfg = load_config(write(tmp_path, "[optimizer]\nlr = 1\n"), world_size=1)
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


def test_bad_choice(tmp_path):
    path = write(tmp_path, '[parallelism]\nmode = "magic"\n')
    with pytest.raises(ConfigError, match=r"parallelism.mode.*'magic'.*'manual', 'auto'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"training.mixed_precision_param.*'float16'"):
        load_config("llama3_debug", ["--training.mixed_precision_param", "float16"])


def test_degrees_product_vs_world_size(tmp_path, monkeypatch):
    path = write(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 2\n"
                           "tensor_parallel_degree = 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, world_size=2)
    msg = str(e.value)
    assert path in msg and "multiply to 4" in msg and "world size is 2" in msg
    assert load_config(path, world_size=4).parallelism.degrees.tensor_parallel_degree == 2
    # the world size comes from WORLD_SIZE when not given
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size is 3"):
        load_config(path)
    # -1 fills the rest, but only when it divides
    path2 = write(tmp_path, "[parallelism]\ntensor_parallel_degree = 2\n", "b.toml")
    with pytest.raises(ConfigError, match=r"data_parallel_shard_degree' = -1.*world size 3"):
        load_config(path2)
    deg = load_config(path2, world_size=8).parallelism.degrees.resolved(8)
    assert deg["dp_shard"] == 4 and deg["tp"] == 2


def test_bad_degree_values():
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree' = 0.*>= 1"):
        load_config("llama3_debug", ["--parallelism.tensor_parallel_degree", "0"], world_size=1)
    with pytest.raises(ConfigError, match=r"data_parallel_shard_degree' = -2"):
        load_config("llama3_debug", ["--parallelism.data_parallel_shard_degree", "-2"],
                    world_size=1)


def test_unknown_flavor_and_model():
    with pytest.raises(ConfigError) as e:
        load_config("llama3_debug", ["--model.flavor", "13B"], world_size=1)
    msg = str(e.value)
    assert "llama3_debug.toml" in msg and "model.flavor" in msg and "13B" in msg
    assert "debug" in msg and "8B" in msg  # lists the flavors
    with pytest.raises(ConfigError, match=r"model.name' = 'gpt5'"):
        load_config("llama3_debug", ["--model.name", "gpt5"], world_size=1)


def test_unknown_hardware_profile():
    with pytest.raises(ConfigError, match=r"metrics.hardware' = 'tpu9'.*configs/hardware"):
        load_config("llama3_debug", ["--metrics.hardware", "tpu9"], world_size=1)


def test_not_toml(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[training\nsteps = 1\n"))


def test_print_config_and_error_before_process_group(capsys, monkeypatch):
    import train
    assert train.main(["--config", "llama3_debug", "--print-config",
                       "--training.steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "[training]" in out and "steps = 3" in out and "[parallelism]" in out
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert train.main(["--config", "llama3_debug",
                       "--parallelism.data_parallel_shard_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "world size is 3" in err
    assert not dist.is_initialized()


@pytest.mark.slow
def test_cli_error_exit_code(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "llama3_debug",
                        "--training.stepz", "1"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 2
    assert "training.stepz" in r.stderr and "Traceback" not in r.stderr


def test_planner_knobs_default_to_the_api_and_parse():
    from parallel.auto.config import PlannerConfig
    from parallel.auto.cost import DEFAULT_HARDWARE

    # one declaration: the [parallelism] keys are PlannerConfig's fields, with its defaults
    p = load_config("llama3_debug_auto", world_size=2).parallelism.planner
    assert p == PlannerConfig()
    assert JobConfig().parallelism.planner.hardware == JobConfig().metrics.hardware == DEFAULT_HARDWARE
    p = load_config("llama3_debug_auto", ["--parallelism.split_seeding", "--parallelism.split_seeding_radius", "1",
                                          "--parallelism.split_seeding_rounds", "3", "--parallelism.time_limit", "30",
                                          "--parallelism.repeated_blocks", "false", "--parallelism.memory_estimate",
                                          "false"], world_size=2).parallelism.planner
    assert (p.split_seeding, p.split_seeding_radius, p.split_seeding_rounds, p.time_limit, p.repeated_blocks,
            p.memory_estimate) == (
        True, 1, 3, 30.0, False, False)
    cfg = load_config("llama3_debug", ["--parallelism.split_seeding", "none"], world_size=1)
    assert cfg.parallelism.planner.split_seeding is None


@pytest.mark.parametrize("key,value,match", [
    ("split_seeding_radius", "-1", r"split_seeding_radius' = -1: must be >= 0"),
    ("split_seeding_rounds", "0", r"split_seeding_rounds' = 0: must be >= 1"),
    ("seed_rounds", "2", r"seed_rounds' = '2': renamed 'parallelism.split_seeding_rounds'"),
    ("time_limit", "0", r"time_limit' = 0.0: must be > 0"),
    ("repeated_blocks", "maybe", r"repeated_blocks' = 'maybe' has the wrong type; expected true/false"),
    ("split_seeding", "often", r"split_seeding' = 'often' has the wrong type; expected true/false or none"),
    ("plan_file", "no/such/plan.json", r"plan_file' = 'no/such/plan.json': no such file"),
    ("hardware", "broken.toml", r"hardware' = 'broken.toml': hardware profile file not found"),
    ("moe_imbalance_factor", "0.9", r"moe_imbalance_factor' = 0.9: must be >= 1.0"),
    ("memory_estimate", "false --parallelism.memory_limit_gib 40", r"memory_estimate' = False: the memory limit "
                                                                  r"\(memory_limit_gib = 40.0\) is checked against the "
                                                                  r"estimate: unset memory_limit_gib or set"),
    ("expert_parallel_degree", "2", r"expert_parallel_degree' = 2: llama3/debug has no routed experts; set it to 1"),
])
def test_bad_planner_knobs(key, value, match):
    with pytest.raises(ConfigError, match=r"llama3_debug_auto.toml.*: 'parallelism\." + match):
        load_config("llama3_debug_auto", [f"--parallelism.{key}", *value.split()], world_size=2)


@pytest.mark.parametrize("flags,world,match", [
    ("--parallelism.expert_parallel_degree 3", 3, r"expert_parallel_degree' = 3: does not divide the number of "
                                                  r"routed experts \(8\)"),
    ("--parallelism.expert_parallel_degree 4 --parallelism.context_parallel_degree 2", 4,
     r"expert_parallel_degree' = 4: must divide data_parallel_shard_degree = 2 in auto mode"),
])
def test_bad_expert_axis_in_auto_mode(flags, world, match):
    with pytest.raises(ConfigError, match=r"deepseek_v3_debug_auto.toml.*: 'parallelism\." + match):
        load_config("deepseek_v3_debug_auto", flags.split(), world_size=world)


def test_expert_axis_in_auto_mode_splits_dp_shard():
    from parallel.mesh import mesh_shape

    cfg = load_config("deepseek_v3_debug_auto", ["--parallelism.expert_parallel_degree", "2"], world_size=8)
    assert mesh_shape(cfg.parallelism.degrees, 8, expert_axis=True) == ((4, 2), ("dp_shard_mod_ep", "ep"))
    assert mesh_shape(cfg.parallelism.degrees, 8) == ((8,), ("dp_shard",))  # manual: the EP recipe carves ep itself
    cfg = load_config("deepseek_v3_debug_auto", ["--parallelism.expert_parallel_degree", "2",
                                                 "--parallelism.data_parallel_replicate_degree", "2"], world_size=4)
    assert mesh_shape(cfg.parallelism.degrees, 4, expert_axis=True) == ((2, 2), ("dp_replicate", "ep"))


def test_malformed_hardware_profile_is_a_config_error(tmp_path):
    bad = write(tmp_path, 'name = "x"\n', "x.toml")
    with pytest.raises(ConfigError, match=r"metrics.hardware' = '.*x.toml'.*missing required key"):
        load_config("llama3_debug", ["--metrics.hardware", bad], world_size=1)


def test_seq_len_beyond_the_flavors_max_seq_len():
    with pytest.raises(ConfigError) as e:
        load_config("qwen3_debug", ["--training.seq_len", "4096"], world_size=1)
    msg = str(e.value)
    assert "qwen3_debug.toml" in msg and "'training.seq_len' = 4096" in msg
    assert "max_seq_len = 2048 of qwen3/debug" in msg and "training.seq_len <= 2048" in msg
    assert load_config("qwen3_debug", ["--training.seq_len", "2048"], world_size=1).training.seq_len == 2048


class _Lines(logging.Handler):
    """The messages logged to the trainer's logger (whether or not it propagates)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _load_logged(config, flags):
    log, h = logging.getLogger("autotitan"), _Lines()
    log.addHandler(h)
    try:
        return load_config(config, flags, world_size=1), h.lines
    finally:
        log.removeHandler(h)


def test_an_old_key_still_works_and_names_the_new_one_in_one_line(tmp_path):
    job = write(tmp_path, '[parallelism]\nmode = "auto"\ncluster_layers = false\n')
    note = "config: [parallelism] cluster_layers is now repeated_blocks; the old key still works"
    for config, flags, value in ((job, [], False),
                                 ("llama3_debug_auto", ["--parallelism.cluster_layers", "false"], False),
                                 (job, ["--parallelism.cluster_layers=false"], False),  # file and CLI: one line
                                 ("llama3_debug_auto", ["--parallelism.cluster_layers"], True)):  # a bare flag
        cfg, lines = _load_logged(config, flags)
        assert cfg.parallelism.planner.repeated_blocks is value
        assert lines == [note]


def test_the_planner_settings_are_frozen_and_changed_by_a_checked_copy():
    import dataclasses

    from parallel.auto.config import PlannerConfig
    from parallel.settings import SettingError

    p = load_config("llama3_debug_auto", ["--parallelism.split_seeding_radius", "3"], world_size=2).parallelism.planner
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.split_seeding_radius = 1
    assert p.replace(split_seeding_radius=1) == PlannerConfig(split_seeding_radius=1)
    with pytest.raises(SettingError, match="split_seeding_radius"):
        p.replace(split_seeding_radius=-1)


def test_activation_checkpointing_defaults_to_the_planner_s_choice_in_auto_mode_only():
    assert load_config("llama3_debug_auto").activation_checkpoint.mode == "auto"
    assert load_config("llama3_debug").activation_checkpoint.mode == "none"
    full = load_config("llama3_debug_auto", ["--activation_checkpoint.mode", "full"])
    assert full.activation_checkpoint.mode == "full"
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode.*'auto'.*only in auto mode"):
        load_config("llama3_debug", ["--activation_checkpoint.mode", "auto"])
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode.*'sometimes'.*'auto'"):
        load_config("llama3_debug", ["--activation_checkpoint.mode", "sometimes"])
