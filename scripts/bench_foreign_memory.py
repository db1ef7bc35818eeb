"""`python scripts/bench_foreign_memory.py --help`: the program is tools/bench_foreign_memory.py."""
from tools.bench_foreign_memory import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
