"""`python scripts/bench_memory.py --help`: the program is tools/bench_memory.py."""
from tools.bench_memory import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
