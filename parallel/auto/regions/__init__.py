"""local_map regions: a part of the model the planner treats as one black-box node.

A region is a function of tensors whose placements its author declares per mesh axis (as
`local_map` does); the planner prices and places around it, and the runtime runs its
local function on shards. One module a job:

* declaration.py -- `Region`, `Option`, `RegionError`, the registry of declared regions;
* ops.py         -- `declare`: the region's torch ops (forward, backward), their fake / real /
                    autograd bodies and DTensor strategies; `call_region`, the `region` decorator;
* tracing.py     -- marked modules traced as their region's op (`traced_regions`, `marked_regions`);
* layout.py      -- what the local function is told (`RegionContext`) and the check of its outputs;
* pricing.py     -- `region_cost`: FLOPs on the local shapes + declared gathers and all-to-alls
                    (`step_region_us`: the same for a call in a rank's step graph);
* running.py     -- `run_region`: a planned region node on this rank's shards;
* tape.py        -- an eager step graph's region forward kept for its backward (no recompute);
* cp_attention.py, moe_dispatch.py -- the two regions the models mark (causal attention: CP;
  MoE token dispatch: EP), declared on import of this package.
"""

from parallel.auto.regions.cp_attention import NAME as CP_ATTENTION
from parallel.auto.regions.cp_attention import load_balanced_batch
from parallel.auto.regions.declaration import (
    MARKER,
    NAMESPACE,
    REPLICATED,
    Option,
    Region,
    RegionError,
    backward_op,
    declared,
    forward_op,
    region_of,
)
from parallel.auto.regions.layout import (
    AxisLayout,
    RegionContext,
    check_outputs,
    context_from,
    make_layout,
    option_names,
)
from parallel.auto.regions.moe_dispatch import NAME as MOE_DISPATCH
from parallel.auto.regions.ops import call_region, declare, region, run_kernel
from parallel.auto.regions.pricing import region_cost, step_region_us
from parallel.auto.regions.running import run_region
from parallel.auto.regions.tracing import marked_regions, regions_in, traced_regions

__all__ = [
    "CP_ATTENTION", "MARKER", "MOE_DISPATCH", "NAMESPACE", "REPLICATED", "AxisLayout", "Option", "Region",
    "RegionContext", "RegionError", "backward_op", "call_region", "check_outputs", "context_from", "declare",
    "declared", "forward_op", "load_balanced_batch", "make_layout", "marked_regions", "option_names", "region",
    "region_cost", "region_of", "regions_in", "run_kernel", "run_region", "step_region_us", "traced_regions",
]
