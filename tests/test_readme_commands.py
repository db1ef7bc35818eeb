"""The README's two commands are what CI runs: `.ci/run` installs with the README's install
command and runs the README's test command, character for character, in a fresh venv."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The command lines of the README's first two ```bash blocks (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)[:2]
    return [line for block in blocks for line in block.splitlines() if line and not line.startswith("#")]


def ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_readme_test_command_is_what_ci_runs():
    install_and_test = readme_commands()[1]
    install, test = (part.strip() for part in install_and_test.split(" && "))
    assert install.startswith("pip install -e ") and "pytest" in test
    lines = ci_lines()
    assert install in lines, f"CI does not install with the README's command {install!r}"
    assert test in lines, f"CI does not run the README's test command {test!r}"
    assert lines.index(install) < lines.index(test)
    assert "python -m ruff check ." in lines


def test_ci_runs_in_a_fresh_virtual_environment():
    lines = ci_lines()
    venv = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv "))
    assert "--system-site-packages" not in lines[venv]
    activate = next(i for i, line in enumerate(lines) if line.startswith("source ") and "bin/activate" in line)
    install = next(i for i, line in enumerate(lines) if line.startswith("pip install"))
    assert venv < activate < install


def test_main_job_command_installs_the_package_first():
    assert readme_commands()[0].startswith("pip install -e . && torchrun ")
