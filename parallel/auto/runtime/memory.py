"""A plan's peak memory per device, predicted from the step graph the runtime would run.

Builds the plan's runner and its step graph (runtime/step_graph.py) on fake tensors with
this rank's local shapes, exactly as `ParallelModule.forward_backward` does on real ones
(the same partition, activation-checkpointing tags, bucketed gathers and reductions,
overlap schedule), and walks it (cost/memory.py). Nothing is allocated: a 32-layer model
takes seconds. On gloo ranks the all-gathers' staging buffers are counted too.

The runner and the graph are returned too (`TracedStep`, from `trace_step`): the graph is
traced under `no_grad` as `forward_backward` traces it, so it is the very graph the first
training step runs, and AutoParallel hands both to the ParallelModule of that plan
(one trace per plan). The same graph is simulated on the cost model (`predict_traced`,
cost/simulate.py) for the step time and the timeline the plan page draws.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from parallel import _torch as T
from parallel.auto.candidates.placements import rank_local_shape
from parallel.auto.candidates.strategies import Candidates
from parallel.auto.cost.comm import AxisLink
from parallel.auto.cost.memory import MemoryEstimate, optimizer_temp_bytes, step_graph_memory
from parallel.auto.cost.simulate import StepPrediction, simulate_step
from parallel.auto.plan import Plan
from parallel.auto.regions.pricing import step_region_us
from parallel.auto.regions.tape import pair_region_calls, taped_bytes
from parallel.auto.runtime.device import runtime_device
from parallel.auto.runtime.options import RuntimeOptions
from parallel.auto.runtime.redistribute import contiguous_stride
from parallel.auto.runtime.runner import PlanRunner
from parallel.auto.runtime.step_graph import StepGraph
from parallel.auto.trace.joint import JointGraph, layer_prefix

log = logging.getLogger("parallel.auto.runtime")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _fake_dtensor(val: torch.Tensor, placements: tuple, mesh: DeviceMesh) -> DTensor:
    shape = tuple(val.shape)
    here = rank_local_shape(shape, placements, tuple(mesh.shape), mesh.get_coordinate())  # this rank's shard
    local = torch.empty(here, dtype=val.dtype, device=runtime_device(mesh))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


def _on_gloo(mesh: DeviceMesh) -> bool:
    """The mesh's collectives run on gloo (real CPU ranks; a fake world plans for its profile's
    backend, NCCL on GPUs, which stages nothing): gloo's all-gathers stage their output."""
    import torch.distributed as dist

    try:
        return dist.is_initialized() and dist.get_backend(mesh.get_group(0)) == "gloo"
    except (RuntimeError, ValueError):
        return False


@dataclass
class TracedStep:
    """A plan's runner and step graph on this rank's local shapes, as the estimate traced
    them (analysis-only: `StepGraph.make_executable` before running it), with what the
    walk needs besides the graph."""

    plan: Plan
    candidates: Candidates
    options: RuntimeOptions  # compile off: the estimate is of the eager step
    runner: PlanRunner
    step_graph: StepGraph
    param_bytes: list[int]  # local bytes of each parameter shard (runner.param_names order)
    buffer_bytes: int
    n_inputs: int


def trace_step(graph: JointGraph, candidates: Candidates, plan: Plan, mesh: DeviceMesh, *,
               mp_policy: MixedPrecisionPolicy | None = None, options: RuntimeOptions | None = None) -> TracedStep:
    """Build `plan`'s runner and trace its step graph on fake tensors of rank 0's local shapes."""
    options = dataclasses.replace(options or RuntimeOptions(), compile=False)
    runner = PlanRunner(graph, candidates, plan, mesh, mp_policy, options)
    pvals = [graph.params[f].meta["val"] for f in runner.param_names]
    bvals = [graph.buffers[f].meta["val"] for f in runner.buffer_names]
    with T.FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():  # no_grad: as forward_backward traces
        params = [_fake_dtensor(v, runner.param_placements(f), mesh) for f, v in zip(runner.param_names, pvals)]
        buffers = [torch.empty(tuple(v.shape), dtype=v.dtype, device=runner.device) for v in bvals]
        inputs = [_fake_dtensor(n.meta["val"], runner.input_placements(i), mesh)
                  for i, n in enumerate(runner.input_nodes)]
        sg = StepGraph(runner, params, buffers, inputs, overlap=options.overlap, executable=False,
                       reduce=options.micro_batches == 1)  # the graph every micro-batch runs
    local = [_nbytes(tuple(p.to_local().shape), p.dtype) for p in params]
    buffer_bytes = sum(_nbytes(tuple(v.shape), v.dtype) for v in bvals)
    return TracedStep(plan, candidates, options, runner, sg, local, buffer_bytes, len(inputs))


def step_memory(step: TracedStep, mesh: DeviceMesh, optimizer: str = "foreach") -> MemoryEstimate:
    """The liveness walk (cost/memory.py) over a traced step, with the parameters, buffers and
    AdamW's states and step around it."""
    sg, local = step.step_graph, step.param_bytes
    trained = [b for b, has in zip(local, sg.has_grad) if has]  # AdamW keeps state for these only
    est = step_graph_memory(sg.gm, n_inputs=step.n_inputs, n_outputs=len(sg.out_specs),
                            state_bytes=sum(local) + step.buffer_bytes, optimizer_bytes=2 * sum(trained),
                            optimizer_temp=optimizer_temp_bytes(trained, optimizer),
                            gather_staging=_on_gloo(mesh),
                            reduced_grad_bytes=None if sg.reduces else sum(trained),
                            held=[(f, b, taped_bytes(f)) for f, b in pair_region_calls(sg.gm)])
    est.recompute = step.options.ac_label
    by_layer = step.runner.ac_by_layer()
    if set(by_layer.values()) - {"none"}:  # the picture labels each block's choice
        est.recompute_by_block = by_layer
    log.debug("memory: %s", est.summary())
    return est



def param_groups(names: list[str]) -> list[str]:
    """The layer ('layers.3') or top-level module ('output') of each parameter: what the
    timeline's compute events are named after."""
    return [layer_prefix(f.rpartition(".")[0]) or f.split(".")[0] for f in names]


def step_links(mesh: DeviceMesh, cost_model: Any) -> dict[str, AxisLink]:
    """Process-group name -> the link of its mesh axis, as the step graph's collectives name them."""
    return {mesh.get_group(i).group_name: cost_model.links[i] for i in range(mesh.ndim)}


def predict_traced(step: TracedStep, mesh: DeviceMesh, cost_model: Any) -> StepPrediction:
    """The traced step simulated on `cost_model` (what `ParallelModule.predict_step` gives once
    it runs this graph): the step time and its timeline, at planning time."""
    return simulate_step(step.step_graph.gm, cost_model, step_links(mesh, cost_model),
                         optimizer_param_bytes=sum(step.param_bytes), optimizer_tensors=len(step.param_bytes),
                         param_groups=param_groups(step.runner.param_names), region_us=step_region_us)
