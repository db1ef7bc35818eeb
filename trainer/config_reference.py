"""The config reference, generated from the config dataclasses (never typed by hand).

    markdown = render_config_reference()     # one table per TOML section: key, type, default, description
    keys = accepted_config_keys()             # {"training.seq_len", "parallelism.hardware", ...}

Both walk the sections and keys exactly as the loader does (`trainer/config.py`: `SECTIONS` and
`_keys`, which `load_config` and `--section.key` overrides go through), so a `FLAT` settings object's
fields (`[parallelism]` from `ParallelDegrees` and `PlannerConfig`) are listed as keys of the
enclosing section, and fields set from another section (`JOB_KEY`) are not. A key's description is
the comment above or beside its field in the source (for a class without field comments, the
`name: text` clause of its docstring). `docs/hooks.py` writes the result into `docs/config.md` when
the docs are built, so the page cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Any

from . import config as C


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(C.JobConfig)
    return {section: hints[section] for section in C.SECTIONS}


def accepted_config_keys() -> set[str]:
    """Every "section.key" a job's TOML or a `--section.key` override may set."""
    return {f"{section}.{key}" for section, cls in _section_classes().items() for key in C._keys(cls)}


# --------------------------------------------------------------------------- descriptions


@functools.lru_cache(maxsize=None)
def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above its definition and the comment beside it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[str, bool]] = {}  # row -> (text, whole line)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"))
    classdef = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    out: dict[str, str] = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        beside = [comments[r][0] for r in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                  if r in comments and not comments[r][1]]
        text = " ".join(part for part in above + beside if part)
        if text:
            out[node.target.id] = text
    return out


def _expand_names(names: str, fields: set[str]) -> list[str]:
    """`split_seeding / _radius / _rounds` -> the fields it names (`_x`: appended to, or replacing
    the last part of, the first name)."""
    parts = [p.strip() for p in re.split(r"[/,]", names) if p.strip()]
    if not parts:
        return []
    base, out = parts[0], []
    for part in parts:
        if part.startswith("_"):
            options = [base + part, base.rsplit("_", 1)[0] + part]
            part = next((o for o in options if o in fields), options[0])
        if part not in fields:
            return []
        out.append(part)
    return out


