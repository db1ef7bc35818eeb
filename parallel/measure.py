"""Measuring tools for tests, benchmarks and the dry run: what a run allocates, seen from
torch's dispatcher (independent of the planner's memory estimate).

    with MemoryTracker() as mem:
        loss = model(x).sum(); loss.backward()
    print(mem.peak)          # bytes of tensor storages live at the worst op
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from parallel import _torch as T

__all__ = ["MemoryTracker"]


class MemoryTracker(T.TorchDispatchMode):
    """Live bytes of tensor storages created by ops run under this mode, and their peak.

    Works on real, meta and fake tensors (it reads ``untyped_storage().nbytes()``; a
    DTensor counts its local shard); views share their base's storage and are counted
    once; a storage is released when its last reference dies. Storages resized in place
    (FSDP2 frees and re-allocates its unsharded parameters with ``storage.resize_``,
    which no dispatch mode sees; they come from ``empty``-like ops) are re-measured at
    every op, so the peak is exact at op granularity. Tensors that existed before
    entering (parameters, inputs) are not counted once passed to ``exclude`` (otherwise
    their storage counts from the first op that takes a view of them).
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, counted bytes]
        self._watch: dict[int, list] = {}  # resizable storages (outputs of empty-like ops)
        self.current = 0
        self.peak = 0

    def _add(self, t: torch.Tensor, watch: bool) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # storage-less subclasses
            return
        key = id(st)
        if key in self._live:
            return

        def _free(_ref, key=key, self_ref=weakref.ref(self)):
            me = self_ref()
            if me is not None:
                entry = me._live.pop(key, None)
                me._watch.pop(key, None)
                if entry is not None:
                    me.current -= entry[1]

        n = st.nbytes()
        entry = [weakref.ref(st, _free), n]
        self._live[key] = entry
        if watch:
            self._watch[key] = entry
        self.current += n

    def exclude(self, tensors: Any) -> None:
        """Storages that exist before the measured region (parameters, optimizer states,
        inputs): views and in-place ops on them under this mode are not new memory."""
        for t in T.tree_flatten(tensors)[0]:
            if isinstance(t, DTensor):
                t = t.to_local()
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self._live.setdefault(id(st), [weakref.ref(st), 0])

    def _refresh(self) -> None:
        """Re-measure the storages that can be resized in place (FSDP2's buffers come
        from ``empty``-like ops); compute outputs keep their size for life."""
        for entry in self._watch.values():
            st = entry[0]()
            if st is not None:
                n = st.nbytes()
                if n != entry[1]:
                    self.current += n - entry[1]
                    entry[1] = n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops + collectives first
        out = func(*args, **(kwargs or {}))
        watch = "empty" in T.op_name(func)
        for t in T.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, watch)
        self._refresh()
        if self.current > self.peak:
            self.peak = self.current
        return out
