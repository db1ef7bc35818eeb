"""`python scripts/bench_compile.py --help`: the program is tools/bench_compile.py."""
from tools.bench_compile import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
