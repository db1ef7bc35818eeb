"""Cost model: profiles, mesh-axis links, collectives, redistribution decomposition,
roofline compute. Numbers asserted here are computed by hand from the h100 profile."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from parallel.auto.candidates.placements import shard_dim
from parallel.auto.cost import (
    Collective,
    CostModel,
    HardwareProfile,
    ProfileError,
    RedistributionNotAllowed,
    collective_time,
    list_profiles,
    load_hardware,
    profile_from_dict,
    profile_to_toml,
    summarize_collectives,
)

R = Replicate()
BF16_4K = ((4096, 4096), torch.bfloat16)  # 32 MiB
S4K = 4096 * 4096 * 2


# ------------------------------------------------------------------ profiles
@pytest.mark.parametrize("name", ["h100", "h200", "a100", "cpu"])
def test_load_each_profile(name: str) -> None:
    hw = load_hardware(name)
    assert isinstance(hw, HardwareProfile) and hw.name == name
    assert hw.peak_flops(torch.float32) > 0 and hw.memory_bandwidth > 0
    assert load_hardware(hw) is hw  # passes through
    assert name in list_profiles()


def test_profile_figures() -> None:
    h100, h200, a100 = (load_hardware(n) for n in ("h100", "h200", "a100"))
    assert h100.peak_flops(torch.bfloat16) == pytest.approx(989e12)
    assert h100.peak_flops("fp8") == pytest.approx(1979e12)
    assert a100.peak_flops(torch.float8_e4m3fn) == pytest.approx(312e12)  # fp8 → bf16 fallback
    assert h100.gpus_per_node == 8 and h100.inter_node.bandwidth_gbps == 50
    assert h200.memory_bandwidth_gbps == 4800 and h200.memory_bytes > h100.memory_bytes
    assert a100.inter_node.bandwidth_gbps == 25


def test_unknown_profile_lists_available() -> None:
    with pytest.raises(ProfileError, match="unknown hardware profile 'tpu9'.*a100.*cpu.*h100.*h200"):
        load_hardware("tpu9")
    with pytest.raises(ProfileError, match="not found"):
        load_hardware("/nonexistent/x.toml")


def test_bad_toml_key_is_clear(tmp_path) -> None:
    text = (load_hardware("h100").source and open(load_hardware("h100").source).read())
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("[efficiency]\n", "[efficiency]\nmatmull = 0.5\n"))
    with pytest.raises(ProfileError, match=r"bad\.toml.*unknown key 'matmull' in \[efficiency\]"):
        load_hardware(str(bad))
    bad.write_text(text.replace("gpus_per_node = 8", "gpus_per_nod = 8"))
    with pytest.raises(ProfileError, match="unknown key 'gpus_per_nod'"):
        load_hardware(str(bad))
    bad.write_text(text.replace("memory_bandwidth_gbps = 3350", 'memory_bandwidth_gbps = "fast"'))
    with pytest.raises(ProfileError, match="memory_bandwidth_gbps"):
        load_hardware(str(bad))


def test_user_profile_file_roundtrip(tmp_path) -> None:
    hw = load_hardware("h100").replace(name="mybox", gpus_per_node=4)
    p = tmp_path / "mybox.toml"
    p.write_text(profile_to_toml(hw))
    back = load_hardware(str(p))
    assert back.name == "mybox" and back.gpus_per_node == 4
    assert back.intra_node == hw.intra_node and back.inter_node == hw.inter_node
    assert back.intra_node.group_size_factor == {2: 1.35, 4: 1.15}
    cm = CostModel(str(p), (2, 4))
    assert cm.is_intra_node(1) and not cm.is_intra_node(0)


# ------------------------------------------------------------------ axis → link
def test_axis_mapping_h100() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    assert cm.is_intra_node(1) and not cm.is_intra_node(0)
    assert cm.links[0].bus_bandwidth_gbps["all_gather"] == 50  # NIC bound
    assert cm.links[1].bus_bandwidth_gbps["all_gather"] == 390
    cm3 = CostModel("h100", (2, 4, 8))
    assert [cm3.is_intra_node(i) for i in range(3)] == [False, False, True]
    cm3b = CostModel("h100", (8, 2, 4))  # 2*4 = 8 fits a node
    assert [cm3b.is_intra_node(i) for i in range(3)] == [False, True, True]
    # partially spanning: size 4 over inner 4 on 8/node → inter-node, 2 members per node
    cm3c = CostModel("h100", (2, 4, 4))
    assert not cm3c.is_intra_node(1) and cm3c.links[1].members_per_node == 2
    assert cm3c.links[1].bus_bandwidth_gbps["all_gather"] == 100
    # whole-world axis across nodes: 8 members per node, min(NVLink, 8 NICs)
    cm1 = CostModel("h100", (16,))
    assert not cm1.is_intra_node(0) and cm1.links[0].bus_bandwidth_gbps["all_gather"] == 390
    # cpu: everything on one host
    assert all(CostModel("cpu", (2, 2)).is_intra_node(i) for i in range(2))


def test_small_intra_groups_are_faster() -> None:
    cm = CostModel("h100", (2, 4, 2))  # axes 1, 2 intra-node (4*2 = 8), axis 0 inter
    assert cm.links[2].bus_bandwidth_gbps["all_gather"] == pytest.approx(390 * 1.35)
    assert cm.links[1].bus_bandwidth_gbps["all_gather"] == pytest.approx(390 * 1.15)
    assert CostModel("h100", (8,)).links[0].bus_bandwidth_gbps["all_gather"] == 390
    assert cm.links[0].bus_bandwidth_gbps["all_gather"] == 50
    assert load_hardware("h100").intra_node.bandwidth("all_reduce", 3) == pytest.approx(270 * 1.15)


def test_mesh_name_mismatch() -> None:
    with pytest.raises(ValueError):
        CostModel("h100", (4, 8), ("dp",))


# ------------------------------------------------------------------ collectives
def test_all_gather_inter_costs_more_and_hand_numbers() -> None:
    cm = CostModel("h100", (8, 8), ("dp", "tp"))
    intra = cm.collective_cost("all_gather", S4K, 1)
    inter = cm.collective_cost("all_gather", S4K, 0)
    # intra: 10 + 7*1 + S*7/8 / 390e3 ; inter: 15 + 7*5 + S*7/8 / 50e3
    assert intra == pytest.approx(17 + S4K * 7 / 8 / 390e3)
    assert inter == pytest.approx(50 + S4K * 7 / 8 / 50e3)
    assert inter > 6 * intra
    assert cm.collective_cost("all_reduce", S4K, 1) == pytest.approx(10 + 14 + 2 * S4K * 7 / 8 / 270e3)
    assert cm.collective_cost("all_to_all", S4K, 1) == pytest.approx(17 + S4K * 7 / 8 / 340e3)
    assert CostModel("h100", (1, 8)).collective_cost("all_gather", S4K, 0) == 0.0


def test_ring_vs_tree_crossover() -> None:
    cm = CostModel("h100", (32, 8), ("dp", "tp"))  # 32 nodes on axis 0
    link = cm.links[0]
    t_small, algo_small = collective_time("all_reduce", 4096, link)
    t_big, algo_big = collective_time("all_reduce", 1 << 30, link)
    assert algo_small == "tree" and algo_big == "ring"
    # tree small: 15 + 2*5*5 + 4096/(50e3*0.45)
    assert t_small == pytest.approx(65 + 4096 / (50e3 * 0.45))
    assert t_big == pytest.approx(15 + 62 * 5 + 2 * (1 << 30) * 31 / 32 / 50e3)
    # intra-node axes never use tree
    assert collective_time("all_reduce", 4096, cm.links[1])[1] == "ring"


# ------------------------------------------------------------------ redistribution
def test_shard_to_replicate_is_all_gather_right_axis_and_bytes() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    (c,) = cm.redistribute_collectives((R, Shard(0)), (R, R), BF16_4K)
    assert (c.kind, c.mesh_axis, c.axis_name, c.bytes) == ("all_gather", 1, "tp", S4K)
    # tensor also sharded on the other axis → the gathered size is S / 4
    (c,) = cm.redistribute_collectives((Shard(1), Shard(0)), (Shard(1), R), BF16_4K)
    assert (c.kind, c.mesh_axis, c.bytes) == ("all_gather", 1, S4K // 4)
    assert cm.redistribute_cost((Shard(1), Shard(0)), (Shard(1), R), BF16_4K) == pytest.approx(c.time_us)
    assert c.time_us == pytest.approx(17 + S4K / 4 * 7 / 8 / 390e3)


def test_partial_transitions() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    (c,) = cm.redistribute_collectives((R, Partial()), (R, Shard(0)), BF16_4K)
    assert (c.kind, c.mesh_axis, c.bytes) == ("reduce_scatter", 1, S4K)
    (c,) = cm.redistribute_collectives((Partial(), R), (R, R), BF16_4K)
    assert (c.kind, c.mesh_axis, c.axis_name, c.bytes) == ("all_reduce", 0, "dp", S4K)
    (c,) = cm.redistribute_collectives((R, Partial("sum")), (R, Partial("avg")), BF16_4K)
    assert c.kind == "all_reduce"


def test_shard_to_shard_is_all_to_all() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    (c,) = cm.redistribute_collectives((R, Shard(0)), (R, Shard(1)), BF16_4K)
    assert (c.kind, c.mesh_axis, c.bytes) == ("all_to_all", 1, S4K // 8)


def test_replicate_to_partial_not_allowed() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    assert cm.redistribute_cost((R, R), (R, Partial()), BF16_4K) == math.inf
    assert cm.redistribute_cost((Shard(0), R), (Partial(), R), BF16_4K) == math.inf
    with pytest.raises(RedistributionNotAllowed, match="'tp'"):
        cm.redistribute_collectives((R, R), (R, Partial()), BF16_4K)


def test_equal_and_replicate_to_shard_are_free() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    assert cm.redistribute_cost((Shard(0), Partial()), (Shard(0), Partial()), BF16_4K) == 0.0
    assert cm.redistribute_collectives((Shard(0), Partial()), (Shard(0), Partial()), BF16_4K) == []
    (c,) = cm.redistribute_collectives((R, R), (R, Shard(0)), BF16_4K)
    assert c.kind == "local" and c.time_us == 0.0 and c.bytes == S4K // 8


def test_2d_decomposition() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    # FSDP+TP weight: gathered on dp, kept sharded on tp → one inter-node all-gather of S/8
    cs = cm.redistribute_collectives((Shard(0), Shard(1)), (R, Shard(1)), BF16_4K)
    assert [(c.kind, c.axis_name, c.bytes) for c in cs] == [("all_gather", "dp", S4K // 8)]
    # fully sharded → replicated: inner axis first (S/4), then outer (S)
    cs = cm.redistribute_collectives((Shard(0), Shard(1)), (R, R), BF16_4K)
    assert [(c.kind, c.axis_name, c.bytes) for c in cs] == [("all_gather", "tp", S4K // 4), ("all_gather", "dp", S4K)]
    # gradient: Partial on both → Shard on dp (reduce-scatter full S) then all-reduce S/4 on tp
    cs = cm.redistribute_collectives((Partial(), Partial()), (Shard(0), R), BF16_4K)
    assert [(c.kind, c.axis_name, c.bytes) for c in cs] == [("reduce_scatter", "dp", S4K),
                                                            ("all_reduce", "tp", S4K // 4)]
    # nested shard on the same dim must be undone inner → outer, then re-sharded locally
    cs = cm.redistribute_collectives((Shard(0), Shard(0)), (R, Shard(0)), BF16_4K)
    assert [(c.kind, c.axis_name, c.bytes) for c in cs] == [
        ("all_gather", "tp", S4K // 4), ("all_gather", "dp", S4K), ("local", "tp", S4K // 8)]
    total = cm.redistribute_cost((Shard(0), Shard(0)), (R, Shard(0)), BF16_4K)
    assert total == pytest.approx(sum(c.time_us for c in cs))


def test_strided_shard_counts_as_shard() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    cs = cm.redistribute_collectives((_StridedShard(0, split_factor=8), Shard(0)), (R, R), BF16_4K)
    assert [(c.kind, c.axis_name, c.bytes) for c in cs] == [("all_gather", "tp", S4K // 4), ("all_gather", "dp", S4K)]


def test_uneven_and_negative_dims() -> None:
    cm = CostModel("h100", (8,))
    (c,) = cm.redistribute_collectives((Shard(-1),), (R,), ((10, 10), torch.float32))
    assert c.bytes == 400
    (c,) = cm.redistribute_collectives((Shard(0),), (Shard(1),), ((10, 16), torch.float32))
    assert c.bytes == 2 * 16 * 4  # ceil(10/8) rows per rank


def test_summary_breakdown() -> None:
    cm = CostModel("h100", (4, 8), ("dp", "tp"))
    cs = cm.redistribute_collectives((Shard(0), Shard(1)), (R, R), BF16_4K)
    cs += cm.redistribute_collectives((R, Shard(0)), (R, R), BF16_4K)
    summ = summarize_collectives(cs)
    assert summ[("all_gather", "tp")]["count"] == 2
    assert summ[("all_gather", "tp")]["bytes"] == S4K // 4 + S4K
    assert summ[("all_gather", "dp")]["time_us"] == pytest.approx(cs[1].time_us)
    assert cm.summarize(cs) == summ


def test_specs_and_tensor_meta_from_torch() -> None:
    """DTensorSpec / TensorMeta inputs, and agreement with DTensor's own plan."""
    # DTensor's own redistribution plan (private; tests may read torch internals directly)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached as gen

    from parallel import _torch

    with _torch.fake_world(32):
        mesh = init_device_mesh("cpu", (4, 8), mesh_dim_names=("dp", "tp"))
        tm = _torch.TensorMeta(torch.Size((64, 48, 16)), (768, 16, 1), torch.bfloat16)
        cm = CostModel.from_mesh("h100", mesh)
        assert cm.mesh_shape == (4, 8) and cm.mesh_axis_names == ("dp", "tp")

        def spec(pl):
            return _torch.DTensorSpec(mesh, tuple(pl), tensor_meta=tm)

        src, dst = spec((Shard(0), Shard(1))), spec((R, R))
        assert cm.redistribute_cost(src, dst) == cm.redistribute_cost(src.placements, dst.placements, tm)
        assert cm.redistribute_cost(src, dst, (tm.shape, tm.dtype)) > 0

        choices = [R, Partial(), Shard(0), Shard(1), Shard(2)]
        pairs = list(itertools.product(itertools.product(choices, repeat=2), repeat=2))
        random.Random(0).shuffle(pairs)
        def letter(p) -> str:
            return "S" if shard_dim(p) is not None else ("P" if p.is_partial() else "R")

        kind_of = {("S", "R"): "all_gather", ("S", "S"): "all_to_all", ("P", "R"): "all_reduce",
                   ("P", "S"): "reduce_scatter", ("R", "S"): "local"}
        checked = 0
        for a, b in pairs[:300]:
            if math.isinf(cm.redistribute_cost(a, b, tm)):
                continue  # → Partial: we refuse (torch allows R → P by zeroing)
            infos = gen(spec(a), spec(b))
            theirs = [(i.mesh_dim, kind_of[letter(i.src_dst_placements[0]), letter(i.src_dst_placements[1])])
                      for i in infos]
            ours = [(c.mesh_axis, c.kind) for c in cm.redistribute_collectives(a, b, tm)]
            assert ours == theirs, (a, b)
            checked += 1
        assert checked > 50


