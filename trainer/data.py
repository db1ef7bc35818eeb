"""The data-parallel, checkpointable data loader over the packed corpus.

- ``load_tokens``: every document of ``[data] path`` (``trainer/sources.py``) tokenized and
  packed into one token stream: ``[BOS] doc EOS [BOS] doc EOS ...`` for a ``tokenizer.json``,
  documents joined by a blank line for the byte tokenizer (``trainer/tokenizer.py``).
- ``TokenWindows``: non-overlapping windows of ``seq_len + 1`` tokens -> (inputs, labels).
- ``DPBatchSampler``: an endless, seeded sample order cut into *global* batches of
  ``local_batch_size x dp_degree x micro_batches`` samples, each delivered as
  ``micro_batches`` micro-batches (gradient accumulation); data-parallel rank r takes the
  r-th slice of each. So a 2-rank run with local batch B sees exactly the global batch of
  a 1-rank run with local batch 2B (or B and 2 micro-batches). It is ``Stateful``; the
  ``StatefulDataLoader`` around it checkpoints it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Optional

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .sources import SHIPPED_CORPUS, DataError, documents_of, iter_documents
from .streaming import PackedStream
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError, build_tokenizer, tokenizer_for

__all__ = ["SHIPPED_CORPUS", "ByteTokenizer", "DPBatchSampler", "DataError", "HFTokenizer", "TokenWindows",
           "TokenizerError", "build_dataloader", "build_tokenizer", "load_corpus", "load_tokens", "tokenizer_for"]

ENCODE_CHUNK = 512  # documents a tokenizer.json encodes at once (its encode_batch runs them in parallel)


def load_corpus(path: str = "", jsonl_field: str = "text") -> str:
    """The text to train on as one string, documents separated by a blank line (what the
    byte tokenizer packs)."""
    return "\n\n".join(iter_documents(path, jsonl_field))


def _encode_all(tokenizer: Tokenizer, docs: Iterable[str]) -> Iterator[list[int]]:
    if not hasattr(tokenizer, "encode_batch"):
        yield from map(tokenizer.encode, docs)
        return
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == ENCODE_CHUNK:
            yield from tokenizer.encode_batch(chunk)
            chunk = []
    if chunk:
        yield from tokenizer.encode_batch(chunk)


def pack_documents(tokenizer: Tokenizer, docs: Iterable[str]) -> torch.Tensor:
    """One token stream: each document with the tokenizer's BOS before it and its separator
    after it (``ends_documents``) or between documents. uint8 for byte ids, else int32."""
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    sep = list(tokenizer.separator)
    pieces: list[torch.Tensor] = []
    for i, ids in enumerate(_encode_all(tokenizer, docs)):
        lead = sep if (i > 0 and not tokenizer.ends_documents) else []
        tail = sep if tokenizer.ends_documents else []
        pieces.append(torch.tensor(lead + bos + ids + tail, dtype=dtype))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)


def load_tokens(data_cfg, tokenizer: Tokenizer) -> torch.Tensor:
    """The packed token stream of ``[data] path`` (the shipped corpus when unset)."""
    return pack_documents(tokenizer, documents_of(data_cfg))


class TokenWindows(Dataset):
    """Sample i = tokens[i*S : i*S + S + 1] split into inputs [S] and labels [S]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"the corpus of {len(tokens)} tokens is shorter than one sample of "
                            f"training.seq_len + 1 = {seq_len + 1} tokens; lower training.seq_len or "
                            f"give [data] path more text")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        s = i * self.seq_len
        w = self.tokens[s: s + self.seq_len + 1].long()
        return w[:-1], w[1:]


