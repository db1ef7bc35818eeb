"""[data] path over real files: folders and globs of .txt/.jsonl/.parquet/.csv, packing with EOS,
data-parallel shards, the exact resume position (also through a DCP checkpoint), bad data as one
error naming the file and the line or row."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from bpe_helpers import save_bpe_with_template
from trainer_helpers import FAST, read_losses

import train
from trainer.config import Data, load_config
from trainer.data import ByteTokenizer, DataError, HFTokenizer, build_dataloader, load_tokens
from trainer.errors import ConfigError
from trainer.sources import documents_of, iter_documents, list_files
from trainer.trainer import Trainer

TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--training.seq_len", "16", "--training.local_batch_size", "2"]


def _docs(prefix: str, n: int) -> list[str]:
    return [f"{prefix} document {i}: " + "lorem ipsum dolor sit amet " * (3 + i % 4) for i in range(n)]


def _write_parquet(path, docs, field="text", row_group_size=4):
    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path, row_group_size=row_group_size)


@pytest.fixture
def corpus(tmp_path):
    """A folder of every kind: a/ b.jsonl c.parquet d.csv e.txt (sorted order a.txt, b, c, d, e)."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("the first text file\nwith two lines")
    (root / "b.jsonl").write_text("\n".join(json.dumps({"text": d, "meta": 1}) for d in _docs("jsonl", 6)) + "\n\n")
    _write_parquet(root / "c.parquet", _docs("parquet", 10))
    (root / "d.csv").write_text("id,text\n" + "".join(f'{i},"{d}"\n' for i, d in enumerate(_docs("csv", 3))))
    (root / "sub" / "e.txt").write_text("nested text file")
    (root / "notes.md").write_text("not data")
    return root


def test_folder_reads_every_kind_in_sorted_order(corpus):
    names = [f.relative_to(corpus).as_posix() for f in list_files(str(corpus))]
    assert names == ["a.txt", "b.jsonl", "c.parquet", "d.csv", "sub/e.txt"]
    docs = list(iter_documents(str(corpus)))
    assert docs == ["the first text file\nwith two lines", *_docs("jsonl", 6), *_docs("parquet", 10),
                    *_docs("csv", 3), "nested text file"]
    assert list(iter_documents(str(corpus / "*.parquet"))) == _docs("parquet", 10)  # a glob
    assert [f.name for f in list_files(str(corpus / "**" / "*.txt"))] == ["a.txt", "e.txt"]


def test_text_field_applies_to_jsonl_and_parquet(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "from jsonl"}) + "\n")
    _write_parquet(tmp_path / "y.parquet", ["from parquet"], field="body")
    assert list(iter_documents(str(tmp_path), "body")) == ["from jsonl", "from parquet"]


def test_packing_separates_documents_with_eos(corpus, tmp_path):
    tok = HFTokenizer(str(save_bpe_with_template(tmp_path / "tokenizer.json", 300)))
    tokens = load_tokens(Data(path=str(corpus / "b.jsonl")), tok).tolist()
    expect = []
    for d in _docs("jsonl", 6):
        expect += [0, *tok.encode(d), 1]
    assert tokens == expect
    byte = load_tokens(Data(path=str(corpus / "**" / "*.txt")), ByteTokenizer())  # byte: a blank line between
    assert bytes(byte.tolist()) == b"the first text file\nwith two lines\n\nnested text file"


def test_dp_shards_partition_and_resume_at_the_exact_sample(corpus):
    cfg = Data(path=str(corpus))
    one = build_dataloader(cfg, seq_len=8, local_batch_size=4, seed=5)
    it = iter(one)
    ranks = [iter(build_dataloader(cfg, seq_len=8, local_batch_size=2, dp_rank=r, dp_degree=2, seed=5))
             for r in range(2)]
    for _ in range(3):
        x, _ = next(it)
        parts = [next(r)[0] for r in ranks]
        assert torch.equal(x, torch.cat(parts)) and not torch.equal(parts[0], parts[1])
    state = one.state_dict()
    expect = [next(it) for _ in range(4)]
    again = build_dataloader(cfg, seq_len=8, local_batch_size=4, seed=5)
    again.load_state_dict(state)
    got = list(zip(range(4), iter(again)))
    assert all(torch.equal(a[0], b[1][0]) and torch.equal(a[1], b[1][1]) for a, b in zip(expect, got))


