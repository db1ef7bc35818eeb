"""``[data] streaming = true``: windows packed on the fly, for corpora that do not fit in memory.

The documents of ``[data] path`` are read in order (``trainer/sources.py``), tokenized and
packed exactly as the in-memory loader packs them (``[BOS] doc EOS``, or a blank line between
documents for the byte tokenizer), and cut into windows of ``seq_len + 1`` tokens (window k
starts at token k * seq_len). Window order is the corpus order (no shuffle); global batch g
is windows [g * G, (g + 1) * G) with G = local batch x data-parallel ranks, and rank r takes
its r-th slice -- the in-memory loader's split with ``shuffle = false``. When the corpus ends
the next epoch starts over, packing on.

The position is the next unread token: (epoch, document index, token offset in it), the same
on every rank. It is the loader's state in the checkpoint, so a resumed job re-reads (without
tokenizing) the documents before it and continues at the exact window.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import torch

from .errors import ConfigError
from .sources import DataError, documents_of, first_documents
from .tokenizer import Tokenizer


class PackedStream:
    """An endless (inputs [B, S], labels [B, S]) int64 batch stream for one data-parallel rank,
    with ``state_dict`` / ``load_state_dict`` like the in-memory loader's."""

    def __init__(self, data_cfg, tokenizer: Tokenizer, *, seq_len: int, local_batch_size: int,
                 dp_rank: int = 0, dp_degree: int = 1, micro_batches: int = 1):
        self.data_cfg = data_cfg
        self.micro_batches = micro_batches  # an optimizer step reads this many of its global batches
        self.tokenizer = tokenizer
        self.seq_len, self.local_batch_size, self.dp_rank = seq_len, local_batch_size, dp_rank
        self.global_batch = local_batch_size * dp_degree
        self.epoch = self.doc = self.offset = 0
        self.batches_done = 0
        self.batch_sampler = self  # what a checkpoint without this rank's state positions (skip_to)
        first_documents(data_cfg)  # every file opens and has its first document before step 1
        next(self._batches(0, 0, 0))  # the first global batch fits (errors before any step)

    # --------------------------------------------------------------- reading

    def _doc_tokens(self, epoch: int, i: int, text: str) -> list[int]:
        tok = self.tokenizer
        lead = tok.separator if ((i or epoch) and not tok.ends_documents) else []
        bos = [] if tok.bos_id is None else [tok.bos_id]
        return lead + bos + tok.encode(text) + (tok.separator if tok.ends_documents else [])

    def _tokens_from(self, epoch: int, doc: int, offset: int, need: int) -> Iterator[tuple[int, int, int, list[int]]]:
        """(epoch, doc index, offset, tokens) chunks from the position on, epoch after epoch; an
        epoch of fewer than ``need`` tokens (one global batch) is a DataError."""
        while True:
            n = 0
            for i, text in enumerate(islice(documents_of(self.data_cfg), doc, None), doc):
                ids = self._doc_tokens(epoch, i, text)
                n += len(ids)
                if offset < len(ids):
                    yield epoch, i, offset, ids[offset:]
                offset = 0
            if doc == 0 and n < need:
                raise DataError(f"the corpus of {n} tokens is shorter than one global batch of {self.global_batch} "
                                f"windows of training.seq_len + 1 = {self.seq_len + 1} tokens ({need}); use more "
                                f"text or smaller batches/seq_len")
            epoch, doc = epoch + 1, 0

    def _batches(self, epoch: int, doc: int, offset: int) -> Iterator[tuple[torch.Tensor, tuple[int, int, int]]]:
        """(this rank's windows [B, S + 1], the position after the global batch)."""
        need = self.global_batch * self.seq_len + 1
        buf: list[int] = []
        segs: list[list[int]] = []  # [epoch, doc, offset of buf's piece of it, length] per document in buf
        tokens = self._tokens_from(epoch, doc, offset, need)
        while True:
            while len(buf) < need:
                e, i, off, ids = next(tokens)
                segs.append([e, i, off, len(ids)])
                buf += ids
            lo = self.dp_rank * self.local_batch_size * self.seq_len
            w = torch.tensor(buf[lo: lo + self.local_batch_size * self.seq_len + 1], dtype=torch.long)
            windows = w.unfold(0, self.seq_len + 1, self.seq_len)
            used = self.global_batch * self.seq_len
            buf = buf[used:]
            while used:  # advance the position by the tokens consumed
                take = min(used, segs[0][3])
                segs[0][2] += take
                segs[0][3] -= take
                used -= take
                if segs[0][3] == 0:
                    segs.pop(0)
            yield windows, (segs[0][0], segs[0][1], segs[0][2])  # >= 1 token is left: segs is not empty

    # --------------------------------------------------------------- the loader's face

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for windows, (self.epoch, self.doc, self.offset) in self._batches(self.epoch, self.doc, self.offset):
            self.batches_done += 1
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "doc": self.doc, "offset": self.offset, "batches": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        if "doc" not in state:
            raise ConfigError(f"'data.streaming' = true: the checkpoint's loader state {sorted(state)} is not a "
                              f"streamed corpus position (written with [data] streaming = false); resume with the "
                              f"same [data] streaming")
        self.epoch, self.doc, self.offset = int(state["epoch"]), int(state["doc"]), int(state["offset"])
        self.batches_done = int(state["batches"])

    def skip_to(self, global_batches_done: int) -> None:
        """Position after ``global_batches_done`` optimizer steps' batches from the start (a checkpoint
        with no state for this rank): re-reads and re-packs the corpus up to there."""
        self.epoch = self.doc = self.offset = 0
        self.batches_done = 0
        if global_batches_done:
            batches = self._batches(0, 0, 0)
            for _ in range(global_batches_done * self.micro_batches):
                _, (self.epoch, self.doc, self.offset) = next(batches)
        self.batches_done = global_batches_done * self.micro_batches
