"""A toy model with one local_map region (regions/), for test_regions.py: planned on
a fake world in the parent, run on gloo ranks eagerly and compiled, compared with 1 rank."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard

from parallel.auto.regions import Option, Region, declare

B, S, D = 4, 8, 8


def gate(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _doubled(ctx, x: torch.Tensor) -> torch.Tensor:
    """A wrong local function: it returns twice the rows its option declares."""
    return torch.cat([gate(x), gate(x)], dim=0)


GOOD = declare(Region("toy_gate", [Option("batch", (Shard(0),), (Shard(0),)),
                                   Option("features", (Shard(2),), (Shard(2),))], fn=gate))
BAD = declare(Region("toy_bad", [Option("batch", (Shard(0),), (Shard(0),))], fn=gate, local_fn=_doubled))


class Gate(nn.Module):
    local_map_region = "toy_gate"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gate(x)


class BadGate(Gate):
    local_map_region = "toy_bad"


class Toy(nn.Module):
    """x -> w1 -> gate region -> w2 -> squared error against y."""

    def __init__(self, bad: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, D, bias=False)
        self.gate = BadGate() if bad else Gate()
        self.w2 = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.w2(self.gate(self.w1(x))) - y) ** 2).mean()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)


def full_model(bad: bool = False) -> Toy:
    torch.manual_seed(0)
    return Toy(bad)


def reference() -> dict:
    m = full_model()
    loss = m(*data())
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in m.named_parameters()}}


def autop_for(mesh, bad: bool = False, regions=None):
    from parallel.auto.api import AutoParallel
    from parallel.auto.config import PlannerConfig

    with torch.device("meta"):
        model = Toy(bad)
    x = torch.empty(B, S, D, device="meta")
    names = ("toy_bad",) if bad else ("toy_gate",)
    return AutoParallel(model, (x, x), mesh, regions=names if regions is None else regions,
                        planner=PlannerConfig(hardware="cpu"))


def make_plan(bad: bool = False) -> tuple[dict, dict]:
    """Plan on a fake 2-rank world with the data sharded on the batch; returns the plan JSON
    and the region nodes' (output, inputs) placements."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.api import fake_world

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with autop_for(mesh, bad) as autop:
            autop.add_input_constraints([(Shard(0),), (Shard(0),)])
            plan = autop.optimize_placement(verbose=False)
    regions = {n.name: (n.output_placements, n.input_placements) for n in plan.nodes.values()
               if "toy_" in str(n.target)}
    return plan.to_json(), regions


def worker(rank: int, world_size: int, plan_json: dict, bad_json: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.auto.plan import Plan
    from parallel.auto.runtime import RuntimeOptions, local_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    x, y = data()
    out: dict = {}
    for compiled in (False, True):
        with autop_for(mesh) as autop:
            pm = autop.apply_placement(Plan.from_json(plan_json), RuntimeOptions(compile=compiled))
        pm.to_empty(device="cpu")
        pm.load_full_weights(full_model())
        pl = pm.plan_runner.input_placements(0)
        loss = pm.forward_backward(local_shard(x, mesh, pl), local_shard(y, mesh, pl))
        out["compiled" if compiled else "eager"] = {
            "loss": loss.item(), "grads": {n: p.grad.full_tensor() for n, p in pm.named_parameters()}}
    with autop_for(mesh, bad=True) as autop:
        pm = autop.apply_placement(Plan.from_json(bad_json))
    pm.to_empty(device="cpu")
    pm.load_full_weights(full_model(bad=True))
    try:
        pm.forward_backward(local_shard(x, mesh, pl), local_shard(y, mesh, pl))
        out["bad_error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out["bad_error"] = f"{type(e).__name__}: {e}"
    return out
