"""Dry run of an auto-mode job, on a fake world of fake tensors of the job's device.

    python train.py --config llama3_8b_h100 --dry-run --world-size 8

A GPU job is proven on a CPU machine: a fake process group of ``world_size`` ranks and a
fake **cuda** mesh (``job.device = "cpu"`` simulates a CPU job instead), then the trainer's
own code path (trainer/build.py): the model on meta, planned on rank 0 exactly as the
trainer plans it (trainer/auto_mode.py), materialised as the per-rank ParallelModule, initialised
shard by shard as GPUs do, and one training step built as the step graph the runtime
would run (eager; the compiled run hands this same graph to Inductor). Printed: the plan
summary, the predicted step time, the predicted peak memory per device and its parts, the
collectives per step per mesh axis, and a device check: every placeholder, constant and
factory output of every per-rank graph must be on the job's device.

What a CPU-only torch cannot fake: autograd on CUDA tensors (see T.autograd_device), so the
joint graph is traced on fake CPU tensors and the runtime places its graphs' values on the
job's device; and kernels (nothing runs: Inductor is not invoked).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from models import build_model, model_args
from parallel import _torch as T
from parallel.auto.cost import load_hardware
from parallel.auto.cost.memory import format_bytes
from parallel.auto.plan import Plan
from parallel.auto.regions import load_balanced_batch
from parallel.auto.request import data_degree, resolve_planner
from parallel.auto.runtime.device import off_device
from parallel.auto.runtime.local_graphs import LocalGraphs
from parallel.auto.runtime.schedule import COLLECTIVE_NAMESPACE
from parallel.mesh import CP, axis_size, build_mesh

from .build import build_parallel_model
from .config import ConfigError, JobConfig
from .device import CUDA, check_fake_cuda, simulated_device
from .dry_run import OP_KINDS, group_axis_names
from .dry_run_recipe import ep_recipe, format_comparison, fsdp_preset, priced, published_reference
from .parallelizer import AutoMode
from .tokenizer import tokenizer_vocab


@dataclass
class AutoDryRunReport:
    world_size: int
    device: str
    mesh: str
    model: str
    tokens: tuple[int, int]
    plan_summary: str = ""
    plan_origin: str = ""
    objective_us: float = 0.0
    predicted_step: str = ""
    throughput: str = ""  # "predicted N tok/s/GPU (...)"
    memory: str = ""
    collectives: dict = field(default_factory=dict)  # (kind, axis) -> [count, bytes]
    regions: list = field(default_factory=list)  # local_map regions the plan places around
    graphs: dict = field(default_factory=dict)  # graph name -> number of nodes
    off_device: list = field(default_factory=list)  # "graph: node (what): device"
    attention: dict = field(default_factory=dict)  # attention kernel op (or bmm / _softmax) -> nodes, step graph
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    plan_seconds: float = 0.0  # the free plan: trace + solve + memory estimate (plan.timings)
    priced: list = field(default_factory=list)  # PricedPlan rows: the free plan, the mesh's hand recipe


def _flavor_vocab(cfg: JobConfig, report: AutoDryRunReport) -> int:
    vocab = build_model(cfg.model.name, cfg.model.flavor, device="meta", **cfg.model.arg_overrides()).args.vocab_size
    report.notes.append(f"vocab_size = {vocab} (the flavor's; the byte tokenizer would use 256)")
    return vocab


def _step_inputs(cfg: JobConfig, mesh) -> tuple[torch.Tensor, ...]:
    """This rank's (tokens, labels[, positions]) as the trainer feeds auto mode (real host
    tensors: the load-balanced CP order is computed, not traced)."""
    t = cfg.training
    seq = max(t.seq_lens())  # with a schedule: the longest length, the peak a run must fit
    tokens = torch.zeros(t.local_batch_size, seq, dtype=torch.long)
    labels = torch.zeros(t.local_batch_size, seq, dtype=torch.long)
    if CP in (mesh.mesh_dim_names or ()) and axis_size(mesh, CP) > 1:
        return load_balanced_batch(tokens, labels, axis_size(mesh, CP))
    return tokens, labels


def _count_collectives(gm: torch.fx.GraphModule, axis_of_group: dict[str, str], report: AutoDryRunReport) -> None:
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "namespace", "") != COLLECTIVE_NAMESPACE:
            continue
        name = T.op_name(n.target)
        if name == "wait_tensor":
            continue
        kind = OP_KINDS.get(name, name)
        group = [a for a in n.args if isinstance(a, str)][-1:]  # (input, [reduce op,] [size,] group name)
        axis = axis_of_group.get(group[0], f"group {group[0]}") if group else "?"
        val = n.meta.get("val") if kind == "all_gather" else getattr(n.args[0], "meta", {}).get("val")
        nbytes = sum(x.numel() * x.element_size() for x in T.tree_flatten(val)[0] if isinstance(x, torch.Tensor))
        entry = report.collectives.setdefault((kind, axis), [0, 0])
        entry[0] += 1
        entry[1] += nbytes


def _count_attention(gm: torch.fx.GraphModule, report: AutoDryRunReport) -> None:
    """The step graph's attention kernels, and the ops of the math path (bmm, softmax) if any."""
    for n in gm.graph.nodes:
        name = T.op_name(n.target) if n.op == "call_function" and n.target is not operator.getitem else ""
        if "attention" in name or name in ("bmm", "_softmax", "_softmax_backward_data"):
            report.attention[name] = report.attention.get(name, 0) + 1


