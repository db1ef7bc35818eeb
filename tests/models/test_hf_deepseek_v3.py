"""DeepSeek-V3 <-> transformers' DeepseekV3ForCausalLM (models/hf_deepseek_v3.py): a tiny random model
built offline (sigmoid group-limited routing with a non-zero expert bias, q LoRA, YaRN, interleaved RoPE
rows, one dense layer) saved with save_pretrained gives our logits within 1e-5 (fp32); our export loads
back into transformers with the same logits; each routing option, the bias, YaRN and the RoPE
permutation matter (flipped, the logits differ); routing we do not implement is one error, exit 2."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models import get_model_spec  # noqa: E402
from models.hf import HFConfigError, args_from_hf_config, hf_config_from_args, hf_tensor_map  # noqa: E402
from tools import convert_hf  # noqa: E402
from trainer.hf_checkpoint import read_hf_folder, to_hf_tensors, write_hf_folder  # noqa: E402

TOL = 1e-5
# the debug flavor's MLA dims (so a job with [model] overrides takes this checkpoint, tests/trainer)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, max_position_embeddings=64, initializer_range=0.1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


def tiny_hf_model(seed: int = 0) -> torch.nn.Module:
    """A random DeepseekV3ForCausalLM with a non-zero e_score_correction_bias in its MoE layers."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY)).eval()
    with torch.no_grad():
        for layer in model.model.layers[TINY["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(TINY["n_routed_experts"]) * 0.1)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    m = tiny_hf_model()
    d = tmp_path_factory.mktemp("dsv3")
    m.save_pretrained(d)
    with torch.no_grad():
        ref = m(TOKENS).logits
    return m, d, ref


def ours_from(args, sd: dict) -> torch.nn.Module:
    with torch.device("meta"):
        model = get_model_spec("deepseek_v3").model_cls(args)
    model.to_empty(device="cpu")
    model.rope.init_weights("cpu")
    model.load_state_dict(sd, strict=True)
    return model.eval()


def _diff(args, sd: dict, ref: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours_from(args, sd)(TOKENS) - ref).abs().max().item()


def test_logits_equal_transformers_and_each_option_matters(saved):
    _, d, ref = saved
    name, args, cfg, sd = read_hf_folder(d)
    assert name == "deepseek_v3" and args.score_func == "sigmoid" and args.q_lora_rank == 32
    assert (args.n_expert_groups, args.n_limited_groups, args.route_scale, args.route_norm) == (4, 2, 2.5, True)
    assert args.rope_scaling_factor == 4.0 and args.rope_original_max_seq_len == 16
    assert sd["layers.1.moe.expert_bias"].abs().min() > 0  # the bias was read
    assert sd["layers.1.moe.experts.w1"].shape == (8, 32, 64)  # stacked from 8 experts
    diff = _diff(args, sd, ref)
    print(f"deepseek_v3: max |logits(ours) - logits(transformers)| = {diff:.2e}")
    assert diff <= TOL
    flipped = {"route_norm": False, "score_func": "softmax", "n_expert_groups": 1, "n_limited_groups": 4,
               "route_scale": 1.0, "rope_scaling_factor": 0.0, "rope_mscale_all_dim": 0.0}
    for key, value in flipped.items():
        also = {"n_limited_groups": 1} if key == "n_expert_groups" else {}
        other = dataclasses.replace(args, **{key: value}, **also)
        got = _diff(other, sd, ref)
        print(f"  {key} = {value!r}: {got:.2e}")
        assert got > 1e-3, key
    no_bias = {**sd, **{k: torch.zeros_like(v) for k, v in sd.items() if k.endswith("expert_bias")}}
    assert _diff(args, no_bias, ref) > 1e-3
    # read as if the RoPE rows were stored as halves (no interleave): other q/k, other logits
    _, _, _, plain = read_hf_folder(_with_config(d, d.parent / "plain", rope_interleave=False))
    assert _diff(args, plain, ref) > 1e-3


def _with_config(src, dst, **changes):
    """`src`'s tensors (linked) with its config.json changed."""
    dst.mkdir(exist_ok=True)
    for f in src.glob("*.safetensors"):
        if not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        cfg.pop(k)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_export_loads_back_into_transformers(saved, tmp_path):
    _, d, ref = saved
    name, args, cfg, sd = read_hf_folder(d)
    out_cfg = hf_config_from_args(name, args, cfg)
    out = write_hf_folder(to_hf_tensors(sd, out_cfg), out_cfg, tmp_path / "out")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - ref).abs().max().item() <= TOL
    # and through the DCP folder (convert_hf.py to-dcp, to-hf)
    assert convert_hf.main(["to-dcp", str(d), str(tmp_path / "dcp")]) == 0
    assert convert_hf.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - ref).abs().max().item() <= TOL
    names = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert names["scoring_func"] == "sigmoid" and names["rope_interleave"] is True


