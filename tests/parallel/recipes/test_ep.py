"""Expert-parallel all-to-all dispatch on 2 gloo ranks equals single-device grouped experts."""

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh

from parallel.mesh import EP
from parallel.recipes import RecipeError
from parallel.recipes.ep import _regroup_index, expert_parallel_dispatch, validate_ep

E, D, H, T, K = 8, 16, 32, 10, 2


def grouped_swiglu(x, counts, w1, w2, w3):
    outs = []
    for i, xe in enumerate(x.split(counts.tolist(), dim=0)):
        outs.append((F.silu(xe @ w1[i].t()) * (xe @ w3[i].t())) @ w2[i].t())
    return torch.cat(outs, 0)


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, D, generator=g)
    # skewed routing, expert 5 never chosen
    probs = torch.tensor([8., 4, 2, 1, 1, 0, 3, 1])
    top = torch.stack([torch.multinomial(probs, K, generator=g) for _ in range(T)])
    flat = top.reshape(-1)
    order = flat.argsort(stable=True)
    x_sorted = x.repeat_interleave(K, 0)[order]
    counts = torch.bincount(flat, minlength=E)
    return x_sorted, counts


def _weights():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(E, H, D, generator=g) * 0.2, torch.randn(E, D, H, generator=g) * 0.2,
            torch.randn(E, H, D, generator=g) * 0.2]


def _ep_worker(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(EP,))
    x, counts = _data(rank)
    x.requires_grad_()
    e_loc = E // world
    ws = [w[rank * e_loc:(rank + 1) * e_loc].clone().requires_grad_() for w in _weights()]
    y = expert_parallel_dispatch(x, counts, lambda xl, c: grouped_swiglu(xl, c, *ws), mesh, EP)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, [w.grad for w in ws]


def test_regroup_index_and_validation():
    counts = torch.tensor([[1, 2], [3, 0]])  # src0: e0 x1, e1 x2 ; src1: e0 x3
    assert _regroup_index(counts).tolist() == [0, 3, 4, 5, 1, 2]
    with pytest.raises(RecipeError, match="does not divide the number of routed experts") as err:
        validate_ep(6, 4)
    assert err.value.key == "expert_parallel_degree" and err.value.value == 4


@pytest.mark.slow
def test_ep_dispatch_matches_single_device():
    world = 2
    res = run_distributed(_ep_worker, world)
    ws = [w.clone().requires_grad_() for w in _weights()]
    diffs = {}
    for r in range(world):
        x, counts = _data(r)
        x.requires_grad_()
        y = grouped_swiglu(x, counts, *ws)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        diffs[f"y{r}"] = (y.detach() - res[r][0]).abs().max().item()
        diffs[f"dx{r}"] = (x.grad - res[r][1]).abs().max().item()
    for i, w in enumerate(ws):
        full = torch.cat([res[r][2][i] for r in range(world)], 0)
        diffs[f"dw{i + 1}"] = (full - w.grad).abs().max().item()
    print("EP2 max abs diffs:", diffs)
    assert max(diffs.values()) < 1e-5, diffs