def _check_graphs(graphs: dict[str, tuple[torch.fx.GraphModule, bool]], device: str,
                  report: AutoDryRunReport) -> None:
    for name, (gm, traced_here) in graphs.items():
        report.graphs[name] = len(gm.graph.nodes)
        report.off_device += [f"{name}: {line}" for line in off_device(gm, device, values=traced_here)]


def simulated_job(job_config: JobConfig, world_size: int, device: torch.device) -> tuple[JobConfig, str]:
    """The dry run's copy of the job: its planner settings resolved for the simulated device
    (config.resolve_planner: hardware "auto" is priced as its SIMULATED_GPU_PROFILE, h100, for a
    CUDA job, else as "cpu"), not compiled (fake tensors have no kernels); and the note saying
    how "auto" was priced ("" when the hardware is named)."""
    cfg = copy.deepcopy(job_config)  # set for the simulation below, not for the caller
    planner = cfg.parallelism.planner
    resolved = resolve_planner(planner, world_size, device.type, simulated=True)
    note = "" if resolved is planner else f"parallelism.hardware = 'auto' priced as {resolved.hardware!r} (no device " \
        "to measure)"
    cfg.parallelism = dataclasses.replace(cfg.parallelism, planner=resolved)
    cfg.training = dataclasses.replace(cfg.training, compile=False)
    return cfg, note


def faked_device(job_config: JobConfig) -> torch.device:
    """The device the dry run simulates (`job.device`; "auto": CUDA), fake CUDA switched on for
    it; a ConfigError naming `job.device` when this machine cannot fake it."""
    device = simulated_device(job_config.job.device)
    if device.type == CUDA:
        why = check_fake_cuda()
        if why is not None:
            raise ConfigError(f"{job_config.source}: 'job.device' = {job_config.job.device!r}: {why}")
        T.enable_fake_cuda()
    return device


def dry_run_auto(job_config: JobConfig, world_size: int) -> AutoDryRunReport:
    """Plan, materialise and build one step of `job_config` (auto mode) on a fake world."""
    t0 = time.time()
    device = faked_device(job_config)
    cfg, note = simulated_job(job_config, world_size, device)
    compiled = job_config.training.compile
    with T.fake_world(world_size):
        mesh = build_mesh(cfg.parallelism.degrees, world_size, device.type, expert_axis=True)
        names = tuple(mesh.mesh_dim_names or ())
        report = AutoDryRunReport(world_size=world_size, device=str(device), model=f"{cfg.model.name}/"
                                  f"{cfg.model.flavor}", mesh=" x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)),
                                  tokens=(0, 0), notes=[note] if note else [])
        vocab = cfg.model.vocab_size if cfg.model.vocab_size > 0 else tokenizer_vocab(cfg) or _flavor_vocab(cfg, report)
        fake_mode = T.FakeTensorMode(allow_non_fake_inputs=True)  # one mode: the weights meet the step's inputs
        fake = lambda: fake_mode  # noqa: E731
        host_inputs = _step_inputs(cfg, mesh)
        mode = AutoMode(cfg, mesh, device)
        pm = build_parallel_model(cfg, mode, device, vocab, host_inputs[:2], storage=fake)
        plan = pm.plan
        report.plan_summary, report.plan_origin, report.objective_us = plan.summary(), mode.origin, plan.objective_us
        report.regions = list(getattr(plan, "regions", []))
        report.memory = (f"{format_bytes(plan.memory.peak_bytes)} per device in the {plan.memory.phase} "
                         f"({plan.memory.parts()}); limit {format_bytes(plan.memory.limit_bytes)} "
                         f"({plan.memory.limit_source})" if plan.memory is not None else "not estimated")
        micro = cfg.training.micro_batches(data_degree(mesh))
        if micro > 1:
            report.notes.append(f"{micro} micro-batches a step: the step graph below runs once per micro-batch, "
                                "without gradient reductions; their sum is reduced once per step")
        with fake_mode, torch.no_grad():
            inputs = [x.to(device) for x in host_inputs]  # the trainer's `.to(device)` of each batch
            report.tokens = (inputs[0].shape[0], inputs[0].shape[1])
            with pm.no_gradient_sync() if micro > 1 else contextlib.nullcontext():  # the graph the steps run
                pm.forward_backward(*inputs)
            pm.discard_unreduced_grads()
            runner = pm.plan_runner
            local = LocalGraphs(runner, *pm.planned_arguments(*inputs))  # what `model(...)` runs
        sg = next(iter(pm.step_graphs.values()))
        report.predicted_step = pm.predict_step().summary()
        _price_against_recipe(pm, mesh, cfg, report, micro)
        _count_collectives(sg.gm, group_axis_names(pm, mesh), report)
        _count_attention(sg.gm, report)
        _check_graphs({"step graph": (sg.gm, True), "local forward": (local.fwd, True),
                           "local backward": (local.bwd, True), "forward phase": (runner.fwd_gm, False),
                           "backward phase": (runner.bwd_gm, False)}, device.type, report)
        if compiled:
            report.notes.append("training.compile = true: Inductor compiles this step graph on the GPUs "
                                "(not invoked here: fake tensors have no kernels)")
        del pm, sg, local
    report.seconds = time.time() - t0
    return report


