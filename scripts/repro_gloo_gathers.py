"""`python scripts/repro_gloo_gathers.py --help`: the program is tools/repro_gloo_gathers.py."""
from tools.repro_gloo_gathers import main

raise SystemExit(main())
