"""Stage 5: the plan as a runnable module (paper §5.1).

`redistribute.py` (Partial targets, bucketed collectives) -> `interpreter.py` (one phase
on DTensors, torch.fx.Interpreter) -> `runner.py` (the joint graph partitioned into
forward and backward, bucketed gathers and gradient reductions, mixed precision) ->
`local_graphs.py` (the runner lowered to per-device ATen graphs; the autograd function)
-> `module.py` (the ParallelModule users train).
"""

from parallel.auto.runtime.module import InputShapeError, ParallelModuleMixin, apply_plan, is_parallel_module
from parallel.auto.runtime.options import RuntimeOptions
from parallel.auto.runtime.redistribute import local_shard
from parallel.auto.runtime.runner import PlanRunner
from parallel.auto.runtime.step_graph import CompileError

__all__ = ["CompileError", "RuntimeOptions", "InputShapeError", "ParallelModuleMixin", "PlanRunner",
           "apply_plan", "is_parallel_module", "local_shard"]
