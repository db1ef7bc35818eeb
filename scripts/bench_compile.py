"""`python scripts/bench_compile.py --help`: the program is tools/bench_compile.py."""
from tools.bench_compile import main

raise SystemExit(main())
