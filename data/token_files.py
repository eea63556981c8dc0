"""Pre-tokenized token files (written by ``scripts/pretokenize.py``): sweeps skip tokenization.

A token directory holds ``meta.json`` (format, dtype, layout, vocabulary and special ids, the data
config it was made from, per-split counts), ``<split>.bin`` (every document concatenated, a raw
little-endian array read through np.memmap) and ``<split>.idx.npy`` (int64 offsets, docs + 1) for the
train and validation splits. Layout ``rows`` stores each document as the row it becomes (without
padding: what a run with that seq_len and truncation reads); ``documents`` stores whole documents
(any seq_len, packing or not). docs/data_pipeline.md, "Epochs and sizes".
"""
from __future__ import annotations

import json
import os

import numpy as np

from .errors import DataConfigError, DataFileNotFoundError
from .indexed import IndexedSource
from .rows import RowFormat

__all__ = ["TokenSource", "write_split", "pretokenize", "LAYOUTS"]

FORMAT = 2
LAYOUTS = ("auto", "rows", "documents")


def write_split(out_dir: str, split: str, docs, dtype: str) -> dict:
    """Write documents (1-D int arrays) to ``<split>.bin`` and their offsets. Returns counts."""
    np_dtype = np.dtype(dtype)
    limit = np.iinfo(np_dtype).max
    offsets = [0]
    tmp = os.path.join(out_dir, f"{split}.bin.tmp")
    max_id = -1
    with open(tmp, "wb") as f:
        for toks in docs:
            toks = np.asarray(toks)
            if len(toks) == 0:
                continue
            top = int(toks.max())
            if top > limit:
                raise DataConfigError(f"token id {top} does not fit {dtype}; use --dtype uint32")
            max_id = max(max_id, top)
            f.write(toks.astype(np_dtype).tobytes())
            offsets.append(offsets[-1] + len(toks))
    os.replace(tmp, os.path.join(out_dir, f"{split}.bin"))
    np.save(os.path.join(out_dir, f"{split}.idx.npy"), np.asarray(offsets, dtype=np.int64))
    return {"tokens": int(offsets[-1]), "docs": len(offsets) - 1, "max_id": max_id}


class TokenSource(IndexedSource):
    name = "tokens"

    def __init__(self, path, model_vocab_size: int | None = None, shuffle: bool = True):
        if path is None:
            raise DataConfigError("data.path is null: the tokens source needs data.path=<directory written by "
                                  "scripts/pretokenize.py>")
        path = os.path.expanduser(str(path))
        meta_file = os.path.join(path, "meta.json")
        if not os.path.isfile(meta_file):
            raise DataFileNotFoundError(
                f"data.path={path!r} has no meta.json: create token files with "
                "`python -m scripts.pretokenize --data <source> --out <dir>`")
        with open(meta_file) as f:
            self.meta = json.load(f)
        if self.meta.get("format") != FORMAT:
            raise DataConfigError(f"{meta_file}: token files of format {self.meta.get('format')!r}, this version "
                                  f"reads format {FORMAT}; write them again with scripts/pretokenize.py")
        self.path, self.shuffle = path, bool(shuffle)
        self.dtype = np.dtype(self.meta["dtype"])
        self.vocab_size = self.meta.get("vocab_size")
        self.loss_floor = self.meta.get("loss_floor")
        self.pad_id = int(self.meta.get("pad_id") or 0)
        self.eos_id = self.meta.get("eos_id")
        self.prefix, self.suffix = tuple(self.meta.get("prefix", ())), tuple(self.meta.get("suffix", ()))
        layout = self.meta["layout"]
        self.layout = layout["kind"]
        self.rows = ({"seq_len": layout["seq_len"], "truncation": layout["truncation"]}
                     if self.layout == "rows" else None)
        embed = self.vocab_size or model_vocab_size
        for split, info in self.meta["splits"].items():
            if embed is not None and info.get("max_id", -1) >= embed:
                raise DataConfigError(
                    f"{path}: {split} token ids go up to {info['max_id']} but the model embeds {embed} ids "
                    f"(tokenizer {self.meta.get('tokenizer')!r}); use the model these files were made for")
        self._maps: dict = {}
        self._idx = {s: np.load(os.path.join(path, f"{s}.idx.npy")) for s in self.meta["splits"]}
        if self.n_train() == 0:
            raise DataConfigError(f"data.path={path!r}: the token files hold no training documents")

    def identity(self) -> dict:
        train = self.meta["splits"]["train"]
        return {"name": self.name, "train_docs": train["docs"], "train_tokens": train["tokens"],
                "layout": self.layout, "shuffle": self.shuffle}

    def __getstate__(self):
        state = super().__getstate__()
        state["_maps"] = {}  # memory maps are reopened in each DataLoader worker, never pickled
        return state

    def _tokens(self, split: str) -> np.ndarray:
        if split not in self._maps:
            fname = os.path.join(self.path, f"{split}.bin")
            n = self.meta["splits"][split]["tokens"]
            self._maps[split] = np.memmap(fname, dtype=self.dtype, mode="r", shape=(n,))
        return self._maps[split]

    def n_train(self):
        return len(self._idx["train"]) - 1

    def _docs(self, split, indices, max_tokens):
        toks, idx = self._tokens(split), self._idx[split]
        out = []
        for i in indices:
            a, b = idx[i], idx[i + 1]
            if max_tokens is not None:
                b = min(b, a + max_tokens)
            out.append(toks[a:b].astype(np.int64))
        return out

    def get_train(self, indices, max_tokens):
        return self._docs("train", indices, max_tokens)

    def val_docs(self, max_tokens):
        n = len(self._idx["validation"]) - 1
        for i in range(0, n, 1024):
            yield from self._docs("validation", range(i, min(n, i + 1024)), max_tokens)


