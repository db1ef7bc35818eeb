"""Context-parallel attention on 2 gloo ranks equals single-device causal SDPA (fwd + grads)."""

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh

from parallel.mesh import CP
from parallel.recipes import RecipeError
from parallel.recipes.cp import context_parallel_attention, cp_positions, shard_sequence, unshard_sequence, validate_cp


def _ref(B=2, H=4, S=16, D=8):
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(B, H, S, D, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(go)
    return q, k, v, go, out


def _cp_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(CP,))
    q, k, v, go, _ = _ref()
    res = {}
    for load_balance in (True, False):
        loc = [shard_sequence(t.detach(), rank, world, dim=2, load_balance=load_balance).requires_grad_()
               for t in (q, k, v)]
        out = context_parallel_attention(*loc, mesh, CP, load_balance=load_balance)
        out.backward(shard_sequence(go, rank, world, dim=2, load_balance=load_balance))
        res[load_balance] = (out.detach(), [t.grad for t in loc])
    return res


_RES = []


def _results():
    if not _RES:
        _RES.append(run_distributed(_cp_worker, 2))
    return _RES[0]


def test_layout_roundtrip_and_positions():
    x = torch.arange(2 * 16).view(2, 16)
    shards = [shard_sequence(x, r, 2, 1) for r in range(2)]
    assert shards[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(unshard_sequence(shards, 1), x)
    assert cp_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(RecipeError, match="does not divide the sequence") as err:
        validate_cp(18, 2)
    assert err.value.key == "context_parallel_degree" and "seq_len = 18" in err.value.reason


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", [True, False])
def test_cp_attention_matches_single_device(load_balance):
    q, k, v, _, out_ref = _ref()
    res = [r[load_balance] for r in _results()]
    out = unshard_sequence([r[0] for r in res], dim=2, load_balance=load_balance)
    diffs = {"out": (out - out_ref).abs().max().item()}
    for i, (name, t) in enumerate(zip("qkv", (q, k, v))):
        g = unshard_sequence([r[1][i] for r in res], dim=2, load_balance=load_balance)
        diffs[f"d{name}"] = (g - t.grad).abs().max().item()
    print("CP2 max abs diffs:", diffs)
    assert max(diffs.values()) < 1e-5, diffs
