"""Pipeline parallel (parallel/recipes/pp.py): the layer split, the stage modules, the config
errors (fast), and the trainer's losses on gloo ranks against one process at the same global
batch (slow): PP2 (1F1B, GPipe), Interleaved1F1B with 2 stages per rank, PP2 x FSDP2, PP2 x TP2."""

import pytest
import torch
from dist_utils import run_distributed

from models import build_model
from parallel.recipes.pp import PipelineLayout, pipeline_layout, split_model
from parallel.settings import PipelineSettings
from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer

RTOL = 1e-5
FAST = ["--training.seq_len", "32", "--training.local_batch_size", "4", "--training.steps", "3",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "false", "--optimizer.lr", "2e-3"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


def _layout(n_layers=4, pp=2, local_batch=4, **kw) -> PipelineLayout:
    return pipeline_layout(n_layers, pp, PipelineSettings(**kw), local_batch)


# --------------------------------------------------------------------------- the split (fast)


def test_default_split_counts_embedding_and_output_as_a_layer():
    assert _layout().stages == ((0, 1), (2, 3))  # emb L0 L1 | L2 L3 out
    # 32 + 2 units over 8 stages: 4 or 5 each, the spare units in the middle stages
    lay = _layout(32, 4, 8, pipeline_parallel_schedule="interleaved1f1b")
    sizes = [len(s) + (i == 0) + (i == 7) for i, s in enumerate(lay.stages)]
    assert lay.schedule == "Interleaved1F1B" and sum(sizes) == 34 and max(sizes) - min(sizes) == 1
    assert [i for s in lay.stages for i in s] == list(range(32))
    assert lay.stages_of(1) == [1, 5] and lay.rank_of(7) == 3


def test_every_schedule_is_torchs():
    from torch.distributed.pipelining.schedules import get_schedule_class

    from parallel.recipes.pp import SCHEDULE_STYLES, schedule_name

    for name in SCHEDULE_STYLES:
        assert get_schedule_class(name).__name__ == f"Schedule{name}"
    assert schedule_name("interleaved1f1b") == "Interleaved1F1B"


def test_layers_per_stage_split_points_and_v_assignment():
    assert _layout(6, pipeline_parallel_layers_per_stage=4).stages == ((0, 1, 2), (3, 4, 5))
    assert _layout(pipeline_parallel_split_points=["layers.1"], pipeline_parallel_schedule="GPipe").stages == (
        (0,), (1, 2, 3))
    v = _layout(pipeline_parallel_schedule="ZBVZeroBubble")
    assert v.n_stages == 4 and v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2] and v.rank_of(3) == 0
    assert _layout(local_batch=8, pipeline_parallel_microbatch_size=2).n_microbatches == 4


def test_stage_modules_keep_the_models_names_and_compose_to_its_forward():
    torch.manual_seed(0)
    model = build_model("llama3", "debug", device="cpu", vocab_size=256)
    stages = _layout().stages
    parts = [split_model(model, s, i == 0, i == len(stages) - 1) for i, s in enumerate(stages)]
    names = set()
    for part in parts:
        names |= set(part.state_dict())
    assert names == set(model.state_dict())
    assert parts[1].tok_embeddings is None and parts[0].output is None and parts[0].norm is None
    assert parts[0].layers["1"] is model.layers[1]  # shared, not copied
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(parts[1](parts[0](tokens)), model(tokens), rtol=0, atol=0)


# --------------------------------------------------------------------------- config errors (fast)

