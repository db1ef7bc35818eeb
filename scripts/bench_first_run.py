"""`python scripts/bench_first_run.py --help`: the program is tools/bench_first_run.py."""
from tools.bench_first_run import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
