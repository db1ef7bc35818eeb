"""The automatic SPMD planner, one folder per stage, in the order data flows:

* `trace/`      -- the joint forward+backward ATen graph, constants folded, repeated blocks copied;
* `candidates/` -- every op's DTensor strategies (torch's own rules), the coverage report;
* `cost/`       -- the hardware profile and the cost model: compute, collectives, memory;
* `problem/`    -- the candidates priced into one placement Problem (repeated blocks priced once);
* `solve/`      -- exact ILP (HiGHS, CBC) or MRF, after exact presolve reductions; split-dim seeding
                   (3-D/4-D candidates narrowed around the solves of cheaper problems);
* `plan/`       -- the Plan: JSON, summary, explain, HTML page, replay at another shape;
* `runtime/`    -- the plan as a module: DTensor parameters, explicit collectives, one step graph;
* `regions/`    -- local_map regions the planner places around (CP attention, MoE dispatch);
* `search/`     -- sweeps, the mesh search, recipe-shaped presets: many plans of one job, compared.

At the top: `api.py` (`AutoParallel`, `auto_parallel`), `config.py` (`PlannerConfig`: every
planner setting) and `request.py` (the one place a job becomes a planning request).

    from parallel.auto import AutoParallel, PlannerConfig
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AutoParallel": "parallel.auto.api", "auto_parallel": "parallel.auto.api", "fake_world": "parallel.auto.api",
    "PlannerConfig": "parallel.auto.config", "Plan": "parallel.auto.plan.data",
    "PlanRequest": "parallel.auto.request", "planning": "parallel.auto.request",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (importing a stage does not import them all)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'parallel.auto' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
