"""`python scripts/bench_foreign_memory.py --help`: the program is tools/bench_foreign_memory.py."""
from tools.bench_foreign_memory import main

raise SystemExit(main())
