"""`python scripts/bench_moe_balance.py --help`: the program is tools/bench_moe_balance.py."""
from tools.bench_moe_balance import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
