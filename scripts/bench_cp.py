"""`python scripts/bench_cp.py --help`: the program is tools/bench_cp.py."""
from tools.bench_cp import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
