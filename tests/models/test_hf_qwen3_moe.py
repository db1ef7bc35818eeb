"""Qwen3-MoE Hugging Face checkpoints <-> our qwen3_moe: logits equal transformers' (fp32) both
ways, one routing option flipped makes them differ, the DCP round trip through convert_hf,
routing we do not implement is one error (exit 2), and a job with EP on 2 gloo ranks reads
only its experts, trains and exports."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402

from models import get_model_spec  # noqa: E402
from models.hf import HFConfigError, args_from_hf_config, hf_config_from_args  # noqa: E402
from models.hf_experts import expert_hf_key, split_experts, stack_experts  # noqa: E402
from tools import convert_hf  # noqa: E402
from trainer.hf_checkpoint import from_hf_tensors, read_hf_folder, save_hf, to_hf_tensors  # noqa: E402
from trainer.hf_experts import hf_load_entries  # noqa: E402

TOL = 1e-5
# head_dim 32 != 64 / 4; 8 experts, top-2, renormalised (transformers' default is not)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=128)
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers Qwen3MoeForCausalLM, its save_pretrained folder)."""
    torch.manual_seed(0)
    m = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY)).eval()
    d = tmp_path_factory.mktemp("qwen3_moe")
    m.save_pretrained(d)
    return m, d


def ours_from(args, sd: dict) -> torch.nn.Module:
    with torch.device("meta"):
        model = get_model_spec("qwen3_moe").model_cls(args)
    model.to_empty(device="cpu")
    model.rope.init_weights("cpu")
    model.load_state_dict(sd, strict=True)
    return model.eval()


def _diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    with torch.no_grad():
        return (a(TOKENS).logits - b(TOKENS)).abs().max().item()


def test_logits_equal_transformers_and_a_flipped_routing_option_differs(saved):
    hf, d = saved
    name, args, _, sd = read_hf_folder(d)
    assert name == "qwen3_moe" and args.route_norm and (args.n_routed_experts, args.n_activated_experts) == (8, 2)
    assert sd["layers.1.moe.experts.w2"].shape == (8, 64, 32)
    diff = _diff(hf, ours_from(args, sd))
    print(f"qwen3_moe: max |logits(ours) - logits(transformers)| = {diff:.2e}")
    assert diff <= TOL
    args.route_norm = False  # norm_topk_prob off: the top-2 weights no longer sum to one
    flipped = _diff(hf, ours_from(args, sd))
    print(f"qwen3_moe with norm_topk_prob flipped: max |diff| = {flipped:.2e}")
    assert flipped > 1e-3


@pytest.mark.parametrize("with_base", [True, False])
def test_export_loads_back_in_transformers(saved, tmp_path, with_base):
    """Our export (the job's `save_hf`), with the source config as base or made from the
    arguments alone, is a Qwen3MoeForCausalLM with our logits."""
    hf, d = saved
    name, args, cfg, sd = read_hf_folder(d)
    ours = ours_from(args, sd)
    out = save_hf(ours, hf_config_from_args(name, args, cfg if with_base else None), tmp_path / "hf")
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
    assert back.config.num_experts == 8 and back.config.norm_topk_prob is True
    assert _diff(back, ours) <= TOL
    written = json.loads((out / "config.json").read_text())
    assert "num_local_experts" not in written and written["num_experts"] == 8
    assert ("intermediate_size" in written) == with_base  # the dense width: the source's, or left out


