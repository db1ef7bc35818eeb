"""`python scripts/fidelity.py --help`: the program is tools/fidelity.py."""
from tools.fidelity import main

raise SystemExit(main())
