"""`python scripts/fault_matrix.py --help`: the program is tools/fault_matrix.py."""
from tools.fault_matrix import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
