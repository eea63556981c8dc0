"""Tokenizer loading with offline-friendly errors, and the guarantee that ids fit the model.

The T5 tokenizer (t5-base) has 32000 sentencepiece pieces plus 100 sentinel ``<extra_id_N>`` tokens
(ids 32000-32099), while the paper's LLaMA embeds 32000 ids. Sentinels only appear when a document
literally contains the string ``<extra_id_N>``; we map every id >= the model's vocabulary to the unk
id when all such ids are special/added tokens (that is the T5 case), and raise when ordinary pieces
would not fit (e.g. the GPT-2 tokenizer with a 32000-id model): that is a config mistake, not data.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["load_tokenizer", "TokenizerInfo", "encode_batch"]


def load_tokenizer(name_or_path: str):
    """Load a Hugging Face tokenizer by Hub name or from a local directory.

    A directory holding only ``spiece.model`` (what ``sentencepiece`` writes) is loaded with
    ``T5Tokenizer`` directly, since ``AutoTokenizer`` would need a ``tokenizer_config.json``.
    """
    from transformers import AutoTokenizer, T5Tokenizer

    if name_or_path is None:
        raise ValueError("data.tokenizer is null: set it to a Hugging Face name (t5-base, gpt2) or a local directory")
    name_or_path = str(name_or_path)
    path = Path(name_or_path).expanduser()
    looks_local = path.exists() or name_or_path.startswith((".", "/", "~"))
    if looks_local and not path.exists():
        raise FileNotFoundError(f"data.tokenizer={name_or_path!r}: no such directory")
    try:
        if path.is_dir() and (path / "spiece.model").exists() and not (path / "tokenizer_config.json").exists():
            tok = T5Tokenizer.from_pretrained(str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(path) if looks_local else name_or_path)
    except (OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
        raise OSError(
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


class TokenizerInfo:
    """The few ids the pipeline needs, plus the id remapping that keeps every id < model_vocab_size."""

    def __init__(self, tok, model_vocab_size: int | None = None):
        self.name = getattr(tok, "name_or_path", "?")
        self.eos_id = tok.eos_token_id
        # GPT-2 has no pad token: pad with EOS. Pads are masked by position (labels -100), never by id,
        # so a pad id equal to EOS costs nothing.
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (self.eos_id or 0)
        self.unk_id = tok.unk_token_id
        self.size = len(tok)
        self.model_vocab_size = model_vocab_size
        self.remap_from = None  # ids >= remap_from are replaced by unk_id
        if model_vocab_size is not None and self.size > model_vocab_size:
            special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}).keys())
            too_big = [i for i in range(model_vocab_size, self.size)]
            ordinary = [i for i in too_big if i not in special]
            if ordinary or self.unk_id is None or self.unk_id >= model_vocab_size:
                raise ValueError(
                    f"The tokenizer {self.name!r} has {self.size} ids but the model embeds only "
                    f"{model_vocab_size} ({len(ordinary)} ordinary pieces would not fit). Use the model's "
                    "tokenizer (model.tokenizer) or set model.vocab_size >= the tokenizer size."
                )
            self.remap_from = model_vocab_size
        for name, value in (("eos", self.eos_id), ("pad", self.pad_id)):
            if value is not None and model_vocab_size is not None and value >= model_vocab_size:
                raise ValueError(f"the tokenizer's {name} id {value} is >= model vocab {model_vocab_size}")


def _cut_at_word(text: str, max_chars: int) -> str:
    """Longest prefix of at most max_chars that ends before a whitespace character.

    sentencepiece (split_by_whitespace) and GPT-2's byte-level BPE never merge across a whitespace
    boundary, so the tokens of such a prefix are exactly the first tokens of the whole text.
    """
    cut = text.rfind(" ", 0, max_chars)
    for ws in ("\n", "\t"):
        cut = max(cut, text.rfind(ws, 0, max_chars))
    return text[:cut] if cut > 0 else text


def encode_batch(tok, info: TokenizerInfo, texts: list[str], max_tokens: int | None = None) -> list[np.ndarray]:
    """Tokenize documents (batched: ~2x faster than one call per document) and append EOS to each.

    ``max_tokens``: only the first max_tokens ids are needed (truncate-and-pad batches). Long texts are
    then tokenized from a word-boundary prefix of 8 characters per token, and re-tokenized in full
    only when that prefix turns out too short, so the result is identical to full tokenization
    followed by truncation -- at about half the cost on C4 (mean ~480 tokens per document).
    """
    chars = None if max_tokens is None else 8 * max_tokens
    cut = [t if chars is None or len(t) <= chars else _cut_at_word(t, chars) for t in texts]
    ids = tok(cut, add_special_tokens=False)["input_ids"]
    out = []
    for text, short, seq in zip(texts, cut, ids):
        complete = short is text
        if not complete and len(seq) < max_tokens:
            seq, complete = tok(text, add_special_tokens=False)["input_ids"], True
        arr = np.asarray(seq, dtype=np.int64)
        if complete and info.eos_id is not None:
            # An incomplete prefix has >= max_tokens ids, so its EOS would be truncated away anyway.
            arr = np.append(arr, info.eos_id)
        if max_tokens is not None:
            arr = arr[:max_tokens]
        if info.remap_from is not None:
            arr[arr >= info.remap_from] = info.unk_id
        out.append(arr)
    return out