def test_tensor_map_round_trips_and_permutes_rope_rows():
    _, args = args_from_hf_config({"architectures": ["DeepseekV3ForCausalLM"], **TINY})
    with torch.device("meta"):
        model = get_model_spec("deepseek_v3").model_cls(args)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tmap = hf_tensor_map("deepseek_v3", args, shapes, {"rope_interleave": True})
    assert set(tmap) == set(shapes)  # every tensor of ours has an HF home
    g = torch.Generator().manual_seed(0)
    for k, e in tmap.items():
        t = torch.randn(shapes[k], generator=g)
        parts = [t] if e.direct else e.split(t)
        assert [tuple(p.shape) for p in parts] == list(e.shapes), k
        assert torch.equal(t if e.direct else e.join(parts), t), k
    wkv_a = tmap["layers.0.attention.wkv_a.weight"]
    rows = torch.arange(64 + 16, dtype=torch.float32)[:, None].expand(-1, 64)
    assert wkv_a.join([rows])[64:, 0].tolist() == [64 + i for i in (*range(0, 16, 2), *range(1, 16, 2))]
    assert torch.equal(wkv_a.join([rows])[:64], rows[:64])  # the latent rows are not RoPE's
    assert tmap["layers.1.moe.experts.w2"].keys[3] == "model.layers.1.mlp.experts.3.down_proj.weight"


def test_mtp_layer_is_skipped(saved, tmp_path):
    """A checkpoint with DeepSeek-V3's multi-token-prediction layer (model.layers.{n_layers}) loads without it."""
    from safetensors.torch import load_file, save_file

    _, d, ref = saved
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    (tmp_path / "mtp").mkdir()
    save_file(tensors, str(tmp_path / "mtp" / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (tmp_path / "mtp" / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    _, args, _, sd = read_hf_folder(tmp_path / "mtp")
    assert _diff(args, sd, ref) <= TOL


@pytest.mark.parametrize("changes,named", [
    ({"topk_method": "greedy"}, "topk_method = 'greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
    ({"n_group": 3}, "n_group = 3"),
    ({"topk_group": 5}, "topk_group = 5"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok = 3"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config ('fp8'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type = 'longrope'"),
])
def test_routing_we_do_not_implement_is_one_error(saved, tmp_path, capsys, changes, named):
    _, d, _ = saved
    bad = _with_config(d, tmp_path / "bad", **changes)
    assert convert_hf.main(["to-dcp", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_softmax_routing_has_no_hf_export(saved):
    _, d, _ = saved
    name, args, cfg, _ = read_hf_folder(d)
    with pytest.raises(HFConfigError, match="score_func = 'softmax'"):
        hf_config_from_args(name, dataclasses.replace(args, score_func="softmax"), cfg)


def test_checkpoint_without_expert_bias(saved, tmp_path):
    """Our model without an expert bias (load_balance_coeff unset) exports zeros and takes only zeros."""
    _, d, _ = saved
    name, args, cfg, sd = read_hf_folder(d)
    plain = dataclasses.replace(args, load_balance_coeff=None)
    no_bias = {k: v for k, v in sd.items() if not k.endswith("expert_bias")}
    tensors = to_hf_tensors(no_bias, hf_config_from_args(name, plain, cfg))
    assert not tensors["model.layers.1.mlp.gate.e_score_correction_bias"].any()
    shapes = {k: tuple(v.shape) for k, v in no_bias.items()}
    gate = hf_tensor_map(name, plain, shapes, cfg)["layers.1.moe.router.gate.weight"]
    with pytest.raises(HFConfigError, match="e_score_correction_bias is not zero, .*load_balance_coeff"):
        gate.join([sd["layers.1.moe.router.gate.weight"], sd["layers.1.moe.expert_bias"]])
    # a DCP checkpoint of such a model (a training checkpoint: hf_config.json inside) goes to-hf with zeros
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": no_bias}, checkpoint_id=str(tmp_path / "dcp"))
    (tmp_path / "dcp" / "hf_config.json").write_text(json.dumps(hf_config_from_args(name, plain)))
    assert convert_hf.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not back.model.layers[1].mlp.gate.e_score_correction_bias.any()
    with torch.no_grad():
        assert (back(TOKENS).logits - ours_from(plain, no_bias)(TOKENS)).abs().max().item() <= TOL
