"""Recipe numerics: the first 5 losses and the step-0 gradients equal a 1-rank run
(fp32, max abs diff < 1e-4, and < 1e-3 relative to each parameter's largest gradient)
for the debug models (2 layers), on 2 or 4 gloo ranks. The cases of one world size run
in one set of ranks."""

import functools
import math

import pytest
from dist_utils import run_distributed
from numerics import compare, run_steps, worker

from parallel.activation_checkpoint import apply_ac
from parallel.mesh import CP, DP_REPLICATE, DP_SHARD, TP
from parallel.recipes.cp import apply_cp
from parallel.recipes.ep import apply_ep, build_ep_meshes, experts_fsdp_filter
from parallel.recipes.fsdp import apply_fsdp, data_parallel_mesh
from parallel.recipes.tp import apply_tp

TOL = 1e-4


@functools.lru_cache(maxsize=None)
def _reference(model):
    return run_steps({"model": model})


# ---- recipe applications (module level: they are pickled to the workers) -------------
def tp2(model, mesh):
    return apply_tp(model, mesh[TP])


def tp2_no_sp(model, mesh):
    return apply_tp(model, mesh[TP], sequence_parallel=False, loss_parallel=False)


def fsdp(model, mesh):
    """FSDP (1-D data mesh) or HSDP (2-D): the same function."""
    return apply_fsdp(model, data_parallel_mesh(mesh))


def fsdp_tp(model, mesh):
    apply_tp(model, mesh[TP])
    return fsdp(model, mesh)


def cp2(model, mesh):
    apply_cp(model, mesh, CP)
    return fsdp(model, mesh)


def cp2_tp2(model, mesh):
    apply_tp(model, mesh[TP])
    return cp2(model, mesh)


def fsdp_tp_sac(model, mesh):
    apply_tp(model, mesh[TP])
    apply_ac(model, "selective", "op")
    return fsdp(model, mesh)


def _ep(model, mesh, ep):
    exp_dp, ep_mesh = build_ep_meshes(mesh, ep)
    apply_ep(model, ep_mesh)
    dp = data_parallel_mesh(mesh)
    return apply_fsdp(model, dp, pre_shard=experts_fsdp_filter(exp_dp, dp.size()))


def ep2(model, mesh):
    return _ep(model, mesh, 2)


def ep2_tp2(model, mesh):
    apply_tp(model, mesh[TP])
    return _ep(model, mesh, 2)


CASES = {
    "llama3_tp2": ("llama3", (2,), (TP,), tp2),
    "llama3_tp2_nosp": ("llama3", (2,), (TP,), tp2_no_sp),
    "llama3_fsdp2_tp2": ("llama3", (2, 2), (DP_SHARD, TP), fsdp_tp),
    "llama3_hsdp2x2": ("llama3", (2, 2), (DP_REPLICATE, DP_SHARD), fsdp),
    "llama3_cp2": ("llama3", (2,), (CP,), cp2),
    "llama3_cp2_tp2": ("llama3", (2, 2), (CP, TP), cp2_tp2),
    "llama3_fsdp2_tp2_sac": ("llama3", (2, 2), (DP_SHARD, TP), fsdp_tp_sac),
    "qwen3_tp2": ("qwen3", (2,), (TP,), tp2),
    "deepseek_v3_cp2": ("deepseek_v3", (2,), (CP,), cp2),
    "deepseek_v3_tp2": ("deepseek_v3", (2,), (TP,), tp2),
    "deepseek_v3_ep2_tp2": ("deepseek_v3", (2, 2), (DP_SHARD, TP), ep2_tp2),
    "deepseek_v3_ep2": ("deepseek_v3", (2,), (DP_SHARD,), ep2),
    "deepseek_v3_ep2_fsdp4": ("deepseek_v3", (4,), (DP_SHARD,), ep2),
    "qwen3_moe_ep2": ("qwen3_moe", (2,), (DP_SHARD,), ep2),
}


def multi_worker(rank, world, specs):
    """Run several cases in one set of ranks (saves a process spawn per case)."""
    return {name: worker(rank, world, spec) for name, spec in specs.items()}


_RESULTS: dict = {}


def _results_for(world):
    """All cases of one world size, run together once per test session."""
    if world not in _RESULTS:
        specs = {name: {"model": m, "mesh": (shape, names), "apply": apply}
                 for name, (m, shape, names, apply) in CASES.items() if math.prod(shape) == world}
        _RESULTS[world] = run_distributed(multi_worker, world, specs, timeout=600)[0]
    return _RESULTS[world]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_matches_single_rank(case):
    model, shape, names, apply = CASES[case]
    got = _results_for(math.prod(shape))[case]
    ref = _reference(model)
    diffs = compare(ref, got)
    print(f"{case}: losses {['%.5f' % x for x in got['losses']]} max diffs {diffs}")
    assert diffs["loss"] < TOL and diffs["grad"] < TOL, diffs
    assert diffs["grad_rel"] < 1e-3, diffs
