"""`python scripts/gpu_check_profile.py --help`: the program is tools/gpu_check_profile.py."""
from tools.gpu_check_profile import main

raise SystemExit(main())
