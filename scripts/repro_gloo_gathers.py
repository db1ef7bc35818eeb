"""`python scripts/repro_gloo_gathers.py --help`: the program is tools/repro_gloo_gathers.py."""
from tools.repro_gloo_gathers import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