@functools.lru_cache(maxsize=None)
def _docstring_clauses(cls: type) -> dict[str, str]:
    """Field name -> its clause in the class docstring: `name: text` or `name text`, clauses ending
    with ';' (a docstring of several paragraphs: its first, the summary, left out)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    if not doc or not dataclasses.is_dataclass(cls):
        return {}
    fields = {f.name for f in dataclasses.fields(cls)}
    paragraphs = doc.split("\n\n")
    body = " ".join(" ".join(paragraphs[1:] if len(paragraphs) > 1 else paragraphs).split())
    out: dict[str, str] = {}
    for clause in body.split(";"):
        clause = clause.strip().rstrip(".")
        m = re.match(r"([A-Za-z_][\w ,/]*?):\s*(.+)$", clause)
        if m and _expand_names(m.group(1), fields):
            for name in _expand_names(m.group(1), fields):
                out.setdefault(name, m.group(2))
            continue
        if m:  # "Label: name text"
            clause = m.group(2)
        first, _, rest = clause.partition(" ")
        if first in fields and rest:
            out.setdefault(first, rest)
    return out


def _description(cls: type, name: str) -> str:
    """The field's own comment, else its docstring clause, else where a sibling's comment names it."""
    comments = _field_comments(cls)
    if name in comments:
        return comments[name]
    clauses = _docstring_clauses(cls)
    if name in clauses:
        return clauses[name]
    # named in a sibling's comment (an identifier with "_", or in backticks: not an English word)
    pattern = rf"`{re.escape(name)}`" if "_" not in name else rf"(?<![\w.]){re.escape(name)}(?![\w'])"
    for other, text in comments.items():
        if re.search(pattern, text):
            return f"see `{other}`"
    return ""


def _owner(section_cls: type, path: tuple[str, ...]) -> type:
    """The dataclass that defines the field at `path` (a FLAT field's settings object, or the section)."""
    cls = section_cls
    for name in path[:-1]:
        cls = typing.get_type_hints(cls)[name]
    return cls


# --------------------------------------------------------------------------- rendering

_TYPE_NAMES = {int: "int", float: "float", str: "str", bool: "bool", list: "list (TOML array)"}


def _type_text(tp: Any) -> str:
    """What the loader accepts for a field of type `tp` (trainer/config.py `_check_value`)."""
    if typing.get_origin(tp) is typing.Union:
        args = typing.get_args(tp)
        names = [_TYPE_NAMES[a] for a in args if a in _TYPE_NAMES]
        text = " or ".join(names) or str(tp)
        return text + (" (optional)" if type(None) in args else "")
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    try:
        return f"`{C._toml_value(value)}`"
    except TypeError:
        return f"`{value!r}`"


def _escape(text: str) -> str:
    """Markdown for a table cell: `|` `<` `>` `*` escaped outside code spans (kept as they are)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(parts)


def _source_name(cls: type) -> str:
    module = inspect.getmodule(cls)
    path = (module.__name__ if module else "?").replace(".", "/") + ".py"
    return f"`{cls.__name__}` (`{path}`)"


def _first_paragraph(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # the dataclass's generated signature
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def _rows(section: str, section_cls: type, defaults: Any) -> list[str]:
    """The table of one section: a row per key, with an anchor `section.key`."""
    keys = C._keys(section_cls)
    values = C.section_dict(getattr(defaults, section))
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, (path, tp) in keys.items():
        text = _escape(_description(_owner(section_cls, path), path[-1]))
        see = re.fullmatch(r"see `(\w+)`", text)
        if see and see.group(1) in keys:  # a link to the sibling's row
            text = f"see [`{see.group(1)}`](#{section}.{see.group(1)})"
        rows.append(f'| <a id="{section}.{key}"></a>`{key}` | {_type_text(tp)} | {_default_text(values[key])} '
                    f"| {text} |")
    return rows


def _flat_notes(section_cls: type) -> list[str]:
    """A line per FLAT settings object of the section: where its keys come from."""
    hints = typing.get_type_hints(section_cls)
    notes = []
    for f in dataclasses.fields(section_cls):
        if f.metadata.get(C.FLAT):
            settings = hints[f.name]
            note = f"Keys from {_source_name(settings)}"
            paragraph = _first_paragraph(settings)
            if paragraph:
                note += f": {_escape(paragraph[0].lower() + paragraph[1:])}"
            notes += [f"- {note.rstrip('.')}.", ""]
    return notes


def _old_keys_table(title: str, note: str, old_to_new: dict[tuple[str, str], str]) -> list[str]:
    """A section listing old keys (section, key) -> their new key; nothing when there are none."""
    if not old_to_new:
        return []
    rows = [f"| `{section}.{old}` | `{section}.{new}` |" for (section, old), new in sorted(old_to_new.items())]
    return [f"## {title}", "", note, "", "| old key | new key |", "|---|---|", *rows, ""]


def render_config_reference() -> str:
    """Markdown: one section per TOML section, a table row per accepted key."""
    defaults = C.JobConfig()
    lines: list[str] = []
    for section, section_cls in _section_classes().items():
        lines += [f"## [{section}]", ""]
        intro = _first_paragraph(section_cls)
        if intro:
            lines += [f"{_escape(intro)} From {_source_name(section_cls)}.", ""]
        lines += _rows(section, section_cls, defaults) + [""] + _flat_notes(section_cls)
    lines += _old_keys_table("Renamed keys", "A job that still sets an old key stops with a config error naming "
                             "the new one.", C.RENAMED)
    lines += _old_keys_table("Old keys that still work", "A job that still sets an old key keeps working; loading "
                             "it logs one line naming the new key.", C.DEPRECATED)
    return "\n".join(lines)


__all__ = ["accepted_config_keys", "render_config_reference"]