@pytest.mark.parametrize("streaming", [False, True])
def test_checkpoint_resume_reads_the_next_sample(corpus, tmp_path, streaming):
    """4 steps in one run == 2 steps, a DCP checkpoint, 2 more steps (loader state in the checkpoint)."""
    tok = save_bpe_with_template(tmp_path / "tokenizer.json", 300)
    base = FAST + TINY + ["--job.dump_folder", str(tmp_path), "--data.path", str(corpus),
                          "--model.tokenizer_path", str(tok), "--lr_scheduler.decay_steps", "4"]
    if streaming:
        base += ["--data.streaming", "true", "--data.shuffle", "false"]
    full = Trainer(load_config("llama3_debug", base + ["--job.name", "full", "--training.steps", "4"],
                               world_size=1)).train()
    ck = base + ["--job.name", "split", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    first = Trainer(load_config("llama3_debug", ck + ["--training.steps", "2"], world_size=1)).train()
    second = Trainer(load_config("llama3_debug", ck + ["--training.steps", "4"], world_size=1)).train()
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    assert {**first, **second} == full and read_losses(tmp_path, "split") == full


@pytest.mark.parametrize("kind, write, where", [
    ("empty txt", lambda p: (p / "a.txt").write_text("  \n"), r"a.txt: empty file"),
    ("empty jsonl", lambda p: (p / "a.jsonl").write_text("\n\n"), r"a.jsonl: empty file \(no JSON lines\)"),
    ("undecodable", lambda p: (p / "a.txt").write_bytes(b"ok\nok\nbad \xff byte\n"),
     r"a.txt:3: undecodable bytes \(invalid start byte at byte 10\)"),
    ("jsonl field", lambda p: (p / "a.jsonl").write_text('{"text": "x"}\n\n{"body": "y"}\n'),
     r"a.jsonl:3: no 'text' field \(it has 'body'\); set \[data\] jsonl_field"),
    ("jsonl type", lambda p: (p / "a.jsonl").write_text('{"text": ["x"]}\n'), r"a.jsonl:1: 'text' is list, not text"),
    ("bad json", lambda p: (p / "a.jsonl").write_text('{"text": "x"}\n{oops\n'), r"a.jsonl:2: not valid JSON"),
    ("parquet column", lambda p: _write_parquet(p / "a.parquet", ["x"], field="body"),
     r"a.parquet: no 'text' column \(columns: body, id\)"),
    ("parquet null", lambda p: _write_parquet(p / "a.parquet", ["x", "y", None, "z"], row_group_size=2),
     r"a.parquet: row 2: 'text' is null"),
    ("parquet empty", lambda p: _write_parquet(p / "a.parquet", []), r"a.parquet: empty file \(no rows\)"),
    ("not parquet", lambda p: (p / "a.parquet").write_text("PAR? no"), r"a.parquet: not a readable parquet file"),
    ("csv column", lambda p: (p / "a.csv").write_text("id,body\n1,x\n"),
     r"a.csv: row 0: no 'text' field \(it has 'id', 'body'\); set \[data\] jsonl_field to the column"),
])
def test_bad_data_is_one_error_naming_file_and_line(tmp_path, kind, write, where):
    write(tmp_path)
    with pytest.raises(DataError, match=where) as e:
        load_tokens(Data(path=str(tmp_path)), ByteTokenizer())
    assert e.value.key == "data.path" and "\n" not in str(e.value)


def test_bad_data_stops_the_job_before_step_one(tmp_path, capsys):
    """train.py: one line, exit 2, naming the key, the file and the line (no step ran)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    rc = train.main(["--config", "llama3_debug", *FAST, *TINY, "--job.dump_folder", str(tmp_path),
                     "--data.path", str(tmp_path / "data")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("config error: ") and f"'data.path' = '{tmp_path / 'data'}': " in err[0]
    assert f"{tmp_path / 'data' / 'a.jsonl'}:2: no 'text' field (it has 'txt')" in err[0]
    assert not (tmp_path / "run" / "losses.json").exists()


def test_glob_without_matches_and_unknown_file_kind(tmp_path):
    with pytest.raises(DataError, match=r"the pattern matches no"):
        list_files(str(tmp_path / "*.jsonl"))
    (tmp_path / "x.md").write_text("x")
    with pytest.raises(DataError, match=r"unknown file kind '.md'"):
        list_files(str(tmp_path / "x.md"))
    cfg = load_config("llama3_debug", ["--data.path", str(tmp_path / "*.jsonl")], world_size=1)  # checked when read
    with pytest.raises(ConfigError, match=r"'data.path' = .*the pattern matches no"):
        Trainer(cfg)


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_streaming_packs_the_in_memory_windows_in_order(corpus, tmp_path):
    tok = HFTokenizer(str(save_bpe_with_template(tmp_path / "tokenizer.json", 300)))
    mem, stream = Data(path=str(corpus), shuffle=False), Data(path=str(corpus), shuffle=False, streaming=True)
    n = len(load_tokens(mem, tok)) // (8 * 6) - 1  # global batches of the first epoch
    one = _batches(build_dataloader(mem, seq_len=8, local_batch_size=6, tokenizer=tok), n)
    for r in range(2):
        got = _batches(build_dataloader(stream, seq_len=8, local_batch_size=3, dp_rank=r, dp_degree=2,
                                        tokenizer=tok), n)
        for (x, y), (xs, ys) in zip(one, got):
            assert torch.equal(x[3 * r: 3 * r + 3], xs) and torch.equal(y[3 * r: 3 * r + 3], ys)


def test_streaming_resumes_at_the_exact_window(corpus):
    cfg = Data(path=str(corpus), shuffle=False, streaming=True)
    n = len(load_tokens(cfg, ByteTokenizer())) // 24 + 2  # into the second epoch
    dl = build_dataloader(cfg, seq_len=8, local_batch_size=3)
    it = iter(dl)
    for _ in range(n):
        next(it)
    state = dl.state_dict()
    assert state["epoch"] == 1 and state["batches"] == n
    expect = [next(it) for _ in range(3)]
    again = build_dataloader(cfg, seq_len=8, local_batch_size=3)
    again.load_state_dict(state)
    skipped = build_dataloader(cfg, seq_len=8, local_batch_size=3)
    skipped.batch_sampler.skip_to(n)  # a checkpoint without this rank's state
    for loader in (again, skipped):
        got = _batches(loader, 3)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expect, got))
    with pytest.raises(ConfigError, match="not a streamed corpus position"):
        again.load_state_dict({"epoch": 0, "batch": 3})


def test_streaming_checks_first_documents_before_step_one_and_the_rest_when_read(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs("ok", 40))
                                      + '{"body": "late"}\n')
    cfg = Data(path=str(tmp_path), shuffle=False, streaming=True)
    dl = build_dataloader(cfg, seq_len=8, local_batch_size=8)  # the first document is fine
    with pytest.raises(DataError, match=r"a.jsonl:41: no 'text' field"):
        _batches(dl, 200)
    job = load_config("llama3_debug", FAST + TINY + ["--job.dump_folder", str(tmp_path), "--data.path", str(tmp_path),
                                                     "--data.streaming", "true", "--data.shuffle", "false",
                                                     "--training.steps", "200"], world_size=1)
    with pytest.raises(ConfigError, match=r"'data.path' = .*a.jsonl:41: no 'text' field .*\(read at step \d+: "):
        Trainer(job).train()  # the job ends with the one-line error where the stream reaches the row
    (tmp_path / "b.jsonl").write_text('{"txt": "first"}\n')
    with pytest.raises(DataError, match=r"b.jsonl:1: no 'text' field"):
        build_dataloader(cfg, seq_len=8, local_batch_size=2)
    with pytest.raises(ConfigError, match=r"'data.shuffle' = True: a streamed corpus .* is read in order"):
        load_config("llama3_debug", ["--data.streaming", "true"], world_size=1)


def test_dataset_builder_reads_through_load_dataset(tmp_path):
    """[data] dataset_builder: a builder over the path's files, or 'auto' for a local dataset folder."""
    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "a.txt").write_text("line one\nline two\n")
    assert list(documents_of(Data(path=str(tmp_path / "lines"), dataset_builder="text"))) == ["line one", "line two"]
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps({"body": f"train {i}"}) + "\n" for i in range(3)))
    (ds / "test.jsonl").write_text(json.dumps({"body": "held out"}) + "\n")
    auto = Data(path=str(ds), dataset_builder="auto", jsonl_field="body")
    assert list(documents_of(auto)) == ["train 0", "train 1", "train 2"]
    assert list(documents_of(Data(path=str(ds), dataset_builder="auto", jsonl_field="body", split="test"))) == [
        "held out"]
    with pytest.raises(DataError, match=r"\(split 'train'\): row 0: no 'text' field \(it has 'body'\)"):
        list(documents_of(Data(path=str(ds), dataset_builder="auto")))
    with pytest.raises(ConfigError, match=r"'data.dataset_builder' = 'jsonnn': not a datasets builder"):
        load_config("llama3_debug", ["--data.path", str(ds), "--data.dataset_builder", "jsonnn"], world_size=1)
