"""`python scripts/bench_planner.py --help`: the program is tools/bench_planner.py."""
from tools.bench_planner import main

raise SystemExit(main())
