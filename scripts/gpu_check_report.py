"""`python scripts/gpu_check_report.py --help`: the program is tools/gpu_check_report.py."""
from tools.gpu_check_report import main

if __name__ == "__main__":  # not when a spawned rank re-imports this file as __mp_main__
    raise SystemExit(main())
