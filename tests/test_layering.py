"""The project's structure, checked from the code itself (imports parsed with `ast`).

* Layers point down only: models -> parallel -> trainer -> train.py / tools / scripts.
* No import circle between the project's modules, function-local imports included.
* Private torch APIs only in the adapter (`parallel/_torch.py`, `parallel/_torch_memory.py`):
  no other module imports a private torch module or name, reaches a `torch._…` attribute, or
  reads a private attribute that no project code defines (so it belongs to a torch object);
  nothing imports `torch.testing`.
* Programs only call the library: no file in scripts/ or tests/ edits `sys.path` or loads a
  program by file path or bare name (`importlib.import_module("plan")`, `spec_from_file_location`):
  they import `tools.X`.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"models": 0, "parallel": 1, "trainer": 2, "tools": 3, "scripts": 3, "train": 3}
ADAPTERS = ("parallel/_torch.py", "parallel/_torch_memory.py", "parallel/_torch_checkpoint.py",
            "parallel/_torch_attention.py", "parallel/_torch_pipeline.py")
NOT_TORCH = {"_exit"}  # os._exit in a benchmark's worker process


def _library_files() -> list[Path]:
    files = [ROOT / "train.py"]
    for top in ("models", "parallel", "trainer", "tools", "scripts"):
        files += sorted((ROOT / top).rglob("*.py"))
    return files


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


FILES = _library_files()
MODULES = {_module_name(p): p for p in FILES}
TREES = {p: ast.parse(p.read_text(), filename=str(p)) for p in FILES}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _module_name(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every imported dotted name (module, or module.name for `from m import name`), with its line."""
    out = []
    for node in ast.walk(TREES[path]):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(path, node)
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names] + [(mod, node.lineno)]
    return out


def _project_target(name: str) -> str | None:
    """The project module an imported name lives in (longest matching prefix), if any."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in MODULES:
            return cand
    return None


def _edges() -> dict[str, dict[str, int]]:
    edges: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for mod, path in MODULES.items():
        for name, line in _imports(path):
            tgt = _project_target(name)
            # a package's own submodules reach it through their parent: not an edge
            if tgt is None or tgt == mod or mod.startswith(tgt + "."):
                continue
            edges[mod].setdefault(tgt, line)
    return edges


def _layer(mod: str) -> int:
    return LAYERS[mod.split(".")[0]]


def test_layers_point_down() -> None:
    bad = [f"{_rel(MODULES[a])}:{line} imports {_rel(MODULES[b])} (layer {_layer(b)} above {_layer(a)})"
           for a, outs in _edges().items() for b, line in outs.items() if _layer(b) > _layer(a)]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    edges = _edges()
    msgs = []
    for comp in _cycles(edges):
        ties = [f"{_rel(MODULES[a])}:{edges[a][b]} -> {_rel(MODULES[b])}" for a in comp for b in edges[a] if b in comp]
        msgs.append("circle:\n  " + "\n  ".join(ties))
    assert not msgs, "\n".join(msgs)


@functools.lru_cache(maxsize=1)
def _project_private_names() -> frozenset[str]:
    """`_defined_private_names` of the project's own files, walked once for all the tests."""
    return frozenset(_defined_private_names())


def _defined_private_names() -> set[str]:
    """Private names the project defines: functions, classes, attributes it assigns."""
    names: set[str] = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
                names.add(node.value)  # __slots__ entries, setattr names
    return {n for n in names if n.startswith("_")}


