"""A job started from Hugging Face weights ([checkpoint] initial_load_path + initial_load_in_hf)
and exported as one (last_save_in_hf): the loaded model's logits equal transformers', the
export loads back into transformers with the trained model's logits, on 1 and 2 gloo ranks;
another model's checkpoint or architecture is one config error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402

from trainer.config import ConfigError, load_config  # noqa: E402
from trainer.hf_checkpoint import dcp_to_hf, hf_to_dcp  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

TOL = 1e-5
SHAPE = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_hidden_dim", "128"]
JOB = [*SHAPE, "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
       "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-2"]
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A 1-layer LLaMA saved by transformers, RoPE base 10000 (not the debug flavor's 500000)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    model = transformers.LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(d)
    return model, d


def _cfg(tmp, job, hf_dir, extra=(), world_size=1, name="llama3_debug"):
    return load_config(name, [*JOB, "--job.dump_folder", str(tmp), "--job.name", job,
                              "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_in_hf", "true",
                              *extra], world_size=world_size)


def test_start_from_hf_weights(hf_llama, tmp_path):
    hf, d = hf_llama
    tr = Trainer(_cfg(tmp_path, "one", d, ["--training.steps", "1"]))
    assert tr.model_args.rope_theta == 10000.0  # the checkpoint's, over the flavor's
    tr.start()
    with torch.no_grad():
        diff = (tr.model(TOKENS) - hf(TOKENS).logits).abs().max().item()
    print(f"1 rank, loaded: max |logits(ours) - logits(transformers)| = {diff:.2e}")
    assert diff <= TOL
    # the same weights as a DCP folder (convert_hf.py to-dcp): its hf_config.json gives the RoPE base
    hf_to_dcp(d, tmp_path / "dcp")
    tr = Trainer(_cfg(tmp_path, "dcp", tmp_path / "dcp", ["--training.steps", "1", "--checkpoint.initial_load_in_hf",
                                                          "false"]))
    assert tr.model_args.rope_theta == 10000.0
    tr.start()
    with torch.no_grad():
        assert (tr.model(TOKENS) - hf(TOKENS).logits).abs().max().item() <= TOL


def test_other_model_or_architecture_is_a_config_error(hf_llama, tmp_path):
    _, d = hf_llama
    with pytest.raises(ConfigError) as e:
        Trainer(_cfg(tmp_path, "two_layers", d, ["--model.n_layers", "2"])).start()
    msg = str(e.value)
    assert "model llama3/debug" in msg and "missing model.layers.1." in msg and "'n_layers': 2" in msg
    with pytest.raises(ConfigError, match="not a DCP checkpoint folder .* set checkpoint.initial_load_in_hf = true"):
        Trainer(_cfg(tmp_path, "not_dcp", d, ["--checkpoint.initial_load_in_hf", "false"]))
    with pytest.raises(ConfigError, match=r"a LlamaForCausalLM checkpoint \(llama3\), but model.name = 'qwen3'"):
        Trainer(_cfg(tmp_path, "qwen", d, ["--model.head_dim", "16"], name="qwen3_debug"))


def _two_ranks(rank: int, world: int, tmp: str, hf_dir: str) -> dict:
    tr = Trainer(_cfg(tmp, "manual", hf_dir, ["--training.steps", "3", "--checkpoint.last_save_in_hf", "true"],
                      world_size=2))
    losses = tr.train()
    tr.model.eval()
    with torch.no_grad():
        logits = tr.model(TOKENS)
    # auto mode: the planner's placements read the same shards (DCP reshards to any plan)
    auto = Trainer(_cfg(tmp, "auto", hf_dir, ["--training.steps", "2", "--checkpoint.last_save_in_hf", "true",
                                              "--parallelism.mode", "auto"], world_size=2))
    return {"losses": losses, "logits": logits, "auto_losses": auto.train()}


@pytest.mark.slow
def test_two_ranks_train_and_export(hf_llama, tmp_path):
    """FSDP on 2 ranks reads its shards of the HF folder, trains 3 steps and exports: transformers
    gives the trained model's logits. Auto mode on 2 ranks starts from the same weights."""
    hf, d = hf_llama
    out = run_distributed(_two_ranks, 2, str(tmp_path), str(d), timeout=300)[0]
    assert sorted(out["losses"]) == [1, 2, 3]
    exported = tmp_path / "manual" / "checkpoints" / "step-3-hf"
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    back = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        ref = back(TOKENS).logits
        moved = (ref - hf(TOKENS).logits).abs().max().item()
    diff = (ref - out["logits"]).abs().max().item()
    print(f"2 ranks, trained 3 steps: max |logits(ours) - logits(transformers, exported)| = {diff:.2e} "
          f"(moved {moved:.2e} from the start)")
    assert diff <= TOL and moved > 1e-3
    # the step-3 DCP checkpoint (sharded on 2 ranks, optimizer state besides) carries its HF config: to-hf
    hf_from_dcp = dcp_to_hf(tmp_path / "manual" / "checkpoints" / "step-3", tmp_path / "from_dcp")
    with torch.no_grad():
        logits = transformers.LlamaForCausalLM.from_pretrained(hf_from_dcp).eval()(TOKENS).logits
    assert (logits - out["logits"]).abs().max().item() <= TOL
    # auto mode started from the same HF weights trains the same two steps (same data, same
    # global batch), and its export is a complete HF folder of the trained weights
    for step in (1, 2):
        assert out["auto_losses"][step] == pytest.approx(out["losses"][step], rel=1e-5), step
    auto_hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "auto" / "checkpoints" / "step-2-hf").eval()
    with torch.no_grad():
        assert (auto_hf(TOKENS).logits - hf(TOKENS).logits).abs().max().item() > 1e-3  # trained, not the start


def test_a_dcp_folder_someone_sent_is_checked_and_runs_no_code(hf_llama, tmp_path):
    """initial_load_path and to-hf: a changed shard fails its checksum; a pickle planted in
    .metadata (its manifest rewritten to match) is refused naming the file, and nothing runs."""
    import pickle

    from trainer.checkpoint_files import write_manifest

    _, d = hf_llama
    src = hf_to_dcp(d, tmp_path / "dcp")
    shard = next(src.glob("*.distcp"))
    good = shard.read_bytes()
    shard.write_bytes(good[:-8] + bytes(8))
    with pytest.raises(ConfigError, match=rf"^{shard} does not match its checksum .*nothing was loaded"):
        dcp_to_hf(src, tmp_path / "hf")
    shard.write_bytes(good)
    marker = tmp_path / "marker"
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data["x"] = type("Payload", (), {"__reduce__": lambda self: (Path.touch, (marker,))})()
    (src / ".metadata").write_bytes(pickle.dumps(md))
    write_manifest(src, {})
    with pytest.raises(ConfigError, match=rf"^{src / '.metadata'}: refused, .*pass --trust-foreign to convert_hf"):
        dcp_to_hf(src, tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"initial_load_path.*\.metadata: refused, .*'checkpoint.trust_foreign' = "):
        Trainer(_cfg(tmp_path, "dcp", src, ["--training.steps", "1", "--checkpoint.initial_load_in_hf",
                                            "false"])).start()
    assert not marker.exists() and not (tmp_path / "hf").exists()
