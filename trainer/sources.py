"""Documents from ``[data] path``: the files it names and the text of each document.

A path is a file, a folder (searched recursively) or a glob (``data/*.jsonl``, ``**`` too);
files are read in sorted order. Per kind:

- ``.txt``: the whole file is one document (UTF-8);
- ``.jsonl``: one JSON object a line, the text in ``[data] jsonl_field``;
- ``.parquet``: one row a document, the text in column ``jsonl_field`` (pyarrow, a row
  group at a time);
- ``.csv``, ``.json``, ``.arrow``: ``datasets.load_dataset`` with the file as its
  ``data_files``, read as a stream (no copy in the datasets cache), field ``jsonl_field``;
- with ``[data] dataset_builder``: everything through ``datasets.load_dataset`` -- a builder
  name (``text``, ``json``, ``csv``, ``parquet``, ...) over the files of the path, or ``auto``
  for a local dataset folder (its builder and splits inferred), rows of ``[data] split``.

Bad data -- an empty file, a missing or non-text field, undecodable bytes, a file the
reader cannot open -- is a :class:`DataError` naming the file and the line (``path:LINE``)
or row (``path: row N``), raised while the corpus is read, before any training step.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, Optional

SHIPPED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"

DATASETS_BUILDERS = {".csv": "csv", ".json": "json", ".arrow": "arrow"}
"""File suffixes read through ``datasets.load_dataset`` -> its packaged builder."""
SUFFIXES = (".txt", ".jsonl", ".parquet", *DATASETS_BUILDERS)


class DataError(ValueError):
    """Data that cannot feed the configured batches (the trainer reports it as a config error
    naming ``key`` -- by default the sequence length -- and the file)."""

    def __init__(self, message: str, key: Optional[str] = None):
        super().__init__(message)
        self.key = key


def _err(message: str) -> DataError:
    return DataError(message, key="data.path")


def documents_of(data_cfg) -> Iterator[str]:
    """The documents of a ``[data]`` section."""
    return iter_documents(data_cfg.path, data_cfg.jsonl_field, data_cfg.dataset_builder, data_cfg.split)


def first_documents(data_cfg) -> None:
    """Read the first document of every file (of the dataset, with a builder): what a streamed
    corpus checks before step 1."""
    if data_cfg.dataset_builder:
        next(documents_of(data_cfg), None)
    elif data_cfg.path:
        for f in list_files(data_cfg.path):
            next(iter(read_documents(f, data_cfg.jsonl_field)), None)


def list_files(path: str) -> list[Path]:
    """The data files ``path`` names, sorted (a file, a folder searched recursively, or a glob)."""
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True)
                       if Path(f).is_file() and Path(f).suffix in SUFFIXES)
        if not files:
            raise _err(f"[data] path {path!r}: the pattern matches no {'/'.join(SUFFIXES)} files")
        return files
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
        if not files:
            raise _err(f"[data] path {path!r}: no {'/'.join(SUFFIXES)} files in the folder")
        return files
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise _err(f"[data] path {path!r}: unknown file kind {p.suffix!r}; use {', '.join(SUFFIXES)}")
        return [p]
    raise _err(f"[data] path {path!r}: no such file or folder")


def _decode(raw: bytes, path: Path, line_offset: int = 0) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_offset + raw[:e.start].count(b"\n") + 1
        raise _err(f"{path}:{line}: undecodable bytes ({e.reason} at byte {e.start}); the text must be "
                   f"UTF-8: re-encode the file or remove it from [data] path") from None


def _read_txt(path: Path) -> Iterator[str]:
    text = _decode(path.read_bytes(), path)
    if not text.strip():
        raise _err(f"{path}: empty file; remove it from [data] path or add text")
    yield text


def _field(rec, field: str, where: str, how: str) -> str:
    if not isinstance(rec, dict) or field not in rec:
        have = ", ".join(map(repr, rec)) if isinstance(rec, dict) else type(rec).__name__
        raise _err(f"{where}: no '{field}' field (it has {have or 'no fields'}); set [data] jsonl_field to "
                   f"the {how} that holds the text")
    value = rec[field]
    if not isinstance(value, str):
        raise _err(f"{where}: '{field}' is {type(value).__name__}, not text; set [data] jsonl_field to the "
                   f"{how} that holds the text")
    return value


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    n = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, lineno - 1).strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise _err(f"{path}:{lineno}: not valid JSON ({e}); one JSON object a line") from None
            n += 1
            yield _field(rec, field, f"{path}:{lineno}", "key")
    if n == 0:
        raise _err(f"{path}: empty file (no JSON lines); remove it from [data] path or add records")


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _err(f"{path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise _err(f"{path}: no '{field}' column (columns: {', '.join(names)}); set [data] jsonl_field "
                   f"to the column that holds the text")
    if pf.metadata.num_rows == 0:
        raise _err(f"{path}: empty file (no rows); remove it from [data] path or add rows")
    kind = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise _err(f"{path}: column '{field}' is {kind}, not text; set [data] jsonl_field to the column "
                   f"that holds the text")
    row = 0
    for batch in pf.iter_batches(columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is None:
                raise _err(f"{path}: row {row}: '{field}' is null; drop the row or fill it")
            row += 1
            yield value


def _stream_rows(open_stream: Callable[[], Any], field: str, where: str, what: str,
                 fix: str = "") -> Generator[str, None, int]:
    """The text of every row of a ``datasets`` stream; a reader's own error (the builders raise
    their parsers' exceptions) becomes one DataError naming ``where``; returns the row count."""
    row = -1
    try:
        for row, rec in enumerate(open_stream()):
            yield _field(rec, field, f"{where}: row {row}", "column")
    except DataError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _err(f"{where}: {what} could not read it ({type(e).__name__}: {first}){fix}") from None
    return row + 1


