"""Documents to rows: what a source gives (the ``Source`` contract) and the row format.

Every source answers ``train_docs(reader, n_readers, seed, start, max_tokens)``: one logical reader's
documents (``data/stream.py``) in a seeded deterministic order from exactly ``start``, as
``(position, token_ids, position_after)``; and ``val_docs(max_tokens)``: the validation documents in
their fixed order. A position is ``[epoch, major, minor]``, the last two the source's own;
``max_tokens``: only that many text ids are needed. How documents become rows (truncation, padding
masked by position, packing): docs/data_pipeline.md, "Rows".
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .errors import DataConfigError

__all__ = ["Source", "RowFormat", "doc_rows", "to_batch", "TRUNCATIONS"]

TRUNCATIONS = ("reference", "prefix")

Pos = list  # [epoch, major, minor]


class Source:
    """Base class of a document source (the module docstring has the contract). ``rows``: None for text
    ids, else ``{"seq_len": L, "truncation": t}``: finished rows of at most L ids made with rule t (None:
    windows of exactly L ids, the synthetic language)."""

    name = "source"
    vocab_size: int | None = None  # set when the source decides the vocabulary
    loss_floor: float | None = None
    pad_id: int = 0
    eos_id: int | None = None
    prefix: tuple = ()  # ids the tokenizer puts before a text (tok(text) with special tokens)
    suffix: tuple = ()  # ... and after it (T5: </s>)
    rows: dict | None = None

    def _use_tokenizer(self, tokenizer, info) -> None:
        """Take the tokenizer and its ids (``data.tokenizer.TokenizerInfo``): a source of text."""
        self.tok, self.info = tokenizer, info
        self.pad_id, self.eos_id = info.pad_id, info.eos_id
        self.prefix, self.suffix = tuple(info.prefix), tuple(info.suffix)
        self.vocab_size = info.vocab_size

    def identity(self) -> dict:
        """What must not change for a resumed run to continue the same stream."""
        return {"name": self.name}

    def train_docs(self, reader: int, n_readers: int, seed: int, start: Pos,
                   max_tokens: int | None) -> Iterator[tuple[Pos, np.ndarray, Pos]]:
        raise NotImplementedError

    def val_docs(self, max_tokens: int | None) -> Iterator[np.ndarray]:
        raise NotImplementedError


class RowFormat:
    """Turns a document's text ids into the ids a row holds (before padding), per the settings."""

    def __init__(self, source: Source, seq_len: int, packing: bool, truncation: str):
        if truncation not in TRUNCATIONS:
            raise DataConfigError(f"data.truncation={truncation!r} is invalid; choose one of {list(TRUNCATIONS)}")
        self.seq_len, self.packing, self.truncation = int(seq_len), bool(packing), truncation
        eos = [] if source.eos_id is None else [int(source.eos_id)]
        self.finished = source.rows is not None
        if self.finished:
            self.before, self.after = [], []
        elif self.packing:  # every document closed, so the model sees where one ends
            self.before, self.after = list(source.prefix), list(source.suffix) or eos
        elif truncation == "reference":
            self.before, self.after = list(source.prefix), list(source.suffix)
        else:
            self.before, self.after = [], eos
        self.text_tokens = None  # text ids a row can use: what the source must tokenize at least
        if not (self.finished or self.packing):
            self.text_tokens = self.seq_len - (len(self.before) + len(self.after) if truncation == "reference" else 0)
            if self.text_tokens < 1:
                raise DataConfigError(f"data.seq_len={seq_len} leaves no room for text next to the "
                                      f"tokenizer's special tokens {self.before + self.after}")

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        if self.finished:
            return ids
        if self.packing or self.truncation == "reference":
            text = ids if self.text_tokens is None else ids[:self.text_tokens]
            return np.concatenate([np.asarray(self.before, np.int64), text, np.asarray(self.after, np.int64)])
        return np.concatenate([ids[:self.seq_len], np.asarray(self.after, np.int64)])[:self.seq_len]


def doc_rows(docs, fmt: RowFormat, pad_id: int, start_offset: int = 0, pad_last: bool = False):
    """Turn ``(pos, ids, pos_after)`` documents into rows ``(row[seq_len], n_real, resume_state)``: one
    right-padded document per row, or with packing full rows of concatenated documents, ``resume_state``
    then ``(position of the document in progress, its ids already used)``. ``pad_last`` (validation)
    also yields the final partial row, padded."""
    seq_len = fmt.seq_len
    if not fmt.packing:
        for _, ids, after in docs:
            ids = fmt(ids)
            n = min(len(ids), seq_len)
            if n == 0:
                continue  # an all-pad row would have no loss at all
            row = np.full(seq_len, pad_id, dtype=np.int64)
            row[:n] = ids[:n]
            yield row, n, (after, 0)
        return
    parts, filled, first = [], 0, True
    for pos, ids, after in docs:
        ids = fmt(ids)
        off = start_offset if first else 0
        first = False
        while off < len(ids):
            take = min(seq_len - filled, len(ids) - off)
            parts.append(np.asarray(ids[off:off + take], dtype=np.int64))
            filled += take
            off += take
            if filled == seq_len:
                state = (after, 0) if off == len(ids) else (pos, off)
                yield np.concatenate(parts), seq_len, state
                parts, filled = [], 0
    if pad_last and filled:
        row = np.full(seq_len, pad_id, dtype=np.int64)
        row[:filled] = np.concatenate(parts)
        yield row, filled, None


def to_batch(rows: list) -> dict:
    ids = torch.from_numpy(np.stack([r[0] for r in rows]))
    labels = ids.clone()
    for i, (_, n, _) in enumerate(rows):
        labels[i, n:] = -100  # pad positions never count in the loss (mask by position, not by id)
    return {"input_ids": ids, "labels": labels}
