"""`python scripts/bench_checkpoint.py --help`: the program is tools/bench_checkpoint.py."""
from tools.bench_checkpoint import main

raise SystemExit(main())
