"""`python scripts/replan.py --help`: the program is tools/replan.py."""
from tools.replan import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
