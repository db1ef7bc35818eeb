"""`python scripts/bench_checkpoint.py --help`: the program is tools/bench_checkpoint.py."""
from tools.bench_checkpoint import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
