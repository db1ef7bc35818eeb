"""Fused attention is one op in the plan: the trace keeps each SDPA call as the CPU flash op
(or, noted, torch's math path when no fused kernel of the job's device takes it), the
planner's rule for it agrees with DTensor's own rules of the CUDA kernels, and a GPU job's
runtime runs it as the CUDA kernel torch would choose (flash for bf16, memory-efficient for
fp32), checked on fake CUDA tensors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from models import build_model, cross_entropy_loss
from parallel import _torch as T
from parallel.auto.candidates.coverage import coverage_report
from parallel.auto.candidates.strategies import build_candidates
from parallel.auto.trace.joint import trace_joint

TINY = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, ffn_hidden_dim=128)
MATH_OPS = {"bmm", "_softmax", "_softmax_backward_data"}


def lm_loss(model, tokens, labels):
    return cross_entropy_loss(model(tokens), labels)


def _ops(jg) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in jg.gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, T.OpOverload):
            out[T.op_name(n.target)] = out.get(T.op_name(n.target), 0) + 1
    return out


def _llama(device: str, dtype=None):
    model = build_model("llama3", "debug", device="meta", **TINY)
    toks = torch.zeros(4, 32, dtype=torch.long)
    return trace_joint(model, (toks, toks), lm_loss, device=device, copy_blocks=False, compute_dtype=dtype)


@pytest.mark.parametrize("device,dtype,kernel", [("cpu", None, "flash_cpu"), ("cuda", torch.bfloat16, "flash"),
                                                 ("cuda", None, "efficient")])
def test_debug_llama_joint_graph_has_one_fused_op_per_call(device, dtype, kernel):
    jg = _llama(device, dtype)
    ops = _ops(jg)
    assert ops["_scaled_dot_product_flash_attention_for_cpu"] == 2
    assert ops["_scaled_dot_product_flash_attention_for_cpu_backward"] == 2
    assert not MATH_OPS & set(ops), ops
    assert set(jg.attention_kernels.values()) == {kernel} and jg.attention_notes == []


class _Masked(nn.Module):
    """One attention call with an explicit boolean mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()


def test_a_call_the_cuda_kernels_cannot_take_goes_through_math_with_a_note():
    x = torch.empty(2, 16, 8, device="meta")
    cpu = trace_joint(_Masked(), (x,), device="cpu")  # the CPU flash kernel takes a mask
    assert "_scaled_dot_product_flash_attention_for_cpu" in _ops(cpu) and cpu.attention_notes == []
    gpu = trace_joint(_Masked(), (x,), device="cuda")
    ops = _ops(gpu)
    assert "bmm" in ops and not any("flash_attention" in op for op in ops), ops
    assert len(gpu.attention_notes) == 1 and "math path" in gpu.attention_notes[0] \
        and "attention mask" in gpu.attention_notes[0], gpu.attention_notes
    with T.fake_world(2):
        report = coverage_report(gpu, init_device_mesh("cpu", (2,)))
    assert f"note: {gpu.attention_notes[0]}" in str(report).splitlines()[-2]


def test_torch_choice_and_the_cuda_rules():
    q = torch.empty(2, 4, 64, 16)
    assert T.fused_kernel("cpu", q, q, q, is_causal=True) == ("flash_cpu", "")
    assert T.fused_kernel("cpu", q, q, q, dropout_p=0.1)[0] is None  # torch's CPU choice: math
    assert T.fused_kernel("cuda", q, q, q, is_causal=True, dtype=torch.bfloat16)[0] == "flash"
    assert T.fused_kernel("cuda", q, q, q, is_causal=True)[0] == "efficient"  # fp32: no flash
    odd = torch.empty(2, 4, 64, 6)  # flash takes it in bf16, memory-efficient needs dims % 4 in fp32
    assert T.fused_kernel("cuda", odd, odd, odd, dtype=torch.bfloat16)[0] == "flash"
    kernel, why = T.fused_kernel("cuda", odd, odd, odd)
    assert kernel is None and "divisible by 4" in why


def _placements(strategy, index: int) -> set[tuple]:
    return {tuple(s.input_specs[index].placements) for s in strategy.strategies}


def test_the_planner_rule_agrees_with_dtensors_cuda_rules():
    """Batch or heads (or replicated) for the traced CPU op, as DTensor's own strategies of
    the CUDA flash and memory-efficient kernels."""
    jg = _llama("cuda", torch.bfloat16)
    with T.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        cands = build_candidates(jg, mesh)
        att = [c for c in cands.nodes.values() if c.node is not None and c.node.target is T.CPU_ATTENTION_FWD]
        ours = {tuple(s.input_specs[0].placements) for s in att[0].specs}
        prop = T.sharding_propagator()
        for kernel in ("flash", "efficient"):
            fwd = T.CUDA_ATTENTION_OPS[kernel][0]
            q = T.OpStrategy([T.OpSpec(T.DTensorSpec(mesh, (p,), T.TensorMeta(torch.Size([4, 4, 32, 16]),
                                                                              (2048, 512, 16, 1), torch.float32)))
                              for p in (Replicate(), Shard(0), Shard(1))])
            args = (q, q, q, 0.0, True) if kernel == "flash" else (q, q, q, None, True, 0.0, True)
            theirs = _placements(prop.op_strategy_funcs[fwd](T.OpSchema(fwd, args, {})), 0)
            assert ours == theirs == {(Replicate(),), (Shard(0),), (Shard(1),)}, (kernel, ours, theirs)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_the_traced_op_runs_as_the_cuda_kernel_on_fake_cuda(dtype, kernel):
    T.enable_fake_cuda()
    fwd_op, bwd_op = T.CUDA_ATTENTION_OPS[kernel]
    seen: list = []

    class _Ops(T.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with T.fake_world(2):
        mesh = init_device_mesh("cuda", (2,))
        with T.FakeTensorMode(allow_non_fake_inputs=True):
            for p in (Shard(0), Shard(1)):
                x = DTensor.from_local(torch.empty(2, 4, 64, 16, dtype=dtype, device="cuda"), mesh, [p],
                                       run_check=False)
                with _Ops():
                    out, lse = T.run_lowered(T.CPU_ATTENTION_FWD, (x, x, x, 0.0, True), {})
                    grads = T.run_lowered(T.CPU_ATTENTION_BWD, (out, x, x, x, out, lse, 0.0, True), {})
                assert out.placements == lse.placements == (p,) and lse.shape == out.shape[:3]
                assert all(g.placements == (p,) and g.to_local().device.type == "cuda" for g in grads)
    assert fwd_op in seen and bwd_op in seen and T.CPU_ATTENTION_FWD not in seen


def test_attention_efficiency_in_the_profile_and_its_cpu_measurement():
    from parallel.auto.cost.calibrate import measure_attention
    from parallel.auto.cost.hardware import load_hardware, profile_from_dict, profile_to_toml

    try:
        import tomllib
    except ImportError:  # pragma: no cover
        import tomli as tomllib
    h100 = load_hardware("h100")
    assert h100.attention_eff == 0.35 and load_hardware("cpu").attention_eff == load_hardware("cpu").matmul_efficiency
    again = profile_from_dict(tomllib.loads(profile_to_toml(h100.replace(attention_efficiency=0.5))))
    assert again.attention_eff == 0.5
    assert measure_attention(b=1, h=2, s=64, d=16)[0] > 0  # TFLOP/s of the CPU flash kernel (and its spread)