BAD = [  # (overrides, key, words of the fix)
    (PP2 + ["--parallelism.pipeline_parallel_schedule", "Zigzag"], "pipeline_parallel_schedule",
     "GPipe, 1F1B, Interleaved1F1B"),
    (["--parallelism.pipeline_parallel_schedule", "Zigzag"], "pipeline_parallel_schedule", "DualPipeV"),  # pp 1
    (PP2 + ["--parallelism.pipeline_parallel_layers_per_stage", "2"], "pipeline_parallel_layers_per_stage",
     "pipeline_parallel_layers_per_stage = 3"),
    (PP2 + ["--parallelism.pipeline_parallel_split_points", '["layers.1", "layers.2"]'],
     "pipeline_parallel_split_points", "needs 2 stages"),
    (PP2 + ["--training.local_batch_size", "1"], "pipeline_parallel_microbatch_size",
     "1F1B needs at least as many microbatches as stages (2)"),
    (PP2 + ["--parallelism.pipeline_parallel_microbatch_size", "3"], "pipeline_parallel_microbatch_size",
     "use one of [1, 2, 4]"),
    (PP2 + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
            "--parallelism.pipeline_parallel_layers_per_stage", "3"], "pipeline_parallel_layers_per_stage",
     "a multiple of 2 stages, >= 4"),
    (PP2 + ["--parallelism.data_parallel_replicate_degree", "2"], "data_parallel_replicate_degree",
     "use data_parallel_shard_degree (FSDP) instead"),
    (PP2 + ["--checkpoint.last_save_in_hf", "true"], "last_save_in_hf", "convert_hf.py to-hf"),
]