def test_expert_names_both_ways(saved):
    _, d = saved
    _, _, _, sd = read_hf_folder(d)
    hf = to_hf_tensors(sd)
    assert hf["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert torch.equal(hf["model.layers.1.mlp.experts.3.gate_proj.weight"], sd["layers.1.moe.experts.w1"][3])
    assert torch.equal(hf["model.layers.1.mlp.gate.weight"], sd["layers.1.moe.router.gate.weight"])
    back = from_hf_tensors(hf)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert expert_hf_key("layers.0.moe.experts.w3", 5) == "model.layers.0.mlp.experts.5.up_proj.weight"
    gap = split_experts("layers.0.moe.experts.w1", torch.zeros(3, 2, 2))
    del gap["model.layers.0.mlp.experts.1.gate_proj.weight"]
    with pytest.raises(KeyError, match=r"missing \[1\]"):
        stack_experts(gap)
    # a plain state dict: every expert read whole
    entries, boxes = hf_load_entries({"layers.0.moe.experts.w2": torch.zeros(8, 64, 32)})
    assert len(entries) == 8 and all(tuple(b.offsets) == (0, 0) and tuple(b.sizes) == (64, 32)
                                     for b in boxes.values())


def test_a_box_of_an_expert_is_read_alone(saved):
    """The planner reads the given box of an expert's HF tensor into a smaller view (what a
    rank holding part of the non-expert dims gets), nothing else."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from trainer.hf_experts import ExpertSlicePlanner

    hf, d = saved
    name = "model.layers.1.mlp.experts.5.gate_proj.weight"  # [32, 64]
    part = torch.full((16, 64), float("nan"))
    box = ChunkStorageMetadata(offsets=torch.Size([8, 0]), sizes=torch.Size([16, 64]))
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({name: part}, storage_reader=dcp.HuggingFaceStorageReader(str(d)),
                 planner=ExpertSlicePlanner({name: box}))
    full = dict(hf.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"][5, :32]  # transformers fuses gate|up
    assert torch.equal(part, full[8:24].detach())


def test_round_trip_through_dcp(saved, tmp_path):
    hf, d = saved
    assert convert_hf.main(["to-dcp", str(d), str(tmp_path / "dcp")]) == 0
    assert convert_hf.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp", "hf"]
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - hf(TOKENS).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("key,value", [("mlp_only_layers", [0]), ("decoder_sparse_step", 2),
                                       ("shared_expert_intermediate_size", 64), ("num_experts", 0)])
def test_routing_we_do_not_implement_is_one_error(saved, tmp_path, capsys, key, value):
    _, d = saved
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("num_local_experts", None)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(d / "model.safetensors")
    (bad / "config.json").write_text(json.dumps({**cfg, "num_experts": 8, key: value}))
    assert convert_hf.main(["to-dcp", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{key} = {value!r}" in err and "config.json" in err and "not supported" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    with pytest.raises(HFConfigError, match="num_experts_per_tok = 9"):
        args_from_hf_config({**cfg, "num_experts": 8, "num_experts_per_tok": 9})


# ------------------------------------------------------------------------- EP on 2 ranks

JOB = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--model.head_dim", "32", "--model.moe_inter_dim", "32", "--training.seq_len", "32",
       "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
       "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-2", "--checkpoint.initial_load_in_hf", "true",
       "--parallelism.expert_parallel_degree", "2"]


def _ep_ranks(rank: int, world: int, tmp: str, hf_dir: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainer.config import load_config
    from trainer.hf_checkpoint import load_initial
    from trainer.trainer import Trainer

    cfg = load_config("qwen3_moe_debug", [*JOB, "--job.dump_folder", tmp, "--job.name", "ep",
                                          "--checkpoint.initial_load_path", hf_dir, "--training.steps", "2",
                                          "--checkpoint.last_save_in_hf", "true"], world_size=world)
    tr = Trainer(cfg)
    load_initial(tr.model, cfg)  # what start() does first (train() loads again: the same weights)
    read = sorted(k for k in hf_load_entries(get_model_state_dict(tr.model))[1] if "layers.0.mlp.experts." in k)
    with torch.no_grad():
        loaded = tr.model(TOKENS)
    losses = tr.train()
    tr.model.eval()
    with torch.no_grad():
        trained = tr.model(TOKENS)
    return {"read": read, "loaded": loaded, "trained": trained, "losses": losses}


@pytest.mark.slow
def test_ep_two_ranks_read_their_experts_train_and_export(saved, tmp_path):
    """EP 2 on 2 gloo ranks: each rank reads its 4 experts only (slices of the HF folder), the
    loaded logits equal transformers', and the export after 2 steps gives the trained logits."""
    hf, d = saved
    out = run_distributed(_ep_ranks, 2, str(tmp_path), str(d), timeout=400)
    for rank, r in enumerate(out):
        assert [int(k.split(".")[5]) for k in r["read"][::3]] == list(range(4 * rank, 4 * rank + 4)), r["read"]
    with torch.no_grad():
        ref = hf(TOKENS).logits
    assert (out[0]["loaded"] - ref).abs().max().item() <= TOL
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ep" / "checkpoints" / "step-2-hf").eval()
    with torch.no_grad():
        exported = back(TOKENS).logits
    diff = (exported - out[0]["trained"]).abs().max().item()
    print(f"EP 2: losses {out[0]['losses']}, max |logits(ours) - logits(exported)| = {diff:.2e}")
    assert diff <= TOL and (exported - ref).abs().max().item() > 1e-3