# ------------------------------------------------------------------ compute
def test_matmul_bf16_vs_fp32_peak_ratio() -> None:
    cm = CostModel("h100", (4, 8))
    mm = torch.ops.aten.mm.default
    args = lambda dt: [((8192, 4096), dt), ((4096, 4096), dt)]  # noqa: E731
    hw = cm.hw
    t16 = cm.compute_cost(mm, args(torch.bfloat16)) - hw.kernel_floor_us
    t32 = cm.compute_cost(mm, args(torch.float32)) - hw.kernel_floor_us
    flops = 2 * 8192 * 4096 * 4096
    assert t16 == pytest.approx(flops / (989e12 * 0.78) * 1e6)
    assert t32 / t16 == pytest.approx(989 / 67)
    # mixed precision: the planner says compute is bf16
    assert (cm.compute_cost(mm, args(torch.float32), compute_dtype=torch.bfloat16)
            == pytest.approx(t16 + hw.kernel_floor_us))
    # given flops are used as is
    assert cm.compute_cost(mm, args(torch.bfloat16), flops=0.0) < t16


def test_small_elementwise_is_memory_bound_and_floored() -> None:
    cm = CostModel("h100", (8,))
    add = torch.ops.aten.add.Tensor
    tiny = cm.compute_cost(add, [((16,), torch.float32), ((16,), torch.float32)])
    assert tiny >= cm.hw.kernel_floor_us and tiny == pytest.approx(cm.hw.kernel_floor_us, abs=0.01)
    n = 1 << 26
    big = cm.compute_cost(add, [((n,), torch.bfloat16), ((n,), torch.bfloat16)])
    assert big == pytest.approx(3 * n * 2 / (3350e9 * 0.8) * 1e6 + 5.0)


