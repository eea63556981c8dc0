"""Local text files (.txt, .jsonl, .json, .json.gz, .jsonl.gz) as a document source.

Documents: a JSON object per line with a ``text`` field, a ``.json`` list of objects or strings, or,
in a ``.txt`` file, paragraphs separated by blank lines. Malformed JSON lines are never dropped
silently: one error lists them all. Every ``val_stride``-th document (sorted-file order, from the
first) is held out for validation; training documents are shuffled per epoch (``data/indexed.py``).
"""
from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import zlib
from pathlib import Path

from frugal.checks import check_integer

from .errors import DataConfigError, DataFileNotFoundError
from .indexed import IndexedSource
from .tokenizer import encode_batch

__all__ = ["LocalSource", "read_documents", "find_files"]

SUFFIXES = (".txt", ".jsonl", ".json", ".json.gz", ".jsonl.gz", ".txt.gz")


def find_files(path: str) -> list[str]:
    """The supported files under ``path`` (a file, a directory searched recursively, or a glob)."""
    if path is None:
        raise DataConfigError("data.path is null: the local source needs data.path=<file, directory or glob>")
    path = os.path.expanduser(str(path))
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    elif os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and str(p).endswith(SUFFIXES))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise DataFileNotFoundError(f"data.path={path!r} does not exist (expected a file, a directory or a glob)")
    if not files:
        raise DataFileNotFoundError(
            f"data.path={path!r} holds no data files; supported: {', '.join(SUFFIXES)}")
    return files


@contextlib.contextmanager
def _open_text(fname: str):
    """The file as UTF-8 text; a file that is not (binary data, a damaged .gz) is a DataConfigError
    naming it, raised wherever in the `with` body the bad bytes are read."""
    try:
        with gzip.open(fname, "rt", encoding="utf-8") if fname.endswith(".gz") else open(fname, encoding="utf-8") as f:
            yield f
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start:exc.start + 4].hex(" ")
        raise DataConfigError(f"{fname} is not UTF-8 text (undecodable bytes {bad}: {exc.reason}); data.path takes "
                              f"text files ({', '.join(SUFFIXES)}) in UTF-8") from exc
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataConfigError(f"{fname} is not a readable gzip file ({exc})") from exc


def read_documents(files: list[str], text_field: str = "text") -> list[str]:
    """All documents of the files, in order; raises DataConfigError listing every malformed line."""
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
                raise DataConfigError(f"{fname}: not valid JSON ({exc})") from exc
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
        raise DataConfigError(
            f"{len(bad)} malformed line(s) (not JSON, or without a string field {text_field!r}) in the data "
            f"files: {shown}. Fix or remove them; nothing was skipped silently.")
    return docs


class LocalSource(IndexedSource):
    name = "local"

    def __init__(self, path, tokenizer, info, text_field: str = "text", val_stride: int = 100,
                 shuffle: bool = True):
        check_integer("data.val_stride", val_stride, 2, error=DataConfigError,
                      why=" (every val_stride-th document is held out for validation)")
        self.path, self.files = path, find_files(path)
        docs = read_documents(self.files, text_field)
        self.n_docs, self.val_stride = len(docs), val_stride
        self.bytes = sum(os.path.getsize(f) for f in self.files)
        if not docs:
            raise DataConfigError(f"data.path={path!r} ({self.bytes:,} bytes): the files hold no documents")
        self.val_texts = docs[::val_stride]
        self.train_texts = [d for i, d in enumerate(docs) if i % val_stride]
        if not self.train_texts:
            raise DataConfigError(
                f"data.path={path!r} ({self.bytes:,} bytes) holds only {len(docs)} document(s), all held out for "
                "validation; give it more text (.txt files are split into documents at blank lines)")
        self.shuffle = bool(shuffle)
        self._use_tokenizer(tokenizer, info)

    def identity(self) -> dict:
        return {"name": self.name, "train_docs": len(self.train_texts), "val_stride": self.val_stride,
                "shuffle": self.shuffle}

    def describe_validation(self) -> str:
        return (f"every {self.val_stride}th of the {self.n_docs:,} documents in data.path={self.path!r}, "
                f"{self.bytes:,} bytes: {len(self.val_texts):,} held out")

    def n_train(self):
        return len(self.train_texts)

    def get_train(self, indices, max_tokens):
        return encode_batch(self.tok, self.info, [self.train_texts[i] for i in indices], max_tokens)

    def val_docs(self, max_tokens):
        for i in range(0, len(self.val_texts), self.CHUNK):
            yield from encode_batch(self.tok, self.info, self.val_texts[i:i + self.CHUNK], max_tokens)
