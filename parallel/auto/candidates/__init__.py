"""Stage 2, candidates: the DTensor strategies each op of the joint graph may take.

`placements.py` (the placements of a mesh), `enumeration.py` (every op node's strategies),
`strategies.py` (DTensor's own rules, and the fallbacks where torch has none), `coverage.py` (every
op and how it is handled: the report to read for a model nobody here wrote).
"""
