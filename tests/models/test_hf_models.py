"""Hugging Face checkpoints <-> our models: logits equal transformers' (fp32), the DCP round trip
through tools/convert_hf.py, and bad input as one error with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import get_model_spec  # noqa: E402
from models.hf import args_from_hf_config, from_hf_key, hf_config_from_args, to_hf_key  # noqa: E402
from tools import convert_hf  # noqa: E402
from trainer.hf_checkpoint import read_hf_folder, to_hf_tensors, write_hf_folder  # noqa: E402

TOL = 1e-5
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
# LLaMA 3.1's scaling, with a short original context so that a 40-token input sees it
LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama31":
        cfg = transformers.LlamaConfig(**TINY, rms_norm_eps=1e-5, rope_parameters=LLAMA31_ROPE)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)  # head_dim != 64 / 4
    return transformers.Qwen3ForCausalLM(cfg).eval()


def ours_from(name: str, args, sd: dict) -> torch.nn.Module:
    with torch.device("meta"):
        model = get_model_spec(name).model_cls(args)
    model.to_empty(device="cpu")
    model.rope.init_weights("cpu")
    model.load_state_dict(sd, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (transformers model, its save_pretrained folder)}."""
    out = {}
    for kind in ("llama31", "qwen3"):
        m = hf_model(kind)
        d = tmp_path_factory.mktemp(kind)
        m.save_pretrained(d)
        out[kind] = (m, d)
    return out


TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind,name", [("llama31", "llama3"), ("qwen3", "qwen3")])
def test_logits_equal_transformers(saved, kind, name):
    m, d = saved[kind]
    got_name, args, _, sd = read_hf_folder(d)
    assert got_name == name
    ours = ours_from(name, args, sd)
    with torch.no_grad():
        ref, out = m(TOKENS).logits, ours(TOKENS)
    diff = (ref - out).abs().max().item()
    print(f"{kind}: max |logits(ours) - logits(transformers)| = {diff:.2e}")
    assert diff <= TOL
    if kind == "llama31":  # the scaling is what makes them equal: without it they differ
        assert args.rope_scaling() == (8.0, 1.0, 4.0, 16)
        args.rope_scaling_factor = 0.0
        with torch.no_grad():
            assert (ref - ours_from(name, args, sd)(TOKENS)).abs().max().item() > 1e-3
    else:  # tied: output starts as the embedding
        assert torch.equal(sd["output.weight"], sd["tok_embeddings.weight"])


def test_key_maps_are_inverse():
    with torch.device("meta"):
        model = get_model_spec("qwen3").model_cls(
            args_from_hf_config({"architectures": ["Qwen3ForCausalLM"], **TINY, "head_dim": 32})[1])
    for k in model.state_dict():
        assert from_hf_key(to_hf_key(k)) == k
    assert to_hf_key("layers.1.attention.wq.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert to_hf_key("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight"


def test_round_trip_through_dcp(saved, tmp_path):
    """to-dcp then to-hf: transformers loads the result (untied) and gives the same logits."""
    m, d = saved["qwen3"]
    assert convert_hf.main(["to-dcp", str(d), str(tmp_path / "dcp")]) == 0
    assert (tmp_path / "dcp" / "hf_config.json").is_file() and (tmp_path / "dcp" / ".metadata").is_file()
    assert convert_hf.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "hf"]  # no .tmp left
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert back.config.tie_word_embeddings is False
    with torch.no_grad():
        diff = (back(TOKENS).logits - m(TOKENS).logits).abs().max().item()
    assert diff <= TOL


def test_bad_input_is_one_error(saved, tmp_path, capsys):
    _, d = saved["llama31"]
    # another architecture
    other = tmp_path / "mistral"
    other.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    assert convert_hf.main(["to-dcp", str(other), str(tmp_path / "out1")]) == 2
    err = capsys.readouterr().err
    assert "MistralForCausalLM" in err and "not supported" in err and err.count("\n") == 1
    # tensors that do not match the config: it says 3 layers and a wider FFN
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "model.safetensors").symlink_to(d / "model.safetensors")
    (wrong / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3, "intermediate_size": 96}))
    assert convert_hf.main(["to-dcp", str(wrong), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert "missing model.layers.2." in err
    assert "model.layers.0.mlp.gate_proj.weight [128, 64] (this model: [96, 64])" in err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())  # nothing written


def test_sharded_folders(saved, tmp_path):
    """Many safetensors shards with an index, both ways: transformers' shards read, ours written."""
    m, _ = saved["llama31"]
    m.save_pretrained(tmp_path / "in", max_shard_size="60KB")
    assert len(list((tmp_path / "in").glob("*.safetensors"))) > 1
    name, args, cfg, sd = read_hf_folder(tmp_path / "in")
    out = write_hf_folder(to_hf_tensors(sd), hf_config_from_args(name, args, cfg), tmp_path / "out",
                          max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(to_hf_tensors(sd))
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - m(TOKENS).logits).abs().max().item() <= TOL
