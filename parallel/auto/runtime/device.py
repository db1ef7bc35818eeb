"""Where the runtime's values live: the job's device, decided once, from the mesh.

Every graph the runtime builds — the forward and backward phases of the joint graph, the
step graph, the local graphs — holds or creates tensors of its own: lifted constants,
factory ops (`zeros`, `arange`, `full`, `scalar_tensor`), tangents. One host tensor in a
CUDA graph breaks the step (a CPU kernel's error, or a host copy per step), so the runtime
creates all of them on `runtime_device(mesh)`, and `off_device` lists whatever is not
there: the check the dry run and the tests make on every per-rank graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh

from parallel import _torch as T


def runtime_device(mesh: DeviceMesh) -> torch.device:
    """The device of every value the runtime creates: the mesh's (the trainer built the mesh
    on the job's device, trainer/device.py). On CUDA, torch's current device: the rank's GPU."""
    return torch.device(mesh.device_type)


def place_on_device(gm: fx.GraphModule, device: torch.device, traced_device: str) -> int:
    """Move `gm`'s lifted constants (get_attr) to `device`; when the graph was traced on
    another device type (`traced_device`, see T.autograd_device), point its factory ops'
    `device=` at `device` too. Returns how many were moved. The graph is interpreted node
    by node (its Python code is not regenerated)."""
    moved = 0
    for n in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, n.target)
        if isinstance(value, torch.Tensor) and value.device.type != device.type:
            setattr(gm, n.target, value.to(device))
            moved += 1
    if traced_device == device.type:
        return moved
    for n in gm.graph.nodes:
        d = n.kwargs.get("device") if n.op == "call_function" else None
        if isinstance(d, torch.device) and d.type == traced_device:
            n.update_kwarg("device", device)
            moved += 1
    return moved


def _devices(value: Any) -> list[torch.device]:
    return [t.device for t in T.tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def off_device(gm: fx.GraphModule, device_type: str, values: bool = True) -> list[str]:
    """Everything of `gm` that is not on `device_type`, as "node (what): device" lines:
    lifted constants, factory ops whose `device=` names another device and, with `values`
    (graphs traced on the job's device: the step graph, the local graphs), every placeholder
    and op output whose traced value lives elsewhere. Empty: the graph runs on the device."""
    found: list[str] = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            devs, what = _devices(getattr(gm, n.target, None)), "constant"
        elif n.op in ("placeholder", "call_function"):
            d = n.kwargs.get("device") if n.op == "call_function" else None
            if isinstance(d, torch.device) and d.type != device_type:
                found.append(f"{n.name} ({T.op_name(n.target)} device=): {d}")
                continue
            devs = _devices(n.meta.get("val")) if values else []
            what = "input" if n.op == "placeholder" else T.op_name(n.target)
        else:
            continue
        bad = sorted({str(d) for d in devs if d.type != device_type})
        if bad:
            found.append(f"{n.name} ({what}): {', '.join(bad)}")
    return found
