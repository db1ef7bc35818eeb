"""Auto mode's dry run of a GPU job on this CPU machine: a fake world of fake CUDA tensors,
through the trainer's GPU branch (meta model, plan, sharded init, step graph).

The device check asserts that every placeholder, constant and factory output of every
per-rank graph is on the job's device: the check that would have caught a host tensor in
the H200's eager step graph. Its own unit test shows it finds such a value."""

import re

import pytest
import torch
from torch import fx

import train
from parallel.auto.runtime.device import off_device, place_on_device
from trainer.config import load_config
from trainer.config_checks import validate_config
from trainer.dry_run_auto import dry_run_auto, format_auto_report


def _cfg(name, world, *overrides):
    cfg = load_config(name, ["--training.local_batch_size", "2", "--training.seq_len", "64", *overrides],
                      world_size=world, validate=False)
    validate_config(cfg, world, simulated_device=True)
    return cfg


def _factory_graph(device: str) -> fx.GraphModule:
    """x + ones(4, device=device) + a lifted constant, as a traced graph holds them."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, device="meta")
    ones = g.call_function(torch.ops.aten.ones.default, ([4],), {"device": torch.device(device)})
    c = g.get_attr("const")
    g.output(g.call_function(torch.ops.aten.add.Tensor, (g.call_function(torch.ops.aten.add.Tensor, (x, ones)), c)))
    gm = fx.GraphModule({"const": torch.zeros(4)}, g)
    return gm


def test_device_check_finds_host_tensors_and_placing_moves_them():
    gm = _factory_graph("cpu")
    found = off_device(gm, "meta", values=False)
    assert len(found) == 2 and any("ones" in f for f in found) and any("constant" in f for f in found), found
    assert place_on_device(gm, torch.device("meta"), traced_device="cpu") == 2
    assert off_device(gm, "meta", values=False) == []
    # a graph traced on the job's device keeps the device its factories name (a host copy is the user's)
    gm = _factory_graph("cpu")
    assert place_on_device(gm, torch.device("meta"), traced_device="meta") == 1
    assert off_device(gm, "meta", values=False) == ["ones_default (ones device=): cpu"]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,overrides,axes,regions", [
    ("qwen3_debug_auto", 2, ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree",
                             "2", "--parallelism.memory_estimate", "false"), {"tp"}, []),
    ("deepseek_v3_debug_auto", 2, ("--training.mixed_precision_param", "bfloat16",
                                   "--parallelism.memory_estimate", "false"), {"dp_shard"}, ["moe_dispatch"]),
    ("llama3_debug_auto", 2, ("--parallelism.data_parallel_shard_degree", "1",
                              "--parallelism.context_parallel_degree", "2"), {"cp"}, ["causal_attention"]),
], ids=["qwen3-tp", "deepseek-moe", "llama3-cp"])
def test_gpu_job_dry_run_keeps_every_value_on_cuda(name, world, overrides, axes, regions):
    cfg = _cfg(name, world, *overrides)
    r = dry_run_auto(cfg, world)
    assert cfg.parallelism.planner.hardware == "auto"  # the caller's config is left as it was
    text = format_auto_report(r)
    print(text)
    assert r.device == "cuda:0" and r.off_device == [], r.off_device
    assert set(r.graphs) == {"step graph", "local forward", "local backward", "forward phase", "backward phase"}
    assert all(n > 0 for n in r.graphs.values())
    assert r.objective_us > 0 and "predicted step" in r.predicted_step
    # estimated there; the peak is in the backward or, now that gradient reductions are waited for one bucket
    # behind, in the optimizer step
    estimated = bool(re.search(r"per device in the (backward|optimizer)", r.memory))
    assert estimated == (name == "llama3_debug_auto"), r.memory
    assert axes <= {axis for _, axis in r.collectives}, r.collectives  # collectives named by mesh axis
    assert r.regions == regions  # MoE dispatch / CP attention planned as local_map regions
    # the plan's throughput line, and the recipe shape priced beside it (FSDP·TP on a tp mesh)
    assert re.search(r"^predicted [\d,]+ tok/s/GPU \(step [\d,.]+ ms, MFU [\d.]+%\)", text, re.M), text
    recipe = r.priced[1]
    assert not isinstance(recipe, str) and recipe.tokens_per_s_per_gpu > 0, recipe
    assert recipe.name.startswith("FSDP·TP2 preset" if "tp" in axes else "FSDP preset (per-op SAC)"), recipe.name


@pytest.mark.slow
def test_expert_axis_dry_run_prices_the_ep_recipe_next_to_the_free_plan():
    """`expert_parallel_degree` in auto mode: the mesh is dp_shard_mod_ep x ep, and the report
    prices the EP recipe (experts split over ep, gathered over dp_shard_mod_ep) on the same
    trace and cost model as the free plan."""
    cfg = _cfg("deepseek_v3_debug_auto", 4, "--parallelism.expert_parallel_degree", "2",
               "--parallelism.memory_estimate", "false")
    r = dry_run_auto(cfg, 4)
    text = format_auto_report(r)
    print(text)
    assert r.mesh == "dp_shard_mod_ep=2 x ep=2" and r.off_device == []
    free, recipe = r.priced
    assert recipe.name == "EP recipe (FSDP, experts over ep=2)" and free.name.startswith("auto")
    assert re.search(r"dense_experts \(region moe_dispatch.*\) on dp_shard_mod_ep; expert_parallel "
                     r"\(region moe_dispatch.*\) on ep$", recipe.experts), recipe.experts
    # one cost model: the free plan is the optimum over a set that holds the recipe
    assert 0 < free.step_ms <= recipe.step_ms * (1 + 1e-9) and free.tokens_per_s_per_gpu > 0
    assert "free plan / recipe:" in text and "EP recipe (FSDP, experts over ep=2)" in text


@pytest.mark.slow
def test_cpu_job_dry_run_plans_and_builds_its_step_on_fake_cpu_tensors():
    """`job.device = "cpu"`: a CPU job's model arrives at the planner initialised (in the dry
    run, with fake weights of its own mode), and is traced, planned and materialised from a
    meta copy; the step graph runs with a gradient reduction, every value on the CPU."""
    r = dry_run_auto(_cfg("llama3_debug_auto", 2, "--job.device", "cpu", "--parallelism.memory_estimate", "false"), 2)
    print(format_auto_report(r))
    assert r.device == "cpu" and r.off_device == [], r.off_device
    assert r.objective_us > 0 and "predicted step" in r.predicted_step
    assert any("reduce" in kind and axis == "dp_shard" for kind, axis in r.collectives), r.collectives


@pytest.mark.slow
def test_dry_run_of_a_job_over_the_memory_limit_is_one_error(capsys):
    rc = train.main(["--config", "llama3_debug_auto", "--dry-run", "--world-size", "1", "--training.seq_len", "64",
                     "--parallelism.memory_limit_gib", "0.01"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("config error: ") and "memory_limit_gib" in err and "predicted peak" in err
    assert "activations" in err and "Traceback" not in err


def test_fake_cuda_without_a_compiler_is_one_config_error(monkeypatch):
    from trainer import device
    from trainer.config import ConfigError
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    with pytest.raises(ConfigError, match=r"'job.device' = 'auto': a dry run on fake CUDA tensors needs a C\+\+ "
                                          r"compiler.*--job.device cpu"):
        dry_run_auto(_cfg("llama3_debug_auto", 2), 2)


@pytest.mark.slow
def test_dry_run_with_micro_batches_runs_the_graph_without_gradient_reductions():
    """`global_batch_size` over 2 micro-batches: the dry run builds the step graph the steps run
    (no gradient reductions: their sum is reduced once per step, outside it) and says so,
    although the plan reduces gradients (its summary names them)."""
    r = dry_run_auto(_cfg("llama3_debug_auto", 2, "--training.global_batch_size", "8"), 2)
    print(format_auto_report(r))
    assert "grad all-reduce" in r.plan_summary or "FSDP" in r.plan_summary, r.plan_summary
    # the only reductions left are the loss's and its token count's: one scalar each
    assert r.collectives and all(calls == 1 and nbytes <= 4 for k, (calls, nbytes) in r.collectives.items()
                                 if "reduce" in k[0]), r.collectives
    assert any("2 micro-batches a step" in n for n in r.notes)
    assert "per device in the" in r.memory  # estimated with the sum held (RuntimeOptions.micro_batches)
    _runs_the_kernel(r, "efficient")  # fp32 (the job's default): test_gpu_job_step_graph_runs_attention_...'s case


def _runs_the_kernel(r, kernel: str) -> None:
    fwd, bwd = f"_scaled_dot_product_{kernel}_attention", f"_scaled_dot_product_{kernel}_attention_backward"
    assert set(r.attention) == {fwd, bwd} and r.attention[fwd] == r.attention[bwd] > 0, r.attention


@pytest.mark.slow
@pytest.mark.parametrize("mp,kernel", [("bfloat16", "flash")])
def test_gpu_job_step_graph_runs_attention_as_the_cuda_kernel(mp, kernel):
    """The joint graph holds the CPU flash op; a CUDA job's step graph runs it as the kernel torch
    would choose (flash for bf16, memory-efficient for fp32: the fp32 case is the micro-batch
    test's dry run, test_dry_run_with_micro_batches_...), forward and backward, and no
    attention `bmm` / `softmax` is left."""
    r = dry_run_auto(_cfg("llama3_debug_auto", 2, "--training.mixed_precision_param", mp,
                          "--parallelism.memory_estimate", "false"), 2)
    print(format_auto_report(r))
    _runs_the_kernel(r, kernel)
    assert r.off_device == []
