"""Sweeps and the mesh search: many plans of one job, ranked (one home for both).

`mesh_space.py` (the meshes a world of N devices allows, their layout rules, the ranking),
`mesh_search.py` (each of those meshes planned as a sweep point, then ranked), `spec.py`
(a sweep's points from its TOML), `point.py` (one point planned, and the plan cache),
`run.py` (points planned in worker processes), `report.py` (table, CSV, SVG), `presets.py`
(constraint sets that shape a plan like a hand-written recipe: the free plan's comparisons).
"""
