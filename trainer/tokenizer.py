"""Tokenizers: the built-in byte tokenizer and a Hugging Face ``tokenizer.json``.

Both give ``encode`` / ``decode``, ``vocab_size`` and what packing needs between documents:
``bos_id`` (prepended to each document, or None) and ``separator`` (the ids appended after
each document: the EOS token, or a blank line for the byte tokenizer, which has no special
tokens). BOS/EOS of a ``tokenizer.json`` are found, in order, in the config
(``[model] bos_token`` / ``eos_token``), a ``tokenizer_config.json`` next to the file (the
Hugging Face layout), the post-processor's template, and the added special tokens with a
conventional name; when that is ambiguous the error says which key to set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Protocol

import torch


class TokenizerError(ValueError):
    """A tokenizer that cannot be used as configured; ``key`` is the config key to fix."""

    def __init__(self, message: str, key: str = "model.tokenizer_path"):
        super().__init__(message)
        self.key = key


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: Optional[int]
    separator: list[int]
    ends_documents: bool  # the separator ends every document (EOS), or only stands between them

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value; documents are separated by a blank line."""

    vocab_size = 256
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    separator = list(b"\n\n")
    ends_documents = False  # the separator goes between documents (the shipped corpus is one)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_to_tensor(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")


class HFTokenizer:
    """A ``tokenizers`` ``tokenizer.json``: encodes without the post-processor's specials
    (packing adds BOS/EOS itself, once per document)."""

    def __init__(self, path: str, bos_token: str = "", eos_token: str = ""):
        from tokenizers import Tokenizer as _Tokenizer

        self.path = path
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"{path}: no such file; give the path of a Hugging Face tokenizer.json")
        try:
            self._tok = _Tokenizer.from_file(str(p))
            spec = json.loads(p.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json ({first}); give the tokenizer.json "
                                 f"that tokenizers.Tokenizer.save wrote") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        hints = _tokenizer_config_hints(p)
        template_bos, template_eos = _template_specials(spec.get("post_processor"))
        specials = [t["content"] for t in spec.get("added_tokens") or [] if t.get("special")]
        self.bos_id = self._resolve("bos", bos_token, hints.get("bos_token"), template_bos, specials, BOS_NAMES)
        self.eos_id = self._resolve("eos", eos_token, hints.get("eos_token"), template_eos, specials, EOS_NAMES)
        if self.eos_id is None:
            raise TokenizerError(f"{path}: no EOS token found (no tokenizer_config.json, post-processor template or "
                                 f"special token named {', '.join(EOS_NAMES)}); set [model] eos_token to the token "
                                 f"that ends a document", key="model.eos_token")
        if self.bos_id == self.eos_id:  # GPT-2 style: one token both ends and starts; the EOS already separates
            self.bos_id = None
        self.separator = [self.eos_id]
        self.ends_documents = True

    def _resolve(self, which: str, configured: str, hinted: Optional[str], template: Optional[str],
                 specials: list[str], names: tuple[str, ...]) -> Optional[int]:
        """The id of the BOS or EOS token: the config's, else the tokenizer's own (one candidate)."""
        key = f"model.{which}_token"
        if configured:
            tid = self._tok.token_to_id(configured)
            if tid is None:
                raise TokenizerError(f"{self.path}: '{key}' = {configured!r} is not a token of this tokenizer; "
                                     f"special tokens: {', '.join(specials) or 'none'}", key=key)
            return tid
        for name in (hinted, template):
            if name and self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        found = [n for n in names if n in specials]
        if len(found) > 1:
            raise TokenizerError(f"{self.path}: {which.upper()} is ambiguous: special tokens {', '.join(found)}; "
                                 f"set [model] {which}_token to one of them", key=key)
        return self._tok.token_to_id(found[0]) if found else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)


def _tokenizer_config_hints(path: Path) -> dict[str, str]:
    """bos_token / eos_token of a ``tokenizer_config.json`` beside the tokenizer (strings or
    {"content": ...} objects), or nothing when there is none or it does not parse."""
    cfg_path = path.with_name("tokenizer_config.json")
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token"):
        v = data.get(key) if isinstance(data, dict) else None
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str) and v:
            out[key] = v
    return out


def _template_specials(proc: Optional[dict]) -> tuple[Optional[str], Optional[str]]:
    """(BOS, EOS) the post-processor puts around a single sequence: a TemplateProcessing's
    special tokens before / after ``$A``, Roberta/Bert's cls / sep, inside a Sequence too."""
    if not isinstance(proc, dict):
        return None, None
    kind = proc.get("type")
    if kind == "Sequence":
        for sub in proc.get("processors") or []:
            bos, eos = _template_specials(sub)
            if bos or eos:
                return bos, eos
        return None, None
    if kind in ("RobertaProcessing", "BertProcessing"):
        return proc["cls"][0], proc["sep"][0]
    if kind != "TemplateProcessing":
        return None, None
    bos = eos = None
    seen_seq = False
    for piece in proc.get("single") or []:
        if "Sequence" in piece:
            seen_seq = True
        elif "SpecialToken" in piece:
            name = piece["SpecialToken"]["id"]
            if seen_seq:
                eos = eos or name
            else:
                bos = name
    return bos, eos


def build_tokenizer(name: str = "byte", path: str = "", bos_token: str = "", eos_token: str = "") -> Tokenizer:
    """The byte tokenizer, or the ``tokenizer.json`` at ``path`` when one is given."""
    if path:
        return HFTokenizer(path, bos_token, eos_token)
    if name == "byte":
        return ByteTokenizer()
    raise TokenizerError(f"unknown tokenizer {name!r}; available: byte (or set [model] tokenizer_path)",
                         key="data.tokenizer")


def tokenizer_for(cfg) -> Tokenizer:
    """The job's tokenizer (``[model] tokenizer_path`` over ``[data] tokenizer``)."""
    m = cfg.model
    return build_tokenizer(cfg.data.tokenizer, m.tokenizer_path, m.bos_token, m.eos_token)


def tokenizer_vocab(cfg) -> int:
    """The vocabulary of ``[model] tokenizer_path`` (0 without one: the dry run then keeps the flavor's)."""
    return tokenizer_for(cfg).vocab_size if cfg.model.tokenizer_path else 0
