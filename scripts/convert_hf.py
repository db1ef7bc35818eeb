"""`python scripts/convert_hf.py --help`: the program is tools/convert_hf.py."""
from tools.convert_hf import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
