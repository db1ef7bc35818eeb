"""`python scripts/bench_trainer.py --help`: the program is tools/bench_trainer.py."""
from tools.bench_trainer import main

raise SystemExit(main())
