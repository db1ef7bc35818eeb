"""The plan's strategy handed to DTensor (`T.planned_strategy`, runtime/interpreter.py): an op
whose inputs are at the plan's placements is propagated with that strategy alone, so DTensor
does not expand and price every strategy over the mesh (0.7 s an op on a 4-D mesh), and the
step graph and its memory estimate are what DTensor's own choice gives."""

from __future__ import annotations

import pytest
import torch
from test_repeated_blocks_runtime import _form
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from models import build_model
from parallel import _torch as T
from parallel.auto.api import AutoParallel, fake_world, lm_loss
from parallel.auto.config import PlannerConfig
from parallel.auto.runtime import RuntimeOptions
from parallel.auto.runtime.interpreter import PlacementOps
from parallel.auto.runtime.memory import step_memory, trace_step

pytestmark = pytest.mark.slow


class _ExpansionCount:
    """Counts DTensor propagations that expand an op's per-axis strategies over the mesh."""

    def __enter__(self):
        import torch.distributed.tensor._sharding_prop as sharding_prop

        self.module, self.count = sharding_prop, 0
        original = self.original = sharding_prop._expand_single_dim_strategy_to_mesh

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        T.clear_sharding_caches()  # DTensor's Python and C++ caches: every op propagated afresh
        sharding_prop._expand_single_dim_strategy_to_mesh = counted
        return self

    def __exit__(self, *exc):
        self.module._expand_single_dim_strategy_to_mesh = self.original
        T.clear_sharding_caches()


def test_step_graph_with_the_planned_strategies_is_dtensors_own():
    model = build_model("llama3", "debug", device="meta", n_layers=3)
    tok = torch.zeros(8, 64, dtype=torch.long)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with AutoParallel(model, (tok, tok), mesh, loss_fn=lm_loss,
                          planner=PlannerConfig(hardware="h100", memory_estimate=False)) as autop:
            plan = autop.optimize_placement(verbose=False)
            out = []
            for planned in (True, False):
                PlacementOps.planned_strategies = planned
                try:
                    with _ExpansionCount() as expansions:
                        step = trace_step(autop.graph, autop.candidates, plan, mesh, options=RuntimeOptions())
                finally:
                    PlacementOps.planned_strategies = True
                out.append((step, step_memory(step, mesh), expansions.count))
    (planned, est, n_planned), (own, own_est, n_own) = out
    assert n_own > 20 and n_planned < n_own / 4, (n_planned, n_own)
    a, b = _form(planned.step_graph.gm), _form(own.step_graph.gm)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    assert len(a) == len(b) and first is None, (first, a[first] if first is not None else None)
    assert planned.runner.stats["deviations"] == own.runner.stats["deviations"] == 0
    assert est.peak_bytes == own_est.peak_bytes


def test_a_planned_strategy_is_what_dtensor_runs():
    """A matmul offered one strategy runs that one, even where DTensor would pick another:
    (Shard(0), Replicate) x (Replicate, Shard(1)) on a 2-D mesh planned replicated is gathered
    and multiplied whole (DTensor's own choice: no communication, a (Shard(0), Shard(1)) output)."""
    mm = torch.ops.aten.mm.default
    prop = T.sharding_propagator()
    before = (prop.op_single_dim_strategy_funcs.get(mm), prop.op_strategy_funcs.get(mm))
    rep = (Replicate(), Replicate())
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        with T.FakeTensorMode():
            x = DTensor.from_local(torch.empty(4, 16), mesh, [Shard(0), Replicate()], run_check=False)
            w = DTensor.from_local(torch.empty(16, 6), mesh, [Replicate(), Shard(1)], run_check=False)
            assert tuple(mm(x, w).placements) == (Shard(0), Shard(1))  # DTensor's own choice
            meta = T.TensorMeta(torch.Size((8, 12)), (12, 1), torch.float32)
            spec = T.OpSpec(T.DTensorSpec(mesh, rep, tensor_meta=meta),
                            input_specs=[T.DTensorSpec(mesh, rep), T.DTensorSpec(mesh, rep)])
            T.clear_sharding_caches()
            with T.planned_strategy(mm, spec):
                out = mm(x, w)
            T.clear_sharding_caches()
            assert tuple(out.placements) == rep
            assert tuple(out.to_local().shape) == (8, 12)
    assert (prop.op_single_dim_strategy_funcs.get(mm), prop.op_strategy_funcs.get(mm)) == before  # restored
