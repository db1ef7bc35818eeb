"""The programs' code: one module per program (`main(argv=None) -> int`: argparse and one library
call), run as `python scripts/X.py` (a three-line file importing `tools.X.main`) or, for the main
ones, as the console commands of pyproject.toml (`autotitan-plan`, `autotitan-sweep`, ...); plus what
only the programs share (`bench_common`: ranks and round-robin timing; `rank_stats`: the fidelity
benchmark's statistics). The layer above `trainer`, beside train.py: nothing below imports it.
"""
