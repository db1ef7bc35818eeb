"""A Hugging Face tokenizer.json as [model] tokenizer_path: built here from the shipped corpus
with `tokenizers` (no hub, no network); round trips, BOS/EOS, packing, config errors, training."""

import json

import pytest
import torch
from bpe_helpers import save_bpe_with_template
from trainer_helpers import FAST

from trainer.config import Data, load_config
from trainer.data import SHIPPED_CORPUS, HFTokenizer, TokenizerError, build_dataloader, load_tokens, pack_documents
from trainer.errors import ConfigError
from trainer.tokenizer import tokenizer_vocab
from trainer.trainer import Trainer

VOCAB = 400
TINY = ["--model.n_layers", "1", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--training.seq_len", "32", "--training.local_batch_size", "2"]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A BPE tokenizer.json with <s>/</s> placed by its post-processor (ids 0 and 1)."""
    return save_bpe_with_template(tmp_path_factory.mktemp("tok") / "tokenizer.json", VOCAB)


def _variant(bpe_path, tmp_path, specials: list[str], name="tokenizer.json"):
    """The same BPE without post-processor, its added tokens replaced by `specials` (ids after the vocab)."""
    spec = json.loads(bpe_path.read_text())
    spec["post_processor"] = None
    base = spec["model"]["vocab"]
    start = max(base.values()) + 1
    spec["added_tokens"] = [{"id": start + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, s in enumerate(specials)]
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return path


def test_round_trip_and_special_tokens(bpe_path):
    tok = HFTokenizer(str(bpe_path))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.separator) == (VOCAB, 0, 1, [1])
    for text in ["Beautiful is better than ugly.\n\nExplicit", "héllo wörld — ünïcode ✓", "  two  spaces\ttab"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(2 <= i < VOCAB for i in ids)  # no specials from encode
    assert len(tok.encode("Beautiful is better than ugly.")) < len("Beautiful is better than ugly.")  # merges


def test_packing_puts_bos_and_eos_around_each_document(bpe_path):
    tok = HFTokenizer(str(bpe_path))
    packed = pack_documents(tok, ["one doc", "two"])
    a, b = tok.encode("one doc"), tok.encode("two")
    assert packed.tolist() == [0, *a, 1, 0, *b, 1] and packed.dtype == torch.int32


def test_specials_from_added_tokens_config_and_tokenizer_config(bpe_path, tmp_path):
    gpt2 = HFTokenizer(str(_variant(bpe_path, tmp_path, ["<|endoftext|>"])))
    assert gpt2.eos_id == VOCAB and gpt2.bos_id is None  # one token ends and starts: EOS only
    two = _variant(bpe_path, tmp_path, ["<s>", "</s>", "<eos>"])
    with pytest.raises(TokenizerError, match=r"EOS is ambiguous: special tokens </s>, <eos>; set \[model\] eos_token"):
        HFTokenizer(str(two))
    chosen = HFTokenizer(str(two), eos_token="<eos>")
    assert (chosen.bos_id, chosen.eos_id) == (0, chosen.token_to_id("<eos>")) and chosen.eos_id >= VOCAB
    with pytest.raises(TokenizerError, match="'model.bos_token' = '<nope>' is not a token"):
        HFTokenizer(str(two), bos_token="<nope>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert HFTokenizer(str(two)).eos_id == 1  # "</s>": the Hugging Face layout's own choice
    (tmp_path / "bare").mkdir()
    none = _variant(bpe_path, tmp_path / "bare", ["<pad>"])
    with pytest.raises(TokenizerError, match="no EOS token found.*set \\[model\\] eos_token"):
        HFTokenizer(str(none))


def test_config_errors_name_file_keys_and_numbers(bpe_path, tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ConfigError, match=rf"'model.tokenizer_path' = '{bad}': not a Hugging Face tokenizer.json"):
        load_config("llama3_debug", ["--model.tokenizer_path", str(bad)], world_size=1)
    with pytest.raises(ConfigError, match=r"'model.vocab_size' = 300: smaller than the vocabulary of 400 tokens of "
                                          r"'model.tokenizer_path'.*model.vocab_size >= 400"):
        load_config("llama3_debug", ["--model.tokenizer_path", str(bpe_path), "--model.vocab_size", "300"],
                    world_size=1)
    # what the dry run sizes the embedding with when vocab_size = -1 (0: the flavor's)
    assert tokenizer_vocab(load_config("llama3_debug", ["--model.tokenizer_path", str(bpe_path)], world_size=1)) == 400
    assert tokenizer_vocab(load_config("llama3_debug", [], world_size=1)) == 0
    with pytest.raises(ConfigError, match="'model.eos_token' = '</s>': needs model.tokenizer_path"):
        load_config("llama3_debug", ["--model.eos_token", "</s>"], world_size=1)


def test_loader_windows_are_the_packed_corpus(bpe_path):
    tok = HFTokenizer(str(bpe_path))
    tokens = load_tokens(Data(), tok)
    assert tokens[0] == 0 and tokens[-1] == 1 and tokens.max() < VOCAB
    assert tok.decode(tokens[1:-1].tolist()) == SHIPPED_CORPUS.read_text(encoding="utf-8")
    x, y = next(iter(build_dataloader(Data(shuffle=False), seq_len=16, local_batch_size=2, tokenizer=tok)))
    assert x[0].tolist() == tokens[:16].tolist() and y[1].tolist() == tokens[17:33].tolist()


def test_trains_a_few_steps_with_the_tokenizer(bpe_path, tmp_path):
    cfg = load_config("llama3_debug", FAST + TINY + ["--job.dump_folder", str(tmp_path), "--training.steps", "6",
                                                     "--data.shuffle", "false", "--optimizer.lr", "1e-2",
                                                     "--model.tokenizer_path", str(bpe_path)], world_size=1)
    tr = Trainer(cfg)
    assert tr.model_args.vocab_size == VOCAB and tr.model.tok_embeddings.weight.shape[0] == VOCAB
    losses = tr.train()
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert abs(losses[1] - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5  # ~uniform over 400 ids at init
    assert losses[6] < losses[1] - 0.5
