"""`python scripts/bench_memory.py --help`: the program is tools/bench_memory.py."""
from tools.bench_memory import main

raise SystemExit(main())
