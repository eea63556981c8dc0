"""Local text files (.txt, .jsonl, .json, .json.gz, .jsonl.gz) as a document source.

Documents: one JSON object per line with a ``text`` field (any JSON-lines file, C4 shards included),
or, in a ``.txt`` file, paragraphs separated by one or more blank lines (a book becomes paragraphs or
speeches, a one-document-per-line file stays one document per line only if lines are separated by
blank lines -- use .jsonl for that). A ``.json`` file may also hold one JSON list of objects/strings.

Malformed JSON lines are never dropped silently: reading collects every bad line and raises one error
with the count and the first locations (``file:line``), because a corpus with silently missing
documents makes runs incomparable.

Validation is held out deterministically: every ``val_every``-th document (in sorted-file order) --
spread over all files, independent of seeds, identical across runs and ranks. Training documents are
shuffled by a per-epoch permutation seeded by ``(seed, epoch, reader)``.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from pathlib import Path

import numpy as np

from .core import Source
from .tokenizer import encode_batch

__all__ = ["LocalSource", "read_documents", "find_files"]

SUFFIXES = (".txt", ".jsonl", ".json", ".json.gz", ".jsonl.gz", ".txt.gz")


def find_files(path: str) -> list[str]:
    """The supported files under ``path`` (a file, a directory searched recursively, or a glob)."""
    if path is None:
        raise ValueError("data.path is null: the local source needs data.path=<file, directory or glob>")
    path = os.path.expanduser(str(path))
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    elif os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and str(p).endswith(SUFFIXES))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"data.path={path!r} does not exist (expected a file, a directory or a glob)")
    if not files:
        raise FileNotFoundError(
            f"data.path={path!r} holds no data files; supported: {', '.join(SUFFIXES)}"
        )
    return files


def _open_text(fname: str):
    return gzip.open(fname, "rt", encoding="utf-8") if fname.endswith(".gz") else open(fname, encoding="utf-8")


def read_documents(files: list[str], text_field: str = "text") -> list[str]:
    """All documents of the files, in order; raises ValueError listing every malformed line."""
    docs: list[str] = []
    bad: list[str] = []
    for fname in files:
        plain = fname.endswith((".txt", ".txt.gz"))
        with _open_text(fname) as f:
            if plain:
                para: list[str] = []
                for line in f:
                    if line.strip():
                        para.append(line.rstrip("\n"))
                    elif para:
                        docs.append("\n".join(para))
                        para = []
                if para:
                    docs.append("\n".join(para))
                continue
            content = f.read()
        if fname.endswith(".json") and content.lstrip().startswith("["):
            try:
                items = json.loads(content)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{fname}: not valid JSON ({exc})") from exc
            for i, item in enumerate(items):
                text = item if isinstance(item, str) else (item.get(text_field) if isinstance(item, dict) else None)
                if not isinstance(text, str):
                    bad.append(f"{fname}:item {i}")
                else:
                    docs.append(text)
            continue
        for lineno, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                text = obj[text_field]
                if not isinstance(text, str):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                bad.append(f"{fname}:{lineno}")
                continue
            docs.append(text)
    if bad:
        shown = ", ".join(bad[:5]) + (f" ... (+{len(bad) - 5} more)" if len(bad) > 5 else "")
        raise ValueError(
            f"{len(bad)} malformed line(s) (not JSON, or without a string field {text_field!r}) in the data "
            f"files: {shown}. Fix or remove them; nothing was skipped silently."
        )
    return docs


class IndexedSource(Source):
    """A source with random access to numbered training documents (local texts, token files).

    Reader ``r`` of ``n`` owns training documents ``r, r+n, r+2n, ...``; each epoch visits them in a
    permutation seeded by ``(seed, epoch, reader)``. Position = ``[epoch, index in that order, 0]``.
    """

    shuffle = True
    TOKENIZE_CHUNK = 256

    def n_train(self) -> int:
        raise NotImplementedError

    def get_train(self, indices: np.ndarray, max_tokens: int | None) -> list[np.ndarray]:
        raise NotImplementedError

    def order(self, reader: int, n_readers: int, seed: int, epoch: int) -> np.ndarray:
        mine = np.arange(reader, self.n_train(), n_readers)
        if len(mine) == 0:
            raise ValueError(
                f"{self.name}: {self.n_train()} training documents cannot feed {n_readers} readers "
                "(ranks x DataLoader workers); use fewer workers or more data"
            )
        if self.shuffle:
            mine = mine[np.random.default_rng([int(seed), int(epoch), int(reader), 7]).permutation(len(mine))]
        return mine

    def train_docs(self, reader, n_readers, seed, start, max_tokens):
        epoch, i = int(start[0]), int(start[1])
        while True:
            order = self.order(reader, n_readers, seed, epoch)
            while i < len(order):
                chunk = order[i:i + self.TOKENIZE_CHUNK]
                for toks in self.get_train(chunk, max_tokens):
                    yield [epoch, i, 0], toks, [epoch, i + 1, 0]
                    i += 1
            epoch, i = epoch + 1, 0


class LocalSource(IndexedSource):
    name = "local"

    def __init__(self, path, tokenizer, info, text_field: str = "text", val_every: int = 100,
                 shuffle: bool = True):
        if int(val_every) < 2:
            raise ValueError(f"data.val_every must be >= 2 (every k-th document is held out), got {val_every}")
        self.files = find_files(path)
        docs = read_documents(self.files, text_field)
        if not docs:
            raise ValueError(f"data.path={path!r}: the files hold no documents")
        k = int(val_every)
        self.val_texts = docs[::k]
        self.train_texts = [d for i, d in enumerate(docs) if i % k]
        if not self.train_texts:
            raise ValueError(f"data.path={path!r}: only {len(docs)} document(s), none left for training")
        self.tok, self.info, self.shuffle = tokenizer, info, bool(shuffle)
        self.pad_id, self.eos_id = info.pad_id, info.eos_id

    def n_train(self):
        return len(self.train_texts)

    def get_train(self, indices, max_tokens):
        return encode_batch(self.tok, self.info, [self.train_texts[i] for i in indices], max_tokens)

    def val_docs(self, max_tokens):
        for i in range(0, len(self.val_texts), self.TOKENIZE_CHUNK):
            yield from encode_batch(self.tok, self.info, self.val_texts[i:i + self.TOKENIZE_CHUNK], max_tokens)
