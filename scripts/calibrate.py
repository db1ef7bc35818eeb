"""`python scripts/calibrate.py --help`: the program is tools/calibrate.py."""
from tools.calibrate import main

raise SystemExit(main())
