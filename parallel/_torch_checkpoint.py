"""The private torch APIs that read a DCP folder without running its code: `.metadata` through
an unpickler that admits DCP's own metadata classes only, non-tensor items through
`torch.load(weights_only=True)`. Part of the torch adapter (`parallel/_torch.py` re-exports
these; the layering test allows private torch APIs in the adapter's files only)."""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader


class UnsafeCheckpoint(Exception):
    """A DCP folder holds a pickle that could run code (a class other than DCP's own in
    `.metadata`, or a non-tensor item that `torch.load(weights_only=True)` refuses).
    `file` is the file, `reason` what it holds; picklable (DCP gathers every rank's errors)."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(file, reason)
        self.file, self.reason = file, reason

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


def _dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """What a DCP `.metadata` pickles (torch 2.13's `Metadata`): DCP's metadata classes,
    `_StorageInfo`, torch.Size, dtypes, layouts and memory formats, paths, OrderedDict."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.serialization import _get_layout

    objs = [md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
            md.TensorProperties, md.MetadataIndex, md.StorageMeta, md._MEM_FORMAT_ENCODING, _StorageInfo,
            _get_layout, torch.Size, collections.OrderedDict, pathlib.PosixPath, pathlib.PurePosixPath,
            pathlib.WindowsPath, pathlib.PureWindowsPath, set, frozenset]
    out = {(o.__module__, o.__qualname__): o for o in objs}
    for name, v in vars(torch).items():  # torch.float32, torch.strided, torch.contiguous_format, ...
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            out[("torch", name)] = v
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global is refused before it is imported."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path
        self.allowed = _dcp_metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        obj = self.allowed.get((module, name))
        if obj is None:
            raise UnsafeCheckpoint(self.path, f"it names {module}.{name}, which is not one of DCP's metadata "
                                              "classes (unpickling it could run code)")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(self.path, "it holds a persistent reference, which DCP metadata never has")


class _WeightsOnlyBytes:
    """A DCP load planner whose non-tensor items are read with `torch.load(weights_only=True)`
    (DCP's own planner unpickles them in full); what passes is saved again and handed on."""

    def __init__(self, planner: Any, reader: Any) -> None:
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        info = self._reader.storage_data[read_item.storage_index]
        file = str(self._reader.fs.concat_path(self._reader.path, info.relative_path))
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL (\S+)", str(e))
            why = f"it names {named.group(1)}" if named else "torch.load(weights_only=True) refuses it"
            raise UnsafeCheckpoint(file, f"item {read_item.dest_index.fqn} is not plain data ({why}; unpickling it "
                                         "could run code)") from None
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        self._planner.load_bytes(read_item, again)


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader that runs no code from the folder: `.metadata` is read by an
    unpickler that admits DCP's metadata classes only, non-tensor items with
    `torch.load(weights_only=True)` (tensors already are). Refusals raise `UnsafeCheckpoint`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(str(path), f"it holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _WeightsOnlyBytes(planner, self))