def _flops(cfg: JobConfig, mp_dtype: Any, hardware: str) -> tuple[float, float] | None:
    """(training FLOPs per token, peak FLOP/s of one device) for the MFU; None when unknown."""
    try:
        args = model_args(cfg.model.name, cfg.model.flavor, **cfg.model.arg_overrides())
        return float(args.flops_per_token(cfg.training.seq_len)), load_hardware(hardware).peak_flops(mp_dtype)
    except (AttributeError, TypeError, ValueError, OSError):
        return None


def _price_against_recipe(pm, mesh, cfg: JobConfig, report: AutoDryRunReport, micro: int) -> None:
    """The free plan and the mesh's hand recipe (an ep axis: the EP recipe; else the FSDP
    preset with per-op SAC), priced alike; and the free plan's tokens/s line."""
    plan = pm.plan
    report.plan_seconds = sum(plan.timings.values())
    step_tokens = report.tokens[0] * report.tokens[1] * data_degree(mesh)
    flops = _flops(cfg, cfg.training.mixed_precision_param, plan.hardware)
    mine = priced("auto (the planner's free plan)", plan, step_tokens, report.world_size, micro, flops=flops)
    report.throughput = (f"predicted {mine.tokens_per_s_per_gpu:,.0f} tok/s/GPU (step {mine.step_ms:,.1f} ms"
                         + (f", MFU {mine.mfu:.1%}" if mine.mfu is not None else "") + ")")
    published = published_reference(cfg.model.name, cfg.model.flavor, report.world_size)
    if published:
        report.throughput += f"; {published}"
    recipe = ep_recipe(pm, mesh, cfg, report.tokens)
    if recipe is not None:
        name = f"EP recipe (FSDP, experts over ep={dict(zip(mesh.mesh_dim_names, mesh.shape))['ep']})"
    else:
        *recipe, name = fsdp_preset(pm, mesh, cfg, report.tokens)
    report.priced = [mine, priced(name, recipe[0], step_tokens, report.world_size, micro, recipe[1], flops=flops,
                                  recompute="op on every block" if "per-op" in name else "")
                     if isinstance(recipe[0], Plan) else f"{name}: {recipe[0]}"]


def format_auto_report(r: AutoDryRunReport) -> str:
    lines = [f"dry run (auto mode): {r.model} on a fake world of {r.world_size} ranks, fake {r.device} tensors, "
             f"mesh {r.mesh}, local batch {r.tokens[0]} x {r.tokens[1]} tokens ({r.seconds:.1f} s)",
             f"plan: {r.plan_origin}; objective {r.objective_us:,.1f} µs; local_map regions: "
             f"{', '.join(r.regions) or 'none'}", r.plan_summary,
             f"predicted step (cost model on the step graph): {r.predicted_step}",
             f"predicted peak memory: {r.memory}",
             f"planning: {r.plan_seconds:.1f} s (trace, candidates, solve, memory estimate)",
             *([r.throughput] if r.throughput else []),
             *(format_comparison(r.priced) if r.priced else []),
             "collectives per training step (rank 0's step graph):",
             f"    {'kind':<15}{'mesh axis':<18}{'count':>7}{'bytes':>16}"]
    for (kind, axis), (cnt, nb) in sorted(r.collectives.items()):
        lines.append(f"    {kind:<15}{axis:<18}{cnt:>7}{nb / 2**20:>13.1f} MiB")
    if not r.collectives:
        lines.append("    (none)")
    lines.append("attention in the step graph: " + (", ".join(f"{k} x{v}" for k, v in sorted(r.attention.items()))
                                                     or "none"))
    graphs = ", ".join(f"{k} ({v} nodes)" for k, v in r.graphs.items())
    if r.off_device:
        lines.append(f"device check: FAILED, {len(r.off_device)} values not on {r.device}: "
                     + "; ".join(r.off_device[:8]))
    else:
        lines.append(f"device check: every input, constant and factory output on {r.device.split(':')[0]} in {graphs}")
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def main(job_config: JobConfig, world_size: int) -> int:
    """Entry point of ``train.py --dry-run --world-size N`` in auto mode: print the report;
    exit code 1 when a graph holds a value off the job's device."""
    report = dry_run_auto(job_config, world_size)
    print(format_auto_report(report), flush=True)
    return 1 if report.off_device else 0
