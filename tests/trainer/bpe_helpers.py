"""A small BPE tokenizer.json trained on the shipped corpus at test time (no hub, no network)."""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from trainer.data import SHIPPED_CORPUS


def train_bpe(vocab_size: int, specials: list[str]) -> Tokenizer:
    """Byte-level BPE (exact round trips) with `specials` first in the vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(SHIPPED_CORPUS)], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def save_bpe_with_template(path: Path, vocab_size: int) -> Path:
    """A tokenizer.json whose post-processor puts <s> (id 0) before and </s> (id 1) after a sequence."""
    tok = train_bpe(vocab_size, ["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    tok.save(str(path))
    return path
