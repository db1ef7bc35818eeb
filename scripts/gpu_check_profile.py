"""`python scripts/gpu_check_profile.py --help`: the program is tools/gpu_check_profile.py."""
from tools.gpu_check_profile import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