def test_views_are_free_and_fx_nodes() -> None:
    cm = CostModel("h100", (8,))
    assert cm.compute_cost(torch.ops.aten.view.default, [((4, 8), torch.float32), [32]]) == 0.0
    assert cm.compute_cost(torch.ops.aten.t.default, [((4, 8), torch.float32)]) == 0.0

    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return torch.relu(x @ w).view(-1)

    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        gm = make_fx(f)(torch.empty(64, 32), torch.empty(32, 16))
    costs = {n.name: cm.compute_cost(n) for n in gm.graph.nodes}
    assert costs["x_1"] == 0.0 and costs["output"] == 0.0 and costs["view"] == 0.0
    assert costs["mm"] > 0 and costs["relu"] > 0
    # local shapes given explicitly (a shard of x) are cheaper than the global node
    mm = next(n for n in gm.graph.nodes if n.name == "mm")
    assert cm.compute_cost(mm, [((8, 32), torch.float32), ((32, 16), torch.float32)]) <= costs["mm"]
    del mode


def test_attention_flops_cpu_kernel_and_cache() -> None:
    cm = CostModel("h100", (8,))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = ((2, 32, 4096, 128), torch.bfloat16)
    t = cm.compute_cost(op, [q, q, q, 0.0, True])
    flops = 4 * 2 * 32 * 4096 * 4096 * 128  # torch's count; the causal kernel runs half of it
    assert t == pytest.approx(flops / 2 / (989e12 * 0.35) * 1e6 + 5.0, rel=1e-6)  # h100's attention efficiency
    # the CUDA kernels a GPU job's step graph runs are priced alike
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert cm.compute_cost(flash, [q, q, q, 0.0, True]) == pytest.approx(t, rel=1e-6)
    assert cm.compute_cost(op, [q, q, q, 0.0, False]) == pytest.approx(flops / (989e12 * 0.35) * 1e6 + 5.0, rel=1e-6)
    n = len(cm.flop_cache)
    cm.compute_cost(op, [q, q, q, 0.0, True])
    assert len(cm.flop_cache) == n


