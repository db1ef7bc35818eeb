"""The cost model prices the runtime's schedule: bucketed latency, overlapped collectives,
gathers repeated in the backward, reductions in the reduce dtype; the step-graph simulation
of exposed communication; calibration's fit and cache."""

from __future__ import annotations

import math
import socket

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from models import build_model
from parallel import _torch as T
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.cost import CostModel, RuntimeSchedule
from parallel.auto.cost.calibrate import cache_path, fit_link
from parallel.auto.cost.comm import collective_time
from parallel.auto.cost.simulate import simulate_step
from parallel.auto.problem.pricing import EdgeRole, StrategyPricer
from parallel.auto.runtime.schedule import schedule_overlap


def test_bucketed_collective_pays_its_share_of_the_latency():
    link = CostModel("cpu", (4,), ("dp",)).links[0]
    alone = collective_time("all_gather", 1 << 20, link)[0]
    shared = collective_time("all_gather", 1 << 20, link, latency_scale=1 / 8)[0]
    latency = link.latency_us + 3 * link.hop_latency_us
    assert alone - shared == pytest.approx(latency * (1 - 1 / 8))


def _pricer(schedule: RuntimeSchedule, mp: torch.dtype | None = None) -> StrategyPricer:
    model = build_model("llama3", "debug", device="meta", n_layers=1)
    tok = torch.zeros(8, 64, dtype=torch.long)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss, planner=PlannerConfig(hardware="cpu")) as autop:
            cands = autop.candidates
            cm = CostModel("cpu", (4,), ("dp",), schedule=schedule, compute_dtype=mp)
            return StrategyPricer(cands, cm, mp)


def test_edge_roles_price_what_the_runtime_does():
    shape, src, dst = (256, 256), [(Shard(0),)], [(Replicate(),)]
    plain = _pricer(RuntimeSchedule(bucket=False, overlap=False))
    act = float(plain.redistribution(shape, torch.float32, src, dst)[0, 0])
    assert float(plain.redistribution(shape, torch.float32, src, dst, EdgeRole("param", 7))[0, 0]) == act
    sched = RuntimeSchedule(bucket=True, overlap=True)
    pricer = _pricer(sched)
    share = sched.overlapped_share(pricer.cm.hw.comm_overlap)
    link = pricer.cm.links[0]
    bucketed = collective_time("all_gather", 256 * 256 * 4, link, latency_scale=1 / 7)[0]
    param = float(pricer.redistribution(shape, torch.float32, src, dst, EdgeRole("param", 7))[0, 0])
    assert param == pytest.approx(bucketed * share) and param < act
    twice = float(pricer.redistribution(shape, torch.float32, src, dst, EdgeRole("param", 7, repeat=2))[0, 0])
    assert twice == pytest.approx(2 * param)  # gathered again in the backward (reshard after forward)
    # gradients are reduced in the reduce dtype (fp32) though they are computed in bf16
    mixed = _pricer(RuntimeSchedule(bucket=False, overlap=False, reduce_dtype=torch.float32), torch.bfloat16)
    grad = float(mixed.redistribution(shape, torch.float32, [(Partial(),)], [(Shard(0),)], EdgeRole("grad"))[0, 0])
    act16 = float(mixed.redistribution(shape, torch.float32, [(Partial(),)], [(Shard(0),)])[0, 0])
    assert grad > act16  # twice the bytes on the wire


def test_simulation_charges_only_the_communication_compute_does_not_hide():
    """One all-gather started before a matmul and waited for after it (the runtime's overlap
    pass puts its wait there): the exposed part is its time minus the matmul's (the profile
    hides all of it behind compute: overlap 1)."""
    from torch.distributed import _functional_collectives as funcol

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        group = mesh.get_group(0).group_name

        def step(x, w):
            gathered = funcol.all_gather_single(w, 0, (mesh, 0))
            y = x @ x
            return y, gathered + 1

        with T.FakeTensorMode():
            gm = make_fx(step, tracing_mode="fake")(torch.randn(512, 512), torch.randn(1 << 18))
        schedule_overlap(gm)  # the runtime's pass: the wait moves past the matmul, to the add
        cm = CostModel("h100", (2,), ("dp",))
        cm.hw = cm.hw.replace(comm_overlap=1.0)
        pred = simulate_step(gm, cm, {group: cm.links[0]})
    mm = next(n for n in gm.graph.nodes if n.op == "call_function" and T.op_name(n.target) == "mm")
    t_mm = cm.compute_cost(mm)
    assert pred.comm_us > 0 and pred.collectives
    assert pred.exposed_comm_us == pytest.approx(max(0.0, pred.comm_us - t_mm), rel=1e-6, abs=1e-6)
    assert pred.step_us >= pred.compute_us


def test_the_functional_all_reduce_pays_its_input_copy_on_the_cores():
    """torch's functional all-reduce clones its input before reducing it in place: a
    memory-bound copy of its bytes on the compute lane, at the elementwise bandwidth."""
    from torch.distributed import _functional_collectives as funcol

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        group = mesh.get_group(0).group_name
        with T.FakeTensorMode():
            gm = make_fx(lambda g: funcol.all_reduce(g, "sum", (mesh, 0)) + 0, tracing_mode="fake")(
                torch.randn(1 << 18))
        cm = CostModel("cpu", (2,), ("dp",))
        cm.hw = cm.hw.replace(op_bandwidth_gbps={"elementwise": 4.0})
        pred = simulate_step(gm, cm, {group: cm.links[0]})
    add = next(n for n in gm.graph.nodes if n.op == "call_function" and T.op_name(n.target) == "add")
    copy = 2 * (1 << 20) / 4e9 * 1e6 + cm.hw.kernel_floor_us
    assert pred.collectives and pred.compute_us == pytest.approx(cm.compute_cost(add) + copy, rel=1e-6)


def test_calibration_fits_and_caches_by_host_world_and_torch(tmp_path, monkeypatch):
    lat, bw = 300e-6, 2e9  # seconds, bytes/s on the bus
    n = 4
    res = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        mult = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        for size in (1 << 14, 1 << 19, 1 << 22):
            res[(kind, size)] = lat + size * mult / bw
    bws, latency = fit_link(res, n)
    assert latency == pytest.approx(lat * 1e6, rel=1e-6)
    assert all(v == pytest.approx(bw / 1e9, rel=1e-6) for v in bws.values())
    monkeypatch.delenv("AUTOTITAN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cache_path(4)
    assert path.parent == tmp_path / "autotitan" / "hardware"
    assert path.name.startswith(socket.gethostname()) and "-w4-" in path.name
    assert torch.__version__.split("+")[0] in path.name and not math.isnan(latency)
