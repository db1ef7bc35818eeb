"""DeepSeek-V3 (tiny, with an MoE layer) in auto mode for test_moe_dispatch.py: planned on a
fake world in the parent (the MoE dispatch as the `moe_dispatch` region, optionally forced
expert-parallel on chosen mesh axes), replayed and trained on gloo ranks, compared with 1 rank."""

from __future__ import annotations

import torch
from apply_workers import _optimizer, batch, train_reference

import parallel.auto.regions.moe_dispatch as md
from parallel.auto import regions
from parallel.auto.cost.model import DEFAULT_ROUTING_IMBALANCE

TINY = {"dim": 64, "n_layers": 2, "n_dense_layers": 1, "n_heads": 4, "inter_dim": 128, "moe_inter_dim": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
GLOBAL_B, SEQ = 4, 16
REGIONS = (md.NAME,)


def build(device: str = "meta"):
    from models import build_model

    if device != "meta":
        torch.manual_seed(0)
    return build_model("deepseek_v3", "debug", device=device, **TINY)


def reference(steps: int) -> dict:
    """1 rank, plain model: losses per step and the step-0 gradients."""
    return train_reference(build("cpu"), steps)


def autop_for(mesh, solver: str = "auto", imbalance: float = DEFAULT_ROUTING_IMBALANCE,
              time_limit: float = 600.0):
    """The planner of the MoE model on `mesh`, the all-to-all priced at `imbalance`, each
    solver run limited to `time_limit` seconds."""
    from parallel.auto.api import AutoParallel, lm_loss
    from parallel.auto.config import PlannerConfig

    tok = torch.zeros(GLOBAL_B, SEQ, dtype=torch.long)
    # placements and numerics are asserted here, not the peak
    planner = PlannerConfig(hardware="cpu", solver=solver, memory_estimate=False, moe_imbalance_factor=imbalance,
                            time_limit=time_limit)
    return AutoParallel(build(), (tok, tok), mesh, loss_fn=lm_loss, regions=REGIONS, planner=planner)


def force_ep(autop, ep_axes: tuple[int, ...]) -> None:
    """Every moe_dispatch node (forward and backward) runs expert_parallel on `ep_axes`,
    dense_experts on the other axes (tokens batch-sharded everywhere)."""
    from torch.distributed.tensor import Replicate, Shard

    nd = autop.mesh.ndim
    tok, w = (Shard(0),) * nd, tuple(Shard(0) if i in ep_axes else Replicate() for i in range(nd))
    for n in autop.graph.gm.graph.nodes:
        hit = regions.region_of(n.target) if n.op == "call_function" else None
        if hit is None:
            continue
        ins = [tok, tok, tok, w, w, w]
        autop.add_node_constraint(n.name, tok, input_placements=[tok, *ins] if hit[1] else ins)


def make_plan(shape: tuple[int, ...], ep_axes: tuple[int, ...] | None, solver: str = "auto",
              imbalance: float = DEFAULT_ROUTING_IMBALANCE, time_limit: float = 600.0) -> tuple[dict, str]:
    """Plan on a fake world (data batch-sharded; `ep_axes` None = the free plan; the MoE
    all-to-all priced at `imbalance`; `time_limit`: seconds per solver run); returns the plan
    JSON and its summary."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from parallel.auto.api import fake_world

    names = ("dp", "tp")[: len(shape)]
    with fake_world(int(torch.tensor(shape).prod())):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with autop_for(mesh, solver, imbalance, time_limit) as autop:
            autop.add_input_constraints([(Shard(0),) * len(shape)] * 2)
            if ep_axes is not None:
                force_ep(autop, ep_axes)
            plan = autop.optimize_placement(verbose=False)
    return plan.to_json(), plan.summary()


def worker(rank: int, world_size: int, shape: tuple[int, ...], plan_json: dict, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import parallel.recipes.ep as ep
    from parallel.auto.plan import Plan
    from parallel.auto.runtime import local_shard

    calls, real = [0], ep._all_to_all

    def counted(*args):
        calls[0] += 1
        return real(*args)

    ep._all_to_all = counted  # counts the token all-to-alls of the expert-parallel dispatch
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[: len(shape)])
    with autop_for(mesh) as autop:
        pm = autop.apply_placement(Plan.from_json(plan_json))
    pm.to_empty(device="cpu")
    pm.load_full_weights(build("cpu"))
    runner, opt = pm.plan_runner, _optimizer(pm.parameters())
    losses, grads = [], {}
    for step in range(steps):
        tok, lab = batch(build().args.vocab_size, step)
        opt.zero_grad()
        loss = pm(*(local_shard(t, mesh, runner.input_placements(i)) for i, t in enumerate((tok, lab))))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in pm.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "all_to_alls": calls[0],
            "experts": {n: tuple(str(p) for p in q.placements) for n, q in pm.named_parameters() if ".experts." in n}}
