"""`python scripts/convert_hf.py --help`: the program is tools/convert_hf.py."""
from tools.convert_hf import main

raise SystemExit(main())
