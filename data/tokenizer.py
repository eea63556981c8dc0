"""Tokenizer loading with offline-friendly errors, and the guarantee that ids fit the model.

T5 (t5-base) has 32000 pieces plus 100 sentinels (ids 32000-32099), LLaMA embeds 32000: ids at or
above the embedded vocabulary are mapped to unk when all of them are added/special tokens (the T5
case); a tokenizer whose ordinary pieces would not fit is refused (a config mistake, not data).
``vocab_from``: ``model`` keeps the model config's vocabulary; ``tokenizer`` sizes the embedding to
what the tokenizer emits on ordinary text (right for your own small tokenizer).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .errors import DataConfigError, DataFileNotFoundError

__all__ = ["load_tokenizer", "TokenizerInfo", "encode_batch", "VOCAB_FROM"]

VOCAB_FROM = ("model", "tokenizer")


def load_tokenizer(name_or_path: str):
    """A Hugging Face tokenizer by Hub name or from a local directory (one holding only sentencepiece's
    ``spiece.model`` through ``T5Tokenizer``: ``AutoTokenizer`` needs a ``tokenizer_config.json``)."""
    from transformers import AutoTokenizer, T5Tokenizer

    if name_or_path is None:
        raise DataConfigError("data.tokenizer is null: set it to a Hugging Face name (t5-base, gpt2) or a local "
                              "directory")
    name_or_path = str(name_or_path)
    path = Path(name_or_path).expanduser()
    looks_local = path.exists() or name_or_path.startswith((".", "/", "~"))
    if looks_local and not path.exists():
        raise DataFileNotFoundError(f"data.tokenizer={name_or_path!r}: no such directory")
    try:
        if path.is_dir() and (path / "spiece.model").exists() and not (path / "tokenizer_config.json").exists():
            tok = T5Tokenizer.from_pretrained(str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(path) if looks_local else name_or_path)
    # transformers reports a missing/unreachable tokenizer as OSError and an unusable directory as
    # ValueError; both are the user's setting, not a bug.
    except (OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
        raise DataConfigError(
            f"Could not load the tokenizer data.tokenizer={name_or_path!r}"
            + (" (HF_HUB_OFFLINE is set)" if offline else " (no network or not in the Hugging Face cache?)")
            + ". Pass a local directory instead: data.tokenizer=/path/to/tokenizer_dir (a folder with "
            "tokenizer.json or spiece.model; make one on a machine with internet via "
            f"AutoTokenizer.from_pretrained({name_or_path!r}).save_pretrained('tokenizer_dir')), or point "
            "HF_HOME / HF_HUB_CACHE at a cache that already holds it. "
            f"Original error: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    # We truncate ourselves; a huge model_max_length silences the "sequence too long" warning.
    tok.model_max_length = 10**12
    return tok


def _special_layout(tok) -> tuple[list[int], list[int]]:
    """The ids ``tok(text)`` puts before and after a text (T5: none and [</s>]; GPT-2: none), found by
    tokenizing a probe with and without special tokens."""
    probe = "a b"
    plain = list(tok(probe, add_special_tokens=False)["input_ids"])
    full = list(tok(probe, add_special_tokens=True)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    raise DataConfigError(
        f"cannot tell where the tokenizer {getattr(tok, 'name_or_path', '?')!r} puts its special tokens "
        f"({full} with them, {plain} without); use data.truncation=prefix")


class TokenizerInfo:
    """The ids the pipeline needs, the special-token layout (``prefix``/``suffix``), the remapping that keeps
    ids in range, and ``vocab_size``: the data's embedding size (``vocab_from=tokenizer``) or None."""

    def __init__(self, tok, model_vocab_size: int | None = None, vocab_from: str = "model"):
        if vocab_from not in VOCAB_FROM:
            raise DataConfigError(f"data.vocab_from={vocab_from!r} is invalid; choose one of {list(VOCAB_FROM)}")
        self.name = getattr(tok, "name_or_path", "?")
        self.eos_id = tok.eos_token_id
        # GPT-2 has no pad token: pad with EOS. Pads are masked by position (labels -100), never by id,
        # so a pad id equal to EOS costs nothing.
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (self.eos_id or 0)
        self.unk_id = tok.unk_token_id
        self.size = len(tok)
        self.prefix, self.suffix = _special_layout(tok)
        needed = {i for i in (self.eos_id, self.pad_id, self.unk_id, *self.prefix, *self.suffix) if i is not None}
        extra = (set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}).keys())) - needed
        core = self.size
        while core > 0 and core - 1 in extra:
            core -= 1
        self.core_size = core  # ids ordinary text produces, plus the specials the pipeline writes
        self.vocab_size = core if vocab_from == "tokenizer" else None
        limit = core if vocab_from == "tokenizer" else model_vocab_size
        self.remap_from = None  # ids >= remap_from are replaced by unk_id
        if limit is not None and self.size > limit:
            ordinary = [i for i in range(limit, self.size) if i not in extra]
            if ordinary or self.unk_id is None or self.unk_id >= limit:
                raise DataConfigError(
                    f"The tokenizer {self.name!r} has {self.size} ids but the model embeds only "
                    f"{limit} ({len(ordinary)} ordinary pieces would not fit). Use the model's "
                    "tokenizer (model.tokenizer), set model.vocab_size >= the tokenizer size, or "
                    "data.vocab_from=tokenizer to size the embedding from the tokenizer.")
            self.remap_from = limit
        for name, value in (("eos", self.eos_id), ("pad", self.pad_id)):
            if value is not None and limit is not None and value >= limit:
                raise DataConfigError(f"the tokenizer's {name} id {value} is >= model vocab {limit}")


def _cut_at_word(text: str, max_chars: int) -> str:
    """Longest prefix of at most max_chars that ends before a whitespace character: sentencepiece and
    GPT-2's BPE never merge across whitespace, so its tokens are the whole text's first ones."""
    cut = max(text.rfind(ws, 0, max_chars) for ws in " \n\t")
    return text[:cut] if cut > 0 else text


def encode_batch(tok, info: TokenizerInfo, texts: list[str], max_tokens: int | None = None) -> list[np.ndarray]:
    """The text ids of each document (no special tokens: ``RowFormat`` adds them), batched, the first
    ``max_tokens`` if given: then a long text is tokenized from a word-boundary prefix of 8 characters per
    token, in full only when that is too short (the same ids as full tokenization, half the cost on C4)."""
    chars = None if max_tokens is None else 8 * max_tokens
    cut = [t if chars is None or len(t) <= chars else _cut_at_word(t, chars) for t in texts]
    ids = tok(cut, add_special_tokens=False)["input_ids"] if cut else []
    out = []
    for text, short, seq in zip(texts, cut, ids):
        if short is not text and len(seq) < max_tokens:
            seq = tok(text, add_special_tokens=False)["input_ids"]
        arr = np.asarray(seq, dtype=np.int64)
        if max_tokens is not None:
            arr = arr[:max_tokens]
        if info.remap_from is not None:
            arr[arr >= info.remap_from] = info.unk_id
        out.append(arr)
    return out
