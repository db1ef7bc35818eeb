"""Edge pricing in arrays (cost/comm_matrix.py) equals the per-pair walk, bit for bit."""

import itertools
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from parallel.auto.cost import CostModel
from parallel.auto.cost.comm import placement_ids
from parallel.auto.problem.pricing import ACTIVATION, EdgeRole, StrategyPricer

PLACEMENTS = [Replicate(), Partial(), Partial("avg"), Shard(0), Shard(1), Shard(2)]


def _sample(mesh_ndim: int, n: int, seed: int) -> list[tuple]:
    every = list(itertools.product(PLACEMENTS, repeat=mesh_ndim))
    return random.Random(seed).sample(every, min(n, len(every)))


@pytest.mark.parametrize("mesh,shape,scale", [
    ((2, 2, 2, 4), (8, 8192, 4096), 1.0),
    ((2, 2, 2, 4), (3, 5, 7), 0.25),  # uneven shards, every dim
    ((8, 4, 2), (1, 8192, 128256), 1.0),  # inter-node outer axes
    ((4, 8), (2, 1, 4096), 0.5),  # tree all-reduce across nodes; local size 1 before a gathered dim
    ((8,), (4096, 14336), 1.0),
])
def test_matrix_equals_pairs(mesh, shape, scale):
    cm = CostModel("h100", mesh)
    src = _sample(len(mesh), 60, 1)
    dst = _sample(len(mesh), 50, 2)
    s_ids = np.array([placement_ids(p, len(shape)) for p in src])
    d_ids = np.array([placement_ids(p, len(shape)) for p in dst])
    got = cm.redistribute_cost_matrix(s_ids, d_ids, shape, 2, scale)
    want = np.array([[cm.redistribute_cost_ids(tuple(a), tuple(b), shape, 2, scale) for b in d_ids]
                     for a in s_ids])
    assert got.shape == (len(src), len(dst))
    assert np.isinf(want).any() and (want > 0).any() and (want == 0).any()  # the sample covers all three
    assert np.array_equal(got, want)  # exact, inf where refused
    # and the public per-placement API agrees (it prices unbucketed: latency scale 1)
    whole = cm.redistribute_cost_matrix(s_ids, d_ids, shape, 2)
    for a, b in [(0, 0), (len(src) // 2, len(dst) // 3), (len(src) - 1, len(dst) - 1)]:
        assert whole[a, b] == cm.redistribute_cost(src[a], dst[b], (shape, torch.bfloat16))


@pytest.mark.parametrize("role", [ACTIVATION, EdgeRole("param", 4, 2), EdgeRole("grad", 3)])
def test_pricer_matrix_path_equals_loop(role, monkeypatch):
    """StrategyPricer.redistribution: arrays from 64 pairs on, the per-pair loop below."""
    from parallel.auto.cost.model import RuntimeSchedule
    from parallel.auto.problem import pricing

    class _Cands:
        class mesh:
            shape = (2, 2, 2, 4)

    cm = CostModel("h100", (2, 2, 2, 4), schedule=RuntimeSchedule(bucket=True, reduce_dtype=torch.float32))
    src = _sample(4, 30, 3) + [(Partial(),) * 4]
    dst = _sample(4, 25, 4) + [(Replicate(),) * 4, (Shard(0),) * 4]
    shape = (4096, 1024)
    arrays = StrategyPricer(_Cands, cm, torch.bfloat16).redistribution(shape, torch.float32, src, dst, role)
    monkeypatch.setattr(pricing, "MATRIX_PAIRS", 10 ** 9)
    loop = StrategyPricer(_Cands, cm, torch.bfloat16).redistribution(shape, torch.float32, src, dst, role)
    assert np.array_equal(arrays, loop)
    if role.kind != "act":  # the bucketed terms were taken on some pairs, not others
        plain = StrategyPricer(_Cands, cm, torch.bfloat16).redistribution(shape, torch.float32, src, dst, ACTIVATION)
        assert not np.array_equal(arrays, plain)


def test_pricer_keeps_a_model_that_prices_pairs_its_own_way():
    """A cost model overriding the per-pair price is asked pair by pair, never replayed in arrays."""

    class _Cands:
        class mesh:
            shape = (2, 4)

    class Doubled(CostModel):
        def redistribute_cost_ids(self, src, dst, shape, itemsize, latency_scale=1.0):
            return 2 * super().redistribute_cost_ids(src, dst, shape, itemsize, latency_scale)

    src, dst = _sample(2, 20, 5), _sample(2, 20, 6)
    shape = (4096, 1024)
    plain = StrategyPricer(_Cands, CostModel("h100", (2, 4)), None).redistribution(shape, torch.float32, src, dst)
    doubled = StrategyPricer(_Cands, Doubled("h100", (2, 4)), None).redistribution(shape, torch.float32, src, dst)
    assert len(src) * len(dst) >= 64 and (plain > 0).any()
    assert np.array_equal(doubled, 2 * plain)
