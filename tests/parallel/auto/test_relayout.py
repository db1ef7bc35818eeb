"""The local copy a gather or scatter of a dim other than 0 needs (cost/comm.py, Relayout),
checked against what DTensor itself runs: on a fake world of 4 ranks, DTensor's
redistribution is recorded op by op, and the cost model prices a copy exactly where DTensor
concatenates, of the bytes its `cat` writes; a shard of dim 0, or a gather whose leading
dims are 1 (a view), is priced without one."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.auto.api import fake_world
from parallel.auto.cost import CostModel, decompose_redistribution

N = 4
R = Replicate()


class _CopiesOf(TorchDispatchMode):
    """Bytes written by every `cat` (the only data-moving op of these redistributions)."""

    def __init__(self) -> None:
        super().__init__()
        self.cat_bytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default:
            self.cat_bytes.append(out.numel() * out.element_size())
        return out


def _dtensor_copies(local_shape: tuple, src, dst) -> list[int]:
    with fake_world(N):
        mesh = init_device_mesh("cpu", (N,))
        x = DTensor.from_local(torch.zeros(local_shape), mesh, [src], run_check=False)
        with _CopiesOf() as rec:
            x.redistribute(mesh, [dst]).to_local()
    return rec.cat_bytes


CASES = [  # (local shape on each rank, source, target)
    ((8, 4), Shard(1), R),  # a weight sharded on its input dim: gathered, then re-laid out
    ((1, 8, 4), Shard(1), R),  # batch 1, sequence shard: the gathered chunks are in place
    ((2, 16), Shard(0), R),
    ((8, 16), Partial(), Shard(1)),  # a gradient reduced onto dim 1: concatenated first
    ((1, 8, 16), Partial(), Shard(1)),  # a scatter concatenates whatever the leading dims
    ((8, 16), Partial(), Shard(0)),
]


@pytest.mark.parametrize("local_shape,src,dst", CASES, ids=[f"{s}-{a}-{b}" for s, a, b in CASES])
def test_a_copy_is_priced_where_dtensor_concatenates(local_shape, src, dst):
    observed = _dtensor_copies(local_shape, src, dst)
    shape = list(local_shape)
    if isinstance(src, Shard):
        shape[src.dim] *= N
    cm = CostModel("h100", (N,))
    meta = (tuple(shape), torch.float32)
    (step,) = decompose_redistribution((src,), (dst,), tuple(shape), 4, (N,))
    (coll,) = cm.redistribute_collectives((src,), (dst,), meta)
    total = cm.redistribute_cost((src,), (dst,), meta)
    assert observed == ([step.relayout_bytes] if step.relayout_bytes else []), (observed, step)
    assert total == pytest.approx(coll.time_us + cm.relayout_cost(step.relayout_bytes))
    if step.relayout_bytes:
        assert total > coll.time_us


def test_the_relayout_breaks_the_tie_between_shard_dims():
    """Gathering a weight sharded on dim 1 costs more than the same bytes sharded on dim 0,
    by the copy at the profile's memory roof (read and write)."""
    cm = CostModel("h100", (8,))
    meta = ((4096, 14336), torch.bfloat16)
    dim0 = cm.redistribute_cost((Shard(0),), (R,), meta)
    dim1 = cm.redistribute_cost((Shard(1),), (R,), meta)
    nbytes = 4096 * 14336 * 2
    hw = cm.hw
    assert dim1 - dim0 == pytest.approx(2 * nbytes / (hw.memory_bandwidth * hw.memory_efficiency) * 1e6)
