"""`python scripts/bench_auto_vs_manual.py --help`: the program is tools/bench_auto_vs_manual.py."""
from tools.bench_auto_vs_manual import main

raise SystemExit(main())
