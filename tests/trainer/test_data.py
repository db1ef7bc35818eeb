"""Tokenizer, corpus, DP-sharded stateful loader."""

import json

import torch

from trainer.config import Data
from trainer.data import SHIPPED_CORPUS, ByteTokenizer, DPBatchSampler, build_dataloader, load_corpus


def test_shipped_corpus_and_byte_tokenizer():
    text = load_corpus()
    assert SHIPPED_CORPUS.is_file() and 200_000 < len(text.encode()) < 2_000_000
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert tok.vocab_size == 256 and max(ids) < 256 and tok.decode(ids) == "héllo"
    assert torch.equal(tok.encode_to_tensor("ab"), torch.tensor([97, 98], dtype=torch.uint8))


def test_samples_are_shifted_windows():
    dl = build_dataloader(Data(shuffle=False), seq_len=16, local_batch_size=2)
    x, y = next(iter(dl))
    assert x.shape == y.shape == (2, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    raw = torch.tensor(list(load_corpus().encode()[:17]))
    assert torch.equal(x[0], raw[:16]) and torch.equal(y[0], raw[1:17])


def test_dp_ranks_partition_the_global_batch():
    cfg = Data()
    one = iter(build_dataloader(cfg, seq_len=32, local_batch_size=4, seed=3))
    ranks = [iter(build_dataloader(cfg, seq_len=32, local_batch_size=2, dp_rank=r,
                                   dp_degree=2, seed=3)) for r in range(2)]
    for _ in range(3):
        x1, _ = next(one)
        parts = [next(it)[0] for it in ranks]
        assert torch.equal(x1, torch.cat(parts))
        assert not torch.equal(parts[0], parts[1])


def test_loader_state_resumes_exactly():
    cfg = Data()
    dl = build_dataloader(cfg, seq_len=32, local_batch_size=4, seed=1)
    it = iter(dl)
    for _ in range(5):
        next(it)
    state = dl.state_dict()
    expect = [next(it)[0] for _ in range(3)]
    dl2 = build_dataloader(cfg, seq_len=32, local_batch_size=4, seed=1)
    dl2.load_state_dict(state)
    it2 = iter(dl2)
    got = [next(it2)[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expect, got))


def test_sampler_is_endless_and_reshuffles_each_epoch():
    s = DPBatchSampler(10, 3, seed=0)
    assert s.batches_per_epoch == 3
    first = [next(s) for _ in range(3)]
    second = [next(s) for _ in range(3)]
    assert s.epoch == 1 and first != second
    s2 = DPBatchSampler(10, 3, seed=0)
    s2.skip_to(3)
    assert next(s2) == second[0]


def test_user_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 10})
                                                 for i in range(5)) + "\n")
    text = load_corpus(str(tmp_path))
    assert text.startswith("hello world") and "doc 4" in text
    only = load_corpus(str(tmp_path / "b.jsonl"))
    assert "hello" not in only and only.count("doc 0") == 10
    dl = build_dataloader(Data(path=str(tmp_path / "a.txt")), seq_len=8, local_batch_size=2)
    x, _ = next(iter(dl))
    assert ByteTokenizer().decode(x[0].tolist()) in ("hello world " * 3)
