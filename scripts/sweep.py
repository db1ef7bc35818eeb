"""`python scripts/sweep.py --help`: the program is tools/sweep.py."""
from tools.sweep import main

raise SystemExit(main())
