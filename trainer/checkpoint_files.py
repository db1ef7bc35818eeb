"""What a DCP checkpoint folder is trusted for: its files against its manifest, and reading it
without running code from it.

Manifest: ``manifest.json`` lists every file of a checkpoint with its size and an xxh3-64
checksum of its contents (streamed in 8 MiB chunks). `damage` compares a folder with its
manifest: a missing, resized or changed file (a flipped block of the same size) is named; a
manifest of sizes only (written before checksums) is checked by size; a folder without a
manifest cannot be verified and counts as damaged unless ``[checkpoint] trust_foreign`` (or
the caller asks for a foreign folder, such as ``initial_load_path``, where a manifest is
optional).

Reading: a checkpoint folder may come from someone else, and DCP unpickles its ``.metadata``
and its non-tensor items in full (a pickle can run any code). `read_metadata` and `dcp_load`
use `parallel._torch.SafeFileSystemReader` instead: ``.metadata`` with an unpickler that
admits DCP's metadata classes only, non-tensor items with ``torch.load(weights_only=True)``.
A folder that needs more is refused (`UnsafeCheckpoint`: the file and what it holds) unless
``trust_foreign``, which reads it with DCP's own reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp
import xxhash

from parallel._torch import SafeFileSystemReader, UnsafeCheckpoint

MANIFEST = "manifest.json"
HASH = "xxh3_64"
CHUNK = 8 * 2**20
TRUST = "'checkpoint.trust_foreign' = true"
"""The key that loads what cannot be verified (named in the errors)."""

__all__ = ["MANIFEST", "TRUST", "UnsafeCheckpoint", "damage", "dcp_load", "file_entry", "read_metadata",
           "unsafe_message", "write_manifest"]


@contextlib.contextmanager
def _quiet():
    """Silence DCP's 'assuming the intent is to save in a single process' warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------------------------- manifest


def digest(path: Path) -> str:
    """xxh3-64 of a file's contents, streamed."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A file's manifest entry: its size and checksum."""
    return {"bytes": path.stat().st_size, HASH: digest(path)}


def write_manifest(folder: Path, entries: dict[str, dict[str, Any]]) -> None:
    """``manifest.json`` of a written checkpoint: `entries` (files already checksummed, e.g.
    by the ranks that wrote them) plus every other file of the folder (written, then renamed)."""
    files = {}
    for f in sorted(folder.rglob("*")):
        name = str(f.relative_to(folder))
        if f.is_file() and name != MANIFEST:
            files[name] = entries.get(name) or file_entry(f)
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"hash": HASH, "files": files}, indent=0))
    os.replace(tmp, folder / MANIFEST)


def damage(path: Path, trust_foreign: bool = False, manifest_optional: bool = False) -> Optional[str]:
    """What is wrong with a checkpoint's files against its manifest (None: intact). Without a
    manifest: None when `trust_foreign` or `manifest_optional` (a foreign folder asked for by
    name), else the reason it cannot be used."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        if trust_foreign or manifest_optional:
            return None
        return (f"{path} has no {MANIFEST} (its files cannot be verified: written by another tool, or the "
                f"manifest was lost); {TRUST} loads it unverified")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path / MANIFEST} is unreadable ({e})"
    for name, want in files.items():
        f = path / name
        size, check = (want, None) if isinstance(want, int) else (want.get("bytes"), want.get(HASH))
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} is {f.stat().st_size} bytes, not the {size} written"
        if check is not None and (now := digest(f)) != check:
            return f"{f} does not match its checksum ({HASH} {now}, {check} written): it changed after the save"
    return None


# ---------------------------------------------------------------------------------- reading


def _reader(path: Path, trust_foreign: bool) -> Any:
    return dcp.FileSystemReader(str(path)) if trust_foreign else SafeFileSystemReader(str(path))


def read_metadata(path: Path, trust_foreign: bool = False) -> Any:
    """A DCP folder's metadata (`UnsafeCheckpoint` when it holds more than DCP's own classes)."""
    return _reader(path, trust_foreign).read_metadata()


def dcp_load(state: dict, path: Path, trust_foreign: bool = False) -> None:
    """`dcp.load` of `state` from `path`, no code run from it unless `trust_foreign`; a refused
    item (on any rank) raises `UnsafeCheckpoint` on every rank, other failures DCP's error."""
    try:
        with _quiet():
            dcp.load(state, storage_reader=_reader(path, trust_foreign))
    except dcp.CheckpointException as e:
        unsafe = [exc for _, (exc, _tb) in sorted(e.failures.items()) if isinstance(exc, UnsafeCheckpoint)]
        if unsafe:
            raise unsafe[0] from None
        raise


def failure_reason(error: BaseException) -> str:
    """One line for a failed DCP read (DCP wraps every rank's error with its traceback)."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        error = sorted(error.failures.items())[0][1][0]
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first}"[:300]


def unsafe_message(e: UnsafeCheckpoint, override: str = f"set {TRUST}") -> str:
    """The one-line refusal of a folder that would run code; `override`: how to load it anyway."""
    return (f"{e.file}: refused, {e.reason}; nothing was loaded or deleted; if you trust who wrote it, "
            f"{override} (loading it can then run code)")