def test_cpu_profile_collectives_are_slow() -> None:
    cm = CostModel("cpu", (2,))
    assert cm.collective_cost("all_gather", 1024, 0) > 1000  # gloo: milliseconds


def test_pluggable_cost_model_subclass() -> None:
    class Flat(CostModel):
        def redistribute_cost(self, src, dst, tensor_meta=None) -> float:
            return 1.0

    cm = Flat(load_hardware("a100"), (2, 8))
    assert cm.redistribute_cost((R, R), (R, Shard(0)), BF16_4K) == 1.0
    assert isinstance(cm.project(1), Flat) and cm.project(1).links[0].size == 8
    assert cm.project(0).links[0].intra_node is False


def test_profile_from_dict_minimal() -> None:
    d = {
        "name": "toy", "gpus_per_node": 2, "memory_gib": 1, "memory_bandwidth_gbps": 10,
        "kernel_floor_us": 1, "peak_tflops": {"fp32": 1}, "efficiency": {"matmul": 1, "memory": 1},
        "intra_node": {"bus_bandwidth_gbps": 10, "latency_us": 1, "hop_latency_us": 0},
        "inter_node": {"bandwidth_gbps": 1, "latency_us": 10, "hop_latency_us": 1},
    }
    hw = profile_from_dict(d)
    assert hw.peak_flops(torch.bfloat16) == 1e12  # falls back to fp32
    assert hw.intra_node.bus_bandwidth_gbps["all_to_all"] == 10
    with pytest.raises(ProfileError, match="missing required key 'fp32'"):
        profile_from_dict({**d, "peak_tflops": {"bf16": 1}})
    with pytest.raises(ProfileError, match="matmul = 1.5 must be <= 1"):
        profile_from_dict({**d, "efficiency": {"matmul": 1.5, "memory": 1}})
    assert isinstance(Collective("local", 0, "a", 0, 0.0), Collective)


