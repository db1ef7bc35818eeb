"""Recipe numerics: the first 5 losses and the step-0 gradients equal a 1-rank run
(fp32, max abs diff < 1e-4, and < 1e-3 relative to each parameter's largest gradient)
for the debug models (2 layers), on 2 or 4 gloo ranks. The cases of one world size run
in one set of ranks."""

import functools

import pytest

from dist_utils import run_distributed
from numerics import compare, run_steps, worker

TOL = 1e-4


@functools.lru_cache(maxsize=None)
def _reference(model):
    return run_steps({"model": model})


# ---- recipe applications (module level: they are pickled to the workers) -------------
def tp2(model, mesh):
    from parallel.recipes.tp import apply_tp

    return apply_tp(model, mesh["tp"])


def tp2_no_sp(model, mesh):
    from parallel.recipes.tp import apply_tp

    return apply_tp(model, mesh["tp"], sequence_parallel=False, loss_parallel=False)


def fsdp_tp(model, mesh):
    from parallel.recipes.hsdp import apply_hsdp, data_parallel_mesh
    from parallel.recipes.tp import apply_tp

    apply_tp(model, mesh["tp"])
    return apply_hsdp(model, data_parallel_mesh(mesh))


def hsdp(model, mesh):
    from parallel.recipes.hsdp import apply_hsdp, data_parallel_mesh

    return apply_hsdp(model, data_parallel_mesh(mesh))


def cp2(model, mesh):
    from parallel.recipes.cp import apply_cp
    from parallel.recipes.hsdp import apply_hsdp, data_parallel_mesh

    apply_cp(model, mesh, "cp")
    return apply_hsdp(model, data_parallel_mesh(mesh))


CASES = {
    "llama3_tp2": ("llama3", (2,), ("tp",), tp2),
    "llama3_tp2_nosp": ("llama3", (2,), ("tp",), tp2_no_sp),
    "llama3_fsdp2_tp2": ("llama3", (2, 2), ("dp_shard", "tp"), fsdp_tp),
    "llama3_hsdp2x2": ("llama3", (2, 2), ("dp_replicate", "dp_shard"), hsdp),
    "llama3_cp2": ("llama3", (2,), ("cp",), cp2),
    "qwen3_tp2": ("qwen3", (2,), ("tp",), tp2),
}


def _ep(model, mesh, ep):
    from parallel.recipes.ep import apply_ep, build_ep_meshes, experts_fsdp_filter
    from parallel.recipes.hsdp import apply_hsdp, data_parallel_mesh

    exp_dp, ep_mesh = build_ep_meshes(mesh, ep)
    apply_ep(model, ep_mesh)
    dp = data_parallel_mesh(mesh)
    return apply_hsdp(model, dp, module_filter=experts_fsdp_filter(exp_dp, dp.size()))


def ep2(model, mesh):
    return _ep(model, mesh, 2)


def cp2_tp2(model, mesh):
    from parallel.recipes.tp import apply_tp

    apply_tp(model, mesh["tp"])
    return cp2(model, mesh)


def fsdp_tp_sac(model, mesh):
    import types

    from parallel.activation_checkpoint import apply_ac
    from parallel.recipes.hsdp import apply_hsdp, data_parallel_mesh
    from parallel.recipes.tp import apply_tp

    apply_tp(model, mesh["tp"])
    apply_ac(model, types.SimpleNamespace(mode="selective", selective_ac_option="op"))
    return apply_hsdp(model, data_parallel_mesh(mesh))


CASES["llama3_cp2_tp2"] = ("llama3", (2, 2), ("cp", "tp"), cp2_tp2)
CASES["llama3_fsdp2_tp2_sac"] = ("llama3", (2, 2), ("dp_shard", "tp"), fsdp_tp_sac)
def ep2_tp2(model, mesh):
    from parallel.recipes.tp import apply_tp

    apply_tp(model, mesh["tp"])
    return _ep(model, mesh, 2)


CASES["deepseek_v3_cp2"] = ("deepseek_v3", (2,), ("cp",), cp2)
CASES["deepseek_v3_tp2"] = ("deepseek_v3", (2,), ("tp",), tp2)
CASES["deepseek_v3_ep2_tp2"] = ("deepseek_v3", (2, 2), ("dp_shard", "tp"), ep2_tp2)
CASES["deepseek_v3_ep2"] = ("deepseek_v3", (2,), ("dp_shard",), ep2)
CASES["deepseek_v3_ep2_fsdp4"] = ("deepseek_v3", (4,), ("dp_shard",), ep2)


def _world(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def multi_worker(rank, world, specs):
    """Run several cases in one set of ranks (saves a process spawn per case)."""
    return {name: worker(rank, world, spec) for name, spec in specs.items()}


_RESULTS: dict = {}


def _results_for(world):
    """All cases of one world size, run together once per test session."""
    if world not in _RESULTS:
        specs = {name: {"model": m, "mesh": (shape, names), "apply": apply}
                 for name, (m, shape, names, apply) in CASES.items() if _world(shape) == world}
        _RESULTS[world] = run_distributed(multi_worker, world, specs, timeout=600)[0]
    return _RESULTS[world]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_recipe_matches_single_rank(case):
    model, shape, names, apply = CASES[case]
    got = _results_for(_world(shape))[case]
    ref = _reference(model)
    diffs = compare(ref, got)
    print(f"{case}: losses {['%.5f' % x for x in got['losses']]} max diffs {diffs}")
    assert diffs["loss"] < TOL and diffs["grad"] < TOL, diffs
    assert diffs["grad_rel"] < 1e-3, diffs
