"""Stage 3, problem: the candidates priced into one solver-agnostic placement Problem.

`pricing.py` (compute and redistribution costs from the cost model, `cost/`),
`repeated_blocks.py` (the copies of an identical block share decisions, priced once),
`feasibility.py` (what no strategy can satisfy), `formulation.py` (builds the Problem),
`placement_problem.py` (the Problem: unary + pairwise costs, constraints, budget).
"""
