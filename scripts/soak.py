"""`python scripts/soak.py --help`: the program is tools/soak.py."""
from tools.soak import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
