"""`python scripts/gpu_check_report.py --help`: the program is tools/gpu_check_report.py."""
from tools.gpu_check_report import main

raise SystemExit(main())
