"""Sizes a reader can hold: no source file over 600 lines, no function over 60 (parsed with `ast`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    files = [ROOT / "train.py"]
    for top in ("models", "parallel", "trainer", "scripts", "tools"):
        files += sorted((ROOT / top).rglob("*.py"))
    return files


def _too_long(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(root)
    found = [f"{rel}: {len(text.splitlines())} lines"] if len(text.splitlines()) > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_file_over_600_lines_and_no_function_over_60():
    found = [msg for path in _sources() for msg in _too_long(path)]
    assert not found, "split these:\n" + "\n".join(found)


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # 61 lines with the def
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n" + "\n" * MAX_FILE_LINES)
    (tmp_path / "short.py").write_text(f"def f():\n{body[: body.rindex(chr(10))]}\n")
    assert _too_long(tmp_path / "long.py", tmp_path) == [
        f"long.py: {MAX_FUNCTION_LINES + 1 + MAX_FILE_LINES} lines", f"long.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert _too_long(tmp_path / "short.py", tmp_path) == []