def test_strategy_compute_cost_uses_local_shapes() -> None:
    """mm under (Shard(0) x Replicate -> Shard(0)) on 8 ranks costs 1/8 of the FLOPs;
    a contraction-dim split (Shard(1) x Shard(0) -> Partial) too."""
    from types import SimpleNamespace as NS

    from torch.fx.experimental.proxy_tensor import make_fx

    with torch._subclasses.fake_tensor.FakeTensorMode():
        gm = make_fx(lambda x, w: x @ w)(torch.empty(8192, 4096, dtype=torch.bfloat16),
                                        torch.empty(4096, 4096, dtype=torch.bfloat16))
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    cm = CostModel("h100", (8,))

    def spec(p, shape):
        return NS(placements=(p,), tensor_meta=NS(shape=torch.Size(shape), dtype=torch.bfloat16))

    x, w, y = (8192, 4096), (4096, 4096), (8192, 4096)
    rep = NS(input_specs=[spec(R, x), spec(R, w)], output_specs=spec(R, y))
    dp = NS(input_specs=[spec(Shard(0), x), spec(R, w)], output_specs=spec(Shard(0), y))
    k = NS(input_specs=[spec(Shard(1), x), spec(Shard(0), w)], output_specs=spec(Partial(), y))
    floor = cm.hw.kernel_floor_us
    t_rep, t_dp, t_k = (cm.strategy_compute_cost(mm, s) - floor for s in (rep, dp, k))
    assert t_rep == pytest.approx(2 * 8192 * 4096 * 4096 / (989e12 * 0.78) * 1e6)
    assert t_dp == pytest.approx(t_rep / 8) and t_k == pytest.approx(t_rep / 8)
    assert cm.local_shape(x, (Shard(1),)) == (8192, 512)
