"""Identical layers traced once (parallel/auto/trace/repeated_blocks.py): a joint graph traced with two
blocks of the last run and the rest copied is node for node the graph a full trace gives
(ops, argument wiring, shapes and strides, phases, modules, descriptors), for the three
model families, with MoE and CP-attention regions and on a fake CUDA mesh; a plan made on it
is the full trace's plan; and a model whose blocks differ by index is traced in full."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh

from models import build_model
from parallel.auto.api import fake_world
from parallel.auto.request import PlanRequest, planner_inputs, planning
from parallel.auto.trace import repeated_blocks as layer_copies
from parallel.auto.trace.joint import trace_joint
from parallel.auto.trace.repeated_blocks import layer_run

pytestmark = pytest.mark.slow


def _form(jg) -> list[tuple]:
    """Every node as (op, target, value shapes/strides/dtypes, phase, module, inputs by
    position, descriptor): two graphs with the same form differ only in node names."""
    nodes = list(jg.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        v = n.meta.get("val")
        vals = v if isinstance(v, (tuple, list)) else (v,)
        sig = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else None
                    for t in vals)
        wiring = str(fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", pos[a])))
        out.append((n.op, "" if n.op == "placeholder" else str(n.target), sig, jg.phase.get(n.name),
                    None if n.op == "output" else jg.module_of.get(n.name), wiring, str(n.meta.get("desc"))))
    return out


def _traces(family: str, layers: int, mesh_shape: tuple, names: tuple, device: str = "cpu", caplog=None):
    model = build_model(family, "debug", device="meta", n_layers=layers)
    with fake_world(int(torch.tensor(mesh_shape).prod())):
        mesh = init_device_mesh(device, mesh_shape, mesh_dim_names=names)
        ins = planner_inputs(model, mesh, PlanRequest(local_batch_size=2, seq_len=64))
        with caplog.at_level(logging.INFO, logger="parallel.auto.trace.joint"):
            copied = trace_joint(model, ins.inputs, ins.loss_fn, device=device, regions=ins.regions)
        full = trace_joint(model, ins.inputs, ins.loss_fn, device=device, regions=ins.regions, copy_blocks=False)
    return model, copied, full


@pytest.mark.parametrize("family,layers,mesh_shape,names,device", [
    ("llama3", 5, (4,), ("dp",), "cpu"),
    ("qwen3", 4, (2, 2), ("dp", "tp"), "cpu"),
    ("deepseek_v3", 5, (4,), ("dp",), "cpu"),  # a dense block, then MoE blocks with dispatch regions
    ("llama3", 4, (2, 2), ("dp", "cp"), "cpu"),  # causal attention as a CP region
    ("llama3", 4, (4,), ("dp",), "cuda"),  # fake CUDA: attention as plain ATen ops
])
def test_copied_blocks_form_the_full_trace(family, layers, mesh_shape, names, device, caplog):
    model, copied, full = _traces(family, layers, mesh_shape, names, device, caplog)
    run = layer_run(model)
    assert run is not None and run.total == layers
    assert f"the other {layers - run.kept} copied" in caplog.text  # the copy happened (no fallback)
    a, b = _form(copied), _form(full)
    assert len(a) == len(b)
    diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert not diffs, f"first difference at node {diffs[0]}: {a[diffs[0]]} != {b[diffs[0]]}"
    assert list(copied.params) == list(full.params)
    assert [s.role for s in copied.slots] == [s.role for s in full.slots]
    assert len(copied.regions) == len(full.regions)
    # the copies are new values, not the template's: one storage per parameter
    storages = {p.meta["val"].untyped_storage()._cdata for p in copied.params.values()}
    assert len(storages) == len(copied.params)


def _values(jg) -> list[tuple]:
    """Each node's values as (shape, stride, dtype, storage offset, the arguments it is a view
    of, the earlier values of the node on the same storage)."""
    out = []
    for n in jg.gm.graph.nodes:
        v = n.meta.get("val")
        vals = [t for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
        reads: list = []
        fx.node.map_arg((n.args, n.kwargs), reads.append)
        read = [{t.untyped_storage()._cdata for t in (r.meta.get("val") if isinstance(r.meta.get("val"), (tuple, list))
                                                     else [r.meta.get("val")]) if isinstance(t, torch.Tensor)}
                for r in reads]
        own = [t.untyped_storage()._cdata for t in vals]
        out.append(tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset(),
                          [i for i, st in enumerate(read) if own[k] in st], own.index(own[k]))
                         for k, t in enumerate(vals)))
    return out


@pytest.mark.parametrize("family,layers", [("llama3", 5), ("deepseek_v3", 5)])
def test_copied_values_are_what_running_the_ops_gives(family, layers, monkeypatch, caplog):
    """A copy's fake values are made like its template's (`mirrored_value`), not by running the
    op: the same shapes, strides, offsets and views of the same arguments as running it gives."""
    _, mirrored, _ = _traces(family, layers, (4,), ("dp",), "cpu", caplog)
    calls = []
    monkeypatch.setattr(layer_copies, "mirrored_value", lambda *a: calls.append(1) or layer_copies.RUN)
    _, ran, _ = _traces(family, layers, (4,), ("dp",), "cpu", caplog)
    assert calls  # the reference ran every copied op
    a, b = _values(mirrored), _values(ran)
    assert len(a) == len(b) and any(any(x[4] for x in node) for node in a)  # views of arguments are there
    diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    assert not diffs, f"first difference at node {diffs[0]}: {a[diffs[0]]} != {b[diffs[0]]}"


def test_a_plan_on_the_copied_graph_is_the_full_traces_plan(caplog):
    model, copied, full = _traces("llama3", 4, (2, 2), ("dp", "tp"), "cpu", caplog)
    request = PlanRequest(local_batch_size=2, seq_len=64)
    plans = []
    for jg in (copied, full):
        with fake_world(4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            with planning(model, mesh, request, graph=jg) as autop:
                plan = autop.optimize_placement()
        plans.append((round(plan.objective_us, 3), plan.param_placements(),
                      {fqn: plan.grad_placement(fqn) for fqn in jg.params}))
    assert plans[0] == plans[1]


class _ScaledBlock(nn.Module):
    """A block whose forward depends on its index (a literal that differs per layer)."""

    def __init__(self, index: int):
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)
        self.scale = 1.0 / (index + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x) * self.scale


class _Stack(nn.Module):
    repeated_blocks = "layers"

    def __init__(self, n: int):
        super().__init__()
        self.stem = nn.Linear(16, 16, bias=False)  # so that every block passes a gradient back
        self.layers = nn.ModuleList(_ScaledBlock(i) for i in range(n))
        self.head = nn.Linear(16, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def test_blocks_that_differ_by_index_are_traced_in_full(caplog):
    with torch.device("meta"):
        model = _Stack(5)
    x = torch.empty(4, 16, device="meta")
    with caplog.at_level(logging.INFO, logger="parallel.auto.trace.joint"):
        copied = trace_joint(model, (x,))
    assert "blocks not copied" in caplog.text and "differs from the predecessor's" in caplog.text
    full = trace_joint(model, (x,), copy_blocks=False)
    assert _form(copied) == _form(full)
    scales = {n.args[-1] for n in copied.gm.graph.nodes if n.args and isinstance(n.args[-1], float)}
    assert scales == {1.0 / (i + 1) for i in range(5)}  # each block its own
