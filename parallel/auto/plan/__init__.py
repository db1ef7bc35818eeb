"""Stage 4: the Plan -- one strategy per node, its cost breakdown, and how to read it.

* data.py   -- `Plan`, `NodePlan` (with its role), JSON save/load, `check_compatible`,
               `PlanMismatchError`;
* report.py -- its reports from the data alone: breakdown, summary (`linear_roles`), diff;
* costs.py  -- what needs the solved problem (in-memory plans): explain, costs_for_node,
               the collectives one by one;
* build.py  -- `build_plan`: the Plan of a solved Problem, its breakdown priced once;
* html.py   -- `save_html`, `plan_diff_html`: the plan as one self-contained page (this
               package's __init__ does not import it: it reads the modules above);
* replay.py -- a saved plan's placements re-priced at another input shape.
"""

from parallel.auto.plan.build import build_plan, comm_breakdown
from parallel.auto.plan.costs import PlanCosts
from parallel.auto.plan.data import FORMAT_VERSION, NodePlan, Plan, PlanMismatchError
from parallel.auto.plan.report import PlanDiff, collapse_layers, linear_roles

__all__ = ["FORMAT_VERSION", "NodePlan", "Plan", "PlanCosts", "PlanDiff", "PlanMismatchError", "build_plan",
           "collapse_layers", "comm_breakdown", "linear_roles"]
