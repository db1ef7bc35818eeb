"""`python scripts/bench_cp.py --help`: the program is tools/bench_cp.py."""
from tools.bench_cp import main

raise SystemExit(main())