def _read_datasets(path: Path, field: str) -> Iterator[str]:
    import datasets

    rows = yield from _stream_rows(
        lambda: datasets.load_dataset(DATASETS_BUILDERS[path.suffix], data_files=[str(path)], split="train",
                                      streaming=True), field, str(path), "datasets.load_dataset")
    if rows == 0:
        raise _err(f"{path}: empty file (no rows); remove it from [data] path or add rows")


def packaged_builders() -> tuple[str, ...]:
    """The builder names ``datasets.load_dataset`` runs from local files (no hub)."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return tuple(sorted(_PACKAGED_DATASETS_MODULES))


def _builder_files(path: str) -> list[str]:
    """Every file ``path`` names for a builder (any suffix: the builder reads them), sorted."""
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if Path(f).is_file())
    elif Path(path).is_dir():
        files = sorted(str(f) for f in Path(path).rglob("*") if f.is_file() and not f.name.startswith("."))
    else:
        files = [path] if Path(path).is_file() else []
    if not files:
        raise _err(f"[data] path {path!r}: no files for [data] dataset_builder")
    return files


def _read_builder(path: str, field: str, builder: str, split: str) -> Iterator[str]:
    """``datasets.load_dataset`` as a stream: ``builder = "auto"`` opens the local dataset folder
    ``path`` (its builder and splits inferred from its files), a builder name reads ``path``'s files."""
    import datasets

    def open_stream():
        if builder == "auto":
            return datasets.load_dataset(path, split=split, streaming=True)
        return datasets.load_dataset(builder, data_files=_builder_files(path), split=split, streaming=True)

    where = f"{path} (split {split!r})"
    rows = yield from _stream_rows(open_stream, field, where, f"datasets.load_dataset({builder!r})",
                                   "; check [data] dataset_builder and split")
    if rows == 0:
        raise _err(f"{where}: no rows; check [data] path and split")


def read_documents(path: Path, field: str = "text") -> Iterator[str]:
    """The documents of one data file, in order."""
    if path.suffix == ".txt":
        return _read_txt(path)
    if path.suffix == ".jsonl":
        return _read_jsonl(path, field)
    if path.suffix == ".parquet":
        return _read_parquet(path, field)
    return _read_datasets(path, field)


def iter_documents(path: str = "", field: str = "text", builder: str = "", split: str = "train") -> Iterator[str]:
    """Every document of ``[data] path`` in order ("" : the shipped corpus, one document);
    ``builder`` (``[data] dataset_builder``): read by ``datasets.load_dataset`` instead."""
    if builder:
        yield from _read_builder(path, field, builder, split)
        return
    files = list_files(path) if path else [SHIPPED_CORPUS]
    for f in files:
        yield from read_documents(f, field)
