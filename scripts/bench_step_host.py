"""`python scripts/bench_step_host.py --help`: the program is tools/bench_step_host.py."""
from tools.bench_step_host import main

raise SystemExit(main())