def _scored(tokens: int, rows_tokens: int, seq_len: int, packing: bool) -> int:
    """Scored targets (all but each row's first token) of a stream of ``tokens`` packed ids, or
    ``rows_tokens`` = sum over unpacked rows of (length - 1)."""
    if not packing:
        return rows_tokens
    full, rest = divmod(tokens, seq_len)
    return full * (seq_len - 1) + max(rest - 1, 0)


def pretokenize(data_cfg, out_dir: str, *, train_rows: int, val_tokens: int | None = 10_000_000,
                model_vocab_size: int | None = None, layout: str = "auto", dtype: str = "auto") -> dict:
    """Write what a run of ``train_rows`` training rows reads (counted after truncation, under the config's
    seq_len, packing and truncation; at most one epoch, unshuffled) and a validation set of ``val_tokens``
    scored tokens as token files; returns the meta dict."""
    from . import _get, build_source  # late import: data/__init__ imports this module

    if hasattr(data_cfg, "_metadata"):  # an OmegaConf node: store plain, resolved values in meta.json
        from omegaconf import OmegaConf

        data_cfg = OmegaConf.to_container(data_cfg, resolve=True)
    cfg = dict(data_cfg)
    if layout not in LAYOUTS:
        raise DataConfigError(f"layout={layout!r} is invalid; choose one of {list(LAYOUTS)}")
    if int(train_rows) < 1:
        raise DataConfigError(f"train_rows={train_rows} is invalid: expected >= 1")
    source = build_source(cfg, model_vocab_size=model_vocab_size)
    source.shuffle = False
    seq_len, packing = int(_get(cfg, "seq_len")), bool(_get(cfg, "packing"))
    truncation = str(_get(cfg, "truncation"))
    fmt = RowFormat(source, seq_len, packing, truncation)
    if layout == "auto":
        layout = "rows" if source.rows is not None or not packing else "documents"
    if layout == "rows" and packing and source.rows is None:
        raise DataConfigError("layout rows holds truncate-and-pad rows, but the config packs (data.packing=true); "
                              "use layout documents")
    if source.rows is not None:
        layout = "rows"  # the synthetic language's rows are its documents
    store = fmt if layout == "rows" else (lambda ids: ids)
    if dtype == "auto":
        ids = source.vocab_size or getattr(getattr(source, "info", None), "size", None) or 2**32
        dtype = "uint16" if ids <= 2**16 else "uint32"
    os.makedirs(out_dir, exist_ok=True)
    counts = {"train": [0, 0, 0], "validation": [0, 0, 0]}  # rows, packed ids, sum of (row length - 1)

    def account(split, ids):
        row = fmt(ids)
        c = counts[split]
        c[1] += len(row)
        c[2] += max(min(len(row), seq_len) - 1, 0)
        c[0] = c[1] // seq_len if packing else c[0] + (len(row) > 0)

    def train_stream():
        for pos, ids, _ in source.train_docs(0, 1, 0, [0, 0, 0], fmt.text_tokens):
            if pos[0] > 0:  # one epoch at most
                return
            account("train", ids)
            yield store(ids)
            if counts["train"][0] >= train_rows:
                return

    def val_stream():
        for ids in source.val_docs(fmt.text_tokens):
            account("validation", ids)
            yield store(ids)
            c = counts["validation"]
            if val_tokens is not None and _scored(c[1], c[2], seq_len, packing) >= val_tokens:
                return

    splits = {"train": write_split(out_dir, "train", train_stream(), dtype),
              "validation": write_split(out_dir, "validation", val_stream(), dtype)}
    for split, c in counts.items():
        splits[split].update(rows=c[0], scored_tokens=_scored(c[1], c[2], seq_len, packing))
    info = getattr(source, "info", None)
    meta = {
        "dtype": dtype,
        "layout": ({"kind": "rows", "seq_len": seq_len, "truncation": None if source.rows else truncation}
                   if layout == "rows" else {"kind": "documents"}),
        "vocab_size": source.vocab_size,
        "tokenizer": None if info is None else str(cfg.get("tokenizer")),
        "pad_id": source.pad_id,
        "eos_id": source.eos_id,
        "prefix": [int(i) for i in source.prefix],
        "suffix": [int(i) for i in source.suffix],
        "loss_floor": source.loss_floor,
        "requested": {"train_rows": int(train_rows), "val_tokens": val_tokens, "seq_len": seq_len,
                      "packing": packing, "truncation": truncation},
        "source": cfg,
        "splits": splits,
    }
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))
    return meta
