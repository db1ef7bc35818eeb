"""Tokenizer, corpus and the data-parallel, checkpointable data loader.

- ``ByteTokenizer``: UTF-8 bytes, vocabulary 256.
- ``load_corpus``: the shipped ``data/corpus.txt`` or the user's .txt / .jsonl files.
- ``TokenWindows``: non-overlapping windows of ``seq_len + 1`` tokens -> (inputs, labels).
- ``DPBatchSampler``: an endless, seeded sample order cut into *global* batches of
  ``local_batch_size x dp_degree`` samples; data-parallel rank r takes the r-th slice.
  So a 2-rank run with local batch B sees exactly the global batch of a 1-rank run with
  local batch 2B. It is ``Stateful``; the ``StatefulDataLoader`` around it checkpoints it.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

SHIPPED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"


class DataError(ValueError):
    """Text that cannot feed the configured batches (the trainer reports it as a config
    error naming its file)."""


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_to_tensor(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def build_tokenizer(name: str):
    if name == "byte":
        return ByteTokenizer()
    raise DataError(f"unknown tokenizer {name!r}; available: byte")


def _read_file(path: Path, jsonl_field: str) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
                if not isinstance(rec, dict) or jsonl_field not in rec:
                    raise DataError(f"{path}:{lineno}: no '{jsonl_field}' field "
                                     f"(set [data] jsonl_field)")
                docs.append(str(rec[jsonl_field]))
        return docs
    return [path.read_text(encoding="utf-8", errors="replace")]


def load_corpus(path: str = "", jsonl_field: str = "text") -> str:
    """The text to train on: the shipped corpus, a file, or a folder of .txt/.jsonl files
    (read in sorted order). Documents are separated by a blank line."""
    if not path:
        return SHIPPED_CORPUS.read_text(encoding="utf-8")
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl") and f.is_file())
        if not files:
            raise DataError(f"[data] path {path!r}: no .txt or .jsonl files in the folder")
    elif p.is_file():
        files = [p]
    else:
        raise DataError(f"[data] path {path!r}: no such file or folder")
    docs = []
    for f in files:
        docs += _read_file(f, jsonl_field)
    return "\n\n".join(docs)


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
    cut into global batches of ``local_batch_size * dp_degree``; the tail that does not
    fill a global batch is dropped. Rank r gets elements [r*B, (r+1)*B) of each global
    batch. State: (epoch, batch index within the epoch).
    """

    def __init__(self, num_samples: int, local_batch_size: int, dp_rank: int = 0,
                 dp_degree: int = 1, seed: int = 0, shuffle: bool = True):
        self.num_samples = num_samples
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch = local_batch_size * dp_degree
        self.batches_per_epoch = num_samples // self.global_batch
        if self.batches_per_epoch < 1:
            raise DataError(
                f"the corpus has {num_samples} samples, fewer than one global batch of "
                f"{self.global_batch} (local_batch_size {local_batch_size} x "
                f"{dp_degree} data-parallel ranks); use more text or smaller batches/seq_len")
        self.epoch = 0
        self.batch = 0
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
        if self.batch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch = 0
        start = self.batch * self.global_batch + self.dp_rank * self.local_batch_size
        idx = self._order()[start: start + self.local_batch_size].tolist()
        self.batch += 1
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])

    def skip_to(self, global_batches_done: int) -> None:
        """Position after ``global_batches_done`` batches (used when a checkpoint has no
        loader state for this rank, e.g. after a change of data-parallel degree)."""
        self.epoch, self.batch = divmod(global_batches_done, self.batches_per_epoch)


def _collate(batch):
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.stack(ys)


def build_dataloader(data_cfg, *, seq_len: int, local_batch_size: int, dp_rank: int = 0,
                     dp_degree: int = 1, seed: int = 0, tokenizer=None
                     ) -> StatefulDataLoader:
    """A StatefulDataLoader yielding (inputs [B, S], labels [B, S]) int64 batches for this
    data-parallel rank, forever. ``loader.state_dict()`` / ``load_state_dict()`` carry
    the position."""
    tokenizer = tokenizer or build_tokenizer(data_cfg.tokenizer)
    text = load_corpus(data_cfg.path, data_cfg.jsonl_field)
    tokens = tokenizer.encode_to_tensor(text)
    ds = TokenWindows(tokens, seq_len)
    sampler = DPBatchSampler(len(ds), local_batch_size, dp_rank, dp_degree, seed,
                             shuffle=data_cfg.shuffle)
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(ds, batch_sampler=sampler, collate_fn=_collate,
                                  num_workers=data_cfg.num_workers)
