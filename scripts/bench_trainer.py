"""`python scripts/bench_trainer.py --help`: the program is tools/bench_trainer.py."""
from tools.bench_trainer import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
