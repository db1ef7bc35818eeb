"""`python scripts/plan.py --help`: the program is tools/plan.py."""
from tools.plan import main

raise SystemExit(main())