@pytest.mark.parametrize("extra,key,fix", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_pipeline_config_is_one_error_naming_key_value_and_fix(extra, key, fix, tmp_path):
    world = 4 if "--parallelism.data_parallel_replicate_degree" in extra else 2
    name = "llama3_debug"
    with pytest.raises(ConfigError) as e:
        load_config(name, FAST + ["--job.dump_folder", str(tmp_path)] + extra, world_size=world)
    msg = str(e.value)
    section = "checkpoint" if key == "last_save_in_hf" else "parallelism"
    assert f"'{section}.{key}' = " in msg and fix in msg, msg


def test_bad_schedule_exits_2(capsys, monkeypatch, tmp_path):
    import train
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    rc = train.main(["--config", "llama3_debug", "--job.dump_folder", str(tmp_path), *PP2,
                     "--parallelism.pipeline_parallel_schedule", "zigzag"])
    err = capsys.readouterr().err
    assert rc == 2 and "'parallelism.pipeline_parallel_schedule' = 'zigzag'" in err and "DualPipeV" in err


# --------------------------------------------------------------------------- losses on gloo ranks (slow)


def _train(folder, extra, world):
    torch.set_num_threads(1)
    cfg = load_config("llama3_debug", FAST + ["--job.dump_folder", folder] + extra, world_size=world)
    return Trainer(cfg).train()


def _worker(rank, world, folder, cases):
    return {name: _train(f"{folder}/{name}", extra, world) for name, extra in cases.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, global batch 4: the losses every PP job below must log."""
    return _train(str(tmp_path_factory.mktemp("ref")), [], 1)


def _check(reference, got, name):
    assert set(got) == set(reference), (name, got)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=RTOL), (name, step, reference, got)


ONE_MICROBATCH = PP2 + ["--parallelism.pipeline_parallel_schedule", "GPipe",
                        "--parallelism.pipeline_parallel_microbatch_size", "4"]
CASES_2 = {"pp2_1f1b": PP2, "pp2_one_microbatch": ONE_MICROBATCH} | {
    f"pp2_{s.lower()}": PP2 + ["--parallelism.pipeline_parallel_schedule", s]
    for s in ("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")}


@pytest.mark.slow
def test_pp2_schedules_match_one_process(reference, tmp_path):
    """Every schedule torch 2.13 ships on 2 ranks: 1F1B, GPipe (one stage per rank);
    Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (stages 0, 2 on rank 0, 1, 3 on rank 1);
    ZBVZeroBubble, DualPipeV (0, 3 on rank 0, 1, 2 on rank 1): every rank logs the one-process
    losses."""
    ranks = run_distributed(_worker, 2, str(tmp_path), CASES_2, timeout=240)
    for got in ranks:
        for name in CASES_2:
            _check(reference, got[name], name)
        # the whole local batch as one microbatch: the very ops of one process, bit for bit
        assert got["pp2_one_microbatch"] == reference


FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
CASES_4 = {"pp2_fsdp2": PP2 + FSDP2, "pp2_tp2": PP2 + ["--parallelism.tensor_parallel_degree", "2"],
           "pp2_cp2": PP2 + ["--parallelism.context_parallel_degree", "2"],
           "pp2_fsdp2_sac": PP2 + FSDP2 + ["--activation_checkpoint.mode", "selective"]}


@pytest.mark.slow
def test_pp2_with_fsdp2_tp2_and_cp2_on_4_ranks_match_one_process(reference, tmp_path):
    """PP2 x FSDP2 (global batch 2 x 2 = 4; also with per-op SAC), PP2 x TP2 and PP2 x CP2 (FSDP
    over cp) on 4 ranks."""
    ranks = run_distributed(_worker, 4, str(tmp_path), CASES_4, timeout=240)
    for got in ranks:
        for name in CASES_4:
            _check(reference, got[name], name)


def _train_model(rank, world, folder, name, extra):
    torch.set_num_threads(1)
    cfg = load_config(name, FAST + ["--job.dump_folder", folder] + extra, world_size=world)
    return Trainer(cfg).train()


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [("qwen3_debug", []),
                                        ("deepseek_v3_debug", ["--parallelism.expert_parallel_degree", "2",
                                                               "--model.load_balance_coeff", "0.01"])])
def test_pp2_fsdp2_qwen3_and_deepseek_v3_ep2_match_one_process(name, extra, tmp_path):
    """Qwen3 (q/k norms) PP2 x FSDP2; DeepSeek-V3 (MLA, a dense block then MoE blocks) PP2 x
    FSDP2 with EP2 on the data ranks (the experts' all-to-all inside the stages) and the expert
    biases balanced from token counts summed over the ranks of each stage."""
    ref = _train_model(0, 1, str(tmp_path / "ref"), name, extra[2:])
    for got in run_distributed(_train_model, 4, str(tmp_path / "pp"), name, PP2 + FSDP2 + extra, timeout=120):
        _check(ref, got, name)


def _train_ckpt(rank, world, folder, extra):
    return _train(folder, ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.name", "run"] + extra,
                  world)


@pytest.mark.slow
def test_checkpoint_reshards_pp2_fsdp2_to_one_process_and_pp2(tmp_path):
    """DCP: a PP2 x FSDP2 job saves step 2 (each rank its stages' shards, under the unsplit
    model's names), one process resumes it to step 4, PP2 to step 6: the losses of an unbroken run."""
    ref = _train(str(tmp_path / "ref"), ["--training.steps", "6"], 1)
    folder = str(tmp_path / "ck")
    got = run_distributed(_train_ckpt, 4, folder, PP2 + FSDP2 + ["--training.steps", "2"], timeout=120)[0]
    got |= _train_ckpt(0, 1, folder, ["--training.steps", "4"])
    got |= run_distributed(_train_ckpt, 2, folder, PP2 + ["--training.steps", "6"], timeout=120)[0]
    _check(ref, got, "pp2 x fsdp2 -> 1 -> pp2")


ACCUM = ["--training.global_batch_size", "8", "--validation.enable", "true", "--validation.freq", "2",
         "--validation.steps", "2", "--training.seq_len_schedule", "[[0, 32], [2, 64]]"]


def _train_and_validate(rank, world, folder, extra):
    torch.set_num_threads(1)
    cfg = load_config("llama3_debug", FAST + ACCUM + ["--job.dump_folder", folder] + extra, world_size=world)
    trainer = Trainer(cfg)
    return trainer.train(), trainer.validate()[0]


@pytest.mark.slow
def test_pp2_gradient_accumulation_and_validation_match_one_process(tmp_path):
    """Two schedule steps a step (global batch 8 of local batches 4), their gradients summed, the
    validation loss through the schedule's forward-only run (at step 2, then at the end), and a
    sequence length that changes at step 3 (the stages infer their shapes again)."""
    ref_losses, ref_val = _train_and_validate(0, 1, str(tmp_path / "ref"), [])
    extra = PP2 + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    for losses, val in run_distributed(_train_and_validate, 2, str(tmp_path / "pp"), extra, timeout=120):
        _check(ref_losses, losses, "accumulation")
        assert val == pytest.approx(ref_val, rel=RTOL)


# --------------------------------------------------------------------------- dry run on a fake world


def _stage_param_bytes(flavor: str, stage: tuple[int, ...], first: bool, last: bool, shards: int) -> int:
    """fp32 bytes of one stage's parameters split evenly over ``shards`` ranks."""
    model = build_model("llama3", flavor)
    part = split_model(model, stage, first, last)
    return 4 * sum(p.numel() for p in part.parameters()) // shards


def test_dry_run_pp2_fsdp2_and_interleaved():
    from trainer.dry_run import dry_run, format_report

    cfg = load_config("llama3_debug", ["--training.seq_len", "64"] + PP2 + FSDP2, world_size=4)
    r = dry_run(cfg, 4)
    print(format_report(r))
    assert r.mesh == "pp=2 x dp_shard=2"
    assert r.param_bytes == _stage_param_bytes("debug", (0, 1), True, False, 2)  # rank 0: stage 0, FSDP 2
    # 2 microbatches of 1 x 64 x 256 fp32, activations sent and their gradients received
    assert r.collectives[("send/recv", "pp")] == (2 * 2, 2 * 2 * 1 * 64 * 256 * 4)
    assert {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard")} <= set(r.collectives)
    cfg = load_config("llama3_debug", ["--training.seq_len", "64"] + PP2 +
                      ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], world_size=2)
    r = dry_run(cfg, 2)
    assert any("runs stages 0, 2" in n for n in r.notes), r.notes
    assert 0 < r.activation_bytes <= r.peak_fwd_bwd_bytes
    cfg = load_config("llama3_debug", ["--training.seq_len", "64", "--parallelism.context_parallel_degree", "2",
                                       "--parallelism.tensor_parallel_degree", "2"] + PP2, world_size=8)
    r = dry_run(cfg, 8)
    assert r.mesh == "pp=2 x cp=2 x tp=2" and r.tokens == (8, 32)  # local batch 8 of the config, seq 64 over cp 2
    assert {"cp", "tp", "pp"} <= {axis for _, axis in r.collectives}, r.collectives


@pytest.mark.slow
def test_dry_run_405b_on_512_fake_ranks():
    """LLaMA 3.1 405B (dims as published), PP 16 x FSDP 4 x TP 8 on 512 fake ranks, full AC."""
    from trainer.dry_run import dry_run, format_report

    cfg = load_config("llama3_debug", [
        "--model.flavor", "405B", "--training.seq_len", "8192", "--training.local_batch_size", "16",
        "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full",
        "--parallelism.pipeline_parallel_degree", "16", "--parallelism.tensor_parallel_degree", "8",
        "--parallelism.data_parallel_shard_degree", "4"], world_size=512)
    r = dry_run(cfg, 512)
    print(format_report(r))
    assert r.mesh == "pp=16 x dp_shard=4 x tp=8"
    # stage 0 of 16: the embedding + 7 blocks ((126 + 2) / 16 = 8 units), TP 8 x FSDP 4 (norms not TP'd)
    assert r.param_bytes == pytest.approx(_stage_param_bytes("405B", tuple(range(7)), True, False, 32), rel=1e-3)
    assert ("all_reduce", "tp") in r.collectives and ("send/recv", "pp") in r.collectives
    assert r.total_peak_bytes < 80 * 2**30


@pytest.mark.slow
def test_pp2_with_hsdp_on_8_ranks_matches_one_process(reference, tmp_path):
    """PP2 x HSDP (replicate 2 x shard 2): local batch 1 (one GPipe microbatch), global batch 4."""
    extra = PP2 + ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                   "2", "--training.local_batch_size", "1", "--parallelism.pipeline_parallel_schedule", "GPipe"]
    for got in run_distributed(_worker, 8, str(tmp_path), {"pp2_hsdp": extra}, timeout=120):
        _check(reference, got["pp2_hsdp"], "pp2_hsdp")