def _attr_chain(node: ast.Attribute) -> list[str]:
    parts = [node.attr]
    v = node.value
    while isinstance(v, ast.Attribute):
        parts.append(v.attr)
        v = v.value
    parts.append(v.id if isinstance(v, ast.Name) else "?")
    return parts[::-1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_private_uses(path: Path, ours: set[str]) -> list[str]:
    bad = []
    for node in ast.walk(TREES[path]):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [_resolve(path, node)]
            for m in mods:
                if m.startswith("torch.testing") or (m.split(".")[0] == "torch" and any(map(_private, m.split(".")))):
                    bad.append(f"{_rel(path)}:{node.lineno}: imports {m}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                bad += [f"{_rel(path)}:{node.lineno}: imports {a.name} from {node.module}"
                        for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _attr_chain(node)
            if chain[0] == "aten" or chain[:2] == ["torch", "ops"]:
                continue  # ATen op names such as aten._to_copy are public operators
            if chain[0] == "torch":
                bad.append(f"{_rel(path)}:{node.lineno}: uses {'.'.join(chain)}")
            elif chain[0] not in ("self", "cls", "torch") and node.attr not in ours and node.attr not in NOT_TORCH:
                bad.append(f"{_rel(path)}:{node.lineno}: reads {'.'.join(chain)} (a private attribute no project "
                           "code defines: use parallel/_torch.py)")
    return bad


@pytest.mark.parametrize("path", [p for p in FILES if _rel(p) not in ADAPTERS], ids=_rel)
def test_private_torch_apis_only_in_the_adapter(path: Path) -> None:
    bad = _torch_private_uses(path, _project_private_names())
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The detectors find what they look for (on synthetic code)."""
    src = ("import torch\nfrom torch.utils._pytree import tree_map\nx = torch.autograd._get_sequence_nr()\n"
           "y = op._opname\n")
    p = ROOT / "parallel" / "_synthetic_probe.py"
    TREES[p] = ast.parse(src)
    try:
        found = _torch_private_uses(p, _defined_private_names())
    finally:
        del TREES[p]
    assert len(found) == 3, found
    assert _cycles({"a": {"b": 1}, "b": {"a": 2}, "c": {}}) == [["a", "b"]]


PROGRAMS = frozenset(p.stem for p in (ROOT / "scripts").glob("*.py")) | frozenset(
    p.stem for p in (ROOT / "tools").glob("*.py"))
"""Names a test or script could load a program by, bypassing the `tools` package."""


def _call_name(node: ast.Call) -> str:
    f = node.func
    return ".".join(_attr_chain(f)) if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _path_hacks(tree: ast.AST, where: str) -> list[str]:
    """`sys.path` edits, file-path module loading, and imports of a program by its bare name."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _call_name(node)
            if name.startswith("sys.path.") or name.endswith("syspath_prepend"):
                bad.append(f"{where}:{node.lineno}: {name}(...) edits sys.path")
            elif name.endswith("spec_from_file_location"):
                bad.append(f"{where}:{node.lineno}: loads a module by file path")
            elif name.endswith("import_module") and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).split(".")[0] in PROGRAMS:
                bad.append(f"{where}:{node.lineno}: imports the program {node.args[0].value!r} by bare name")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and any(f"sys.path.{verb}(" in node.value for verb in ("insert", "append")):
            bad.append(f"{where}:{node.lineno}: code run in a child process edits sys.path (pass PYTHONPATH or cwd)")
        elif isinstance(node, ast.Import):
            bad += [f"{where}:{node.lineno}: imports the program {a.name!r} by bare name (use tools.{a.name})"
                    for a in node.names if a.name.split(".")[0] in PROGRAMS]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in PROGRAMS:
            bad.append(f"{where}:{node.lineno}: imports from the program {node.module!r} by bare name")
    return bad


@pytest.mark.parametrize("top", ["scripts", "tests"])
def test_no_sys_path_edits_nor_programs_loaded_by_path(top: str) -> None:
    bad = []
    for p in sorted((ROOT / top).rglob("*.py")):
        bad += _path_hacks(ast.parse(p.read_text(), filename=str(p)), _rel(p))
    assert not bad, "\n".join(bad)


def test_scripts_are_thin_command_lines() -> None:
    """scripts/X.py: a docstring, `from tools.X import main`, `raise SystemExit(main())` under the
    `__main__` guard (a spawned rank re-imports the parent's main file as __mp_main__)."""
    for p in sorted((ROOT / "scripts").glob("*.py")):
        body = ast.parse(p.read_text()).body
        assert len(body) == 3 and isinstance(body[0], ast.Expr), _rel(p)
        assert isinstance(body[1], ast.ImportFrom) and body[1].module == f"tools.{p.stem}", _rel(p)
        assert ast.unparse(body[2]) == "if __name__ == '__main__':\n    raise SystemExit(main())", _rel(p)


def test_the_path_check_can_fail() -> None:
    edit = "sys.path." + "insert"  # split: this file is scanned too
    src = (f"import sys, importlib\n{edit}(0, 'x')\nimportlib.import_module('fidelity')\n"
           "import importlib.util\nimportlib.util.spec_from_file_location('p', 'scripts/plan.py')\n"
           "import plan\nfrom sweep import main\nmonkeypatch.syspath_prepend('x')\nfrom tools import plan\n"
           f"CHILD = 'import sys\\n{edit}(0, ROOT)'\n")
    assert len(_path_hacks(ast.parse(src), "probe")) == 7
