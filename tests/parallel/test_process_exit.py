"""exit_with: the process exits with main's code, its objects frozen before shutdown, atexit handlers run."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import atexit, gc, sys
from parallel.process_exit import exit_with
junk = [[i] for i in range(1000)]
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() >= 1000, flush=True))
def main():
    print("main ran", flush=True)
    return {rc}
exit_with(main)
"""


def _run(rc: int) -> subprocess.CompletedProcess:
    # python -c puts the working directory first on sys.path: the project root here
    return subprocess.run([sys.executable, "-c", _SCRIPT.format(rc=rc)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_exit_code_is_mains_and_objects_are_frozen_before_atexit():
    out = _run(3)
    assert out.returncode == 3, out.stderr
    assert out.stdout.splitlines() == ["main ran", "frozen at exit: True"]
    assert _run(0).returncode == 0
