"""`python scripts/bench_step_host.py --help`: the program is tools/bench_step_host.py."""
from tools.bench_step_host import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
