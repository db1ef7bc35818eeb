"""`python scripts/fault_matrix.py --help`: the program is tools/fault_matrix.py."""
from tools.fault_matrix import main

raise SystemExit(main())
