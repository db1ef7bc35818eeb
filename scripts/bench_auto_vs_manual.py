"""`python scripts/bench_auto_vs_manual.py --help`: the program is tools/bench_auto_vs_manual.py."""
from tools.bench_auto_vs_manual import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
