"""The ParallelModule contract on 2 gloo ranks, through the simple `auto_parallel` API
with DTensor sample inputs: subclass of the user's class with the same parameter names,
DTensor parameters with the planned placements, `to_empty` + `init_weights()` equal to
the single-device init, per-rank local inputs validated, and bf16 mixed precision."""

import pytest
from apply_workers import GLOBAL_B, batch, build, reference, run_distributed


def _api_worker(rank, world_size):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from models import Llama3Model
    from parallel.auto.api import auto_parallel, lm_loss
    from parallel.auto.config import PlannerConfig
    from parallel.auto.runtime import InputShapeError, is_parallel_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out = {}
    model = build("llama3")  # on meta
    tok, lab = batch(model.args.vocab_size, 0)
    local = slice(rank * GLOBAL_B // 2, (rank + 1) * GLOBAL_B // 2)
    sample = (DTensor.from_local(tok[local], mesh, [Shard(0)]), DTensor.from_local(lab[local], mesh, [Shard(0)]))
    pm = auto_parallel(model, mesh, sample, out_shardings=(Replicate(),), loss_fn=lm_loss,
                       planner=PlannerConfig(hardware="cpu"))
    out["isinstance"] = isinstance(pm, Llama3Model) and is_parallel_module(pm)
    out["names"] = [n for n, _ in pm.named_parameters()] == [n for n, _ in model.named_parameters()]
    out["dtensor"] = all(isinstance(p, DTensor) for p in pm.parameters())
    out["placements_match_plan"] = all(
        str(pm.plan.param_placements()[n]) == "(" + ", ".join(
            "R" if isinstance(x, Replicate) else f"S({x.dim})" for x in p.placements) + ")"
        for n, p in pm.named_parameters())
    out["input_placements"] = pm.plan_runner.input_placements(0)
    pm.to_empty(device="cpu")
    torch.manual_seed(0)
    pm.init_weights()
    full = build("llama3", "cpu")
    out["init_max_diff"] = max((p.full_tensor() - dict(full.named_parameters())[n]).abs().max().item()
                               for n, p in pm.named_parameters())
    try:
        pm(tok, lab)  # the global batch instead of this rank's shard
        out["shape_error"] = ""
    except InputShapeError as e:
        out["shape_error"] = str(e)
    loss = pm(tok[local], lab[local])
    loss.backward()
    out["loss"] = loss.item()
    out["grads"] = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}

    # bf16 compute, fp32 gradient reduction
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pm16 = auto_parallel(build("llama3", "cpu"), mesh, sample, out_shardings=(Replicate(),), loss_fn=lm_loss,
                         mp_policy=mp, planner=PlannerConfig(hardware="cpu"))
    loss16 = pm16(tok[local], lab[local])
    loss16.backward()
    out["loss_bf16"] = loss16.item()
    out["loss_bf16_dtype"] = str(loss16.dtype)
    out["grad_dtypes"] = {str(p.grad.dtype) for p in pm16.parameters()}
    out["param_dtypes"] = {str(p.dtype) for p in pm16.parameters()}
    out["grads_bf16"] = {n: p.grad.full_tensor() for n, p in pm16.named_parameters()}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_api_worker, 2, timeout=400)


@pytest.mark.slow
def test_parallel_module_contract(results):
    import torch
    from torch.distributed.tensor import Shard

    ref = reference("llama3", 1)
    for out in results:
        assert out["isinstance"] and out["names"] and out["dtensor"] and out["placements_match_plan"]
        assert out["input_placements"] == (Shard(0),)  # from the DTensor sample inputs
        assert out["init_max_diff"] == 0.0
        assert "local shape (4, 16)" in out["shape_error"] and "expects (2, 16)" in out["shape_error"]
        assert abs(out["loss"] - ref["losses"][0]) < 1e-5
        for n, g in ref["grads"].items():
            torch.testing.assert_close(out["grads"][n], g, rtol=1e-4, atol=1e-6)


def _bf16_worker(rank, world_size):
    """bf16 compute and fp32 reduction through the same runtime on `world_size` ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from parallel.auto.api import auto_parallel, lm_loss
    from parallel.auto.config import PlannerConfig

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    tok, lab = batch(build("llama3").args.vocab_size, 0)
    n = GLOBAL_B // world_size
    local = slice(rank * n, (rank + 1) * n)
    sample = (DTensor.from_local(tok[local], mesh, [Shard(0)]), DTensor.from_local(lab[local], mesh, [Shard(0)]))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pm = auto_parallel(build("llama3", "cpu"), mesh, sample, out_shardings=(Replicate(),), loss_fn=lm_loss,
                       mp_policy=mp, planner=PlannerConfig(hardware="cpu"))
    loss = pm(tok[local], lab[local])
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.full_tensor() for n, p in pm.named_parameters()}}


@pytest.mark.slow
def test_mixed_precision(results):
    """bf16 on 2 ranks = bf16 on 1 rank (the same cast policy: bf16 compute, fp32 reduction):
    gradients to 1e-2 and well away from fp32, so the test sees that bf16 ran. The loss is
    computed in fp32 from the bf16 logits (the model's `logits.float()`), so two ranks' means
    of their own tokens agree with one rank's mean far below bf16's resolution (2^-8)."""
    one = run_distributed(_bf16_worker, 1, timeout=300)[0]
    ref32 = reference("llama3", 1)
    for out in results:
        assert out["param_dtypes"] == {"torch.float32"} and out["grad_dtypes"] == {"torch.float32"}
        assert out["loss_bf16_dtype"] == "torch.float32"
        d_loss = abs(out["loss_bf16"] - one["loss"]) / one["loss"]
        rel = max((out["grads_bf16"][n] - g).norm().item() / g.norm().item() for n, g in one["grads"].items())
        rel32 = max((out["grads_bf16"][n] - g).norm().item() / g.norm().item() for n, g in ref32["grads"].items())
        print(f"bf16 2 ranks vs 1 rank: loss {d_loss:.1e} relative, max relative grad error {rel:.1e} "
              f"(vs fp32: {rel32:.1e})")
        assert d_loss < 1e-4 and rel < 1e-2 and rel32 > rel
