"""`python scripts/replan.py --help`: the program is tools/replan.py."""
from tools.replan import main

raise SystemExit(main())
