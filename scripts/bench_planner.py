"""`python scripts/bench_planner.py --help`: the program is tools/bench_planner.py."""
from tools.bench_planner import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