class DPBatchSampler:
    """Endless batches of sample indices for one data-parallel rank.

    Epoch e uses a permutation seeded by (seed, e) (or the identity without shuffle),
    cut into global batches of ``local_batch_size * dp_degree * micro_batches``; the tail
    that does not fill a global batch is dropped. A global batch is ``micro_batches``
    consecutive micro-batches of ``local_batch_size * dp_degree``; rank r gets elements
    [r*B, (r+1)*B) of each. State: (epoch, batch index within the epoch, micro-batch index:
    0 at every optimizer step, where checkpoints are taken).
    """

    def __init__(self, num_samples: int, local_batch_size: int, dp_rank: int = 0,
                 dp_degree: int = 1, seed: int = 0, shuffle: bool = True, micro_batches: int = 1):
        self.num_samples = num_samples
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.shuffle = shuffle
        self.micro_batches = micro_batches
        self.micro_global = local_batch_size * dp_degree  # one micro-batch over all data-parallel ranks
        self.global_batch = self.micro_global * micro_batches
        self.batches_per_epoch = num_samples // self.global_batch
        if self.batches_per_epoch < 1:
            micro = f" x {micro_batches} micro-batches" if micro_batches > 1 else ""
            raise DataError(
                f"the corpus has {num_samples} samples, fewer than one global batch of "
                f"{self.global_batch} (local_batch_size {local_batch_size} x "
                f"{dp_degree} data-parallel ranks{micro}); use more text or smaller batches/seq_len")
        self.epoch = 0
        self.batch = 0
        self.micro = 0
        self._perm: Optional[torch.Tensor] = None
        self._perm_epoch = -1

    def _order(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._perm = torch.randperm(self.num_samples, generator=g)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        if self.micro == 0 and self.batch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch = 0
        start = self.batch * self.global_batch + self.micro * self.micro_global + self.dp_rank * self.local_batch_size
        idx = self._order()[start: start + self.local_batch_size].tolist()
        self.micro += 1
        if self.micro == self.micro_batches:
            self.micro = 0
            self.batch += 1
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "micro": self.micro}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self.micro = int(state.get("micro", 0))  # checkpoints before gradient accumulation have none

    def skip_to(self, global_batches_done: int) -> None:
        """Position after ``global_batches_done`` batches (used when a checkpoint has no
        loader state for this rank, e.g. after a change of data-parallel degree)."""
        self.epoch, self.batch = divmod(global_batches_done, self.batches_per_epoch)
        self.micro = 0


def _collate(batch):
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.stack(ys)


def build_dataloader(data_cfg, *, seq_len: int, local_batch_size: int, dp_rank: int = 0,
                     dp_degree: int = 1, seed: int = 0, tokenizer: Optional[Tokenizer] = None,
                     tokens: Optional[torch.Tensor] = None,
                     micro_batches: int = 1) -> StatefulDataLoader | PackedStream:
    """A StatefulDataLoader yielding (inputs [B, S], labels [B, S]) int64 batches for this
    data-parallel rank, forever; with ``micro_batches`` > 1 each is one micro-batch, and
    ``micro_batches`` of them make an optimizer step's global batch (a stream's consecutive
    micro-batches are its consecutive global batches of local x dp: the same windows).
    ``loader.state_dict()`` / ``load_state_dict()`` carry
    the position. ``tokens``: the packed stream when the caller has it (one read for the
    loaders of several sequence lengths). ``[data] streaming``: a PackedStream instead
    (windows packed while reading, corpus order; trainer/streaming.py)."""
    tokenizer = tokenizer or build_tokenizer(data_cfg.tokenizer)
    if getattr(data_cfg, "streaming", False):
        return PackedStream(data_cfg, tokenizer, seq_len=seq_len, local_batch_size=local_batch_size,
                            dp_rank=dp_rank, dp_degree=dp_degree, micro_batches=micro_batches)
    if tokens is None:
        tokens = load_tokens(data_cfg, tokenizer)
    ds = TokenWindows(tokens, seq_len)
    sampler = DPBatchSampler(len(ds), local_batch_size, dp_rank, dp_degree, seed,
                             shuffle=data_cfg.shuffle, micro_batches=micro_batches)
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(ds, batch_sampler=sampler, collate_fn=_collate,
                                  num_workers=data_cfg.num_workers)
