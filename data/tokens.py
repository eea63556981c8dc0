"""Pre-tokenized token files (written by ``scripts/pretokenize.py``): sweeps skip tokenization.

Layout of a token directory::

    meta.json          {"format": 1, "dtype": "uint16", "vocab_size": ..., "tokenizer": ..., "pad_id",
                        "eos_id", "loss_floor", "source": {...the data config it was made from...},
                        "splits": {"train": {"tokens": N, "docs": D}, "validation": {...}}}
    train.bin          all training tokens, concatenated, as a raw little-endian array (np.memmap)
    train.idx.npy      int64 document offsets, length D + 1 (document i = tokens[idx[i]:idx[i+1]])
    validation.bin / validation.idx.npy

Documents keep their EOS, so packing and truncate-and-pad both work from the same files. Reading is
slicing a memory map: millions of tokens per second, no Python per token.
"""
from __future__ import annotations

import json
import os

import numpy as np

from .local import IndexedSource

__all__ = ["TokenSource", "write_split", "write_meta", "pretokenize"]

FORMAT = 1


def write_split(out_dir: str, split: str, docs, dtype: str, max_tokens: int | None = None) -> dict:
    """Append documents (1-D int arrays) to ``<split>.bin`` and write their offsets. Returns counts."""
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
                raise ValueError(f"token id {top} does not fit {dtype}; use --dtype uint32")
            max_id = max(max_id, top)
            f.write(toks.astype(np_dtype).tobytes())
            offsets.append(offsets[-1] + len(toks))
            if max_tokens is not None and offsets[-1] >= max_tokens:
                break
    os.replace(tmp, os.path.join(out_dir, f"{split}.bin"))
    np.save(os.path.join(out_dir, f"{split}.idx.npy"), np.asarray(offsets, dtype=np.int64))
    return {"tokens": int(offsets[-1]), "docs": len(offsets) - 1, "max_id": max_id}


def write_meta(out_dir: str, meta: dict) -> None:
    meta = {"format": FORMAT, **meta}
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))


class TokenSource(IndexedSource):
    name = "tokens"

    def __init__(self, path, model_vocab_size: int | None = None, shuffle: bool = True):
        if path is None:
            raise ValueError("data.path is null: the tokens source needs data.path=<directory written by "
                             "scripts/pretokenize.py>")
        path = os.path.expanduser(str(path))
        meta_file = os.path.join(path, "meta.json")
        if not os.path.isfile(meta_file):
            raise FileNotFoundError(
                f"data.path={path!r} has no meta.json: create token files with "
                "`python scripts/pretokenize.py --data <source> --out <dir>`"
            )
        with open(meta_file) as f:
            self.meta = json.load(f)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{meta_file}: unsupported format {self.meta.get('format')!r} (expected {FORMAT})")
        self.path, self.shuffle = path, bool(shuffle)
        self.dtype = np.dtype(self.meta["dtype"])
        self.vocab_size = self.meta.get("vocab_size")
        self.loss_floor = self.meta.get("loss_floor")
        self.pad_id = int(self.meta.get("pad_id") or 0)
        self.eos_id = self.meta.get("eos_id")
        embed = self.vocab_size or model_vocab_size
        for split, info in self.meta["splits"].items():
            if embed is not None and info.get("max_id", -1) >= embed:
                raise ValueError(
                    f"{path}: {split} token ids go up to {info['max_id']} but the model embeds {embed} ids "
                    f"(tokenizer {self.meta.get('tokenizer')!r}); use the model these files were made for"
                )
        self._maps: dict = {}
        self._idx = {s: np.load(os.path.join(path, f"{s}.idx.npy")) for s in self.meta["splits"]}

    def __getstate__(self):
        state = dict(self.__dict__)
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


def pretokenize(data_cfg, out_dir: str, *, model_vocab_size: int | None = None,
                train_tokens: int | None = None, val_tokens: int | None = 10_000_000,
                dtype: str = "auto", max_doc_tokens: int | None = None) -> dict:
    """Write a source's train and validation streams to token files; returns the meta dict.

    The training stream is written in its natural, unshuffled order (file order for c4/local): the
    tokens source shuffles per epoch itself, with the run's seed. ``train_tokens`` stops early (and
    is required for the endless synthetic source); by default a finite source is written for one
    epoch. ``max_doc_tokens`` truncates each document (e.g. to seq_len: 2x smaller files for the
    paper's truncate-and-pad batches, but then packing sees only the truncated documents).
    """
    from . import build_source  # late import: data/__init__ imports this module's siblings

    if hasattr(data_cfg, "_metadata"):  # an OmegaConf node: store plain, resolved values in meta.json
        from omegaconf import OmegaConf

        data_cfg = OmegaConf.to_container(data_cfg, resolve=True)
    cfg = dict(data_cfg)
    source = build_source(cfg, model_vocab_size=model_vocab_size)
    if hasattr(source, "shuffle"):
        source.shuffle = False
    if train_tokens is None and source.name == "synthetic":
        raise ValueError("the synthetic source is endless: pass train_tokens (--train-tokens)")
    if dtype == "auto":
        ids = source.vocab_size or getattr(getattr(source, "info", None), "size", None) or 2**32
        dtype = "uint16" if ids <= 2**16 else "uint32"
    os.makedirs(out_dir, exist_ok=True)

    def one_epoch():
        for pos, toks, _ in source.train_docs(0, 1, 0, [0, 0, 0], max_doc_tokens):
            if pos[0] > 0:
                return
            yield toks

    def val_stream():
        total = 0
        for toks in source.val_docs(max_doc_tokens):
            yield toks
            total += len(toks)
            if val_tokens is not None and total >= val_tokens:
                return

    splits = {"train": write_split(out_dir, "train", one_epoch(), dtype, train_tokens),
              "validation": write_split(out_dir, "validation", val_stream(), dtype)}
    info = getattr(source, "info", None)
    meta = {
        "dtype": dtype,
        "vocab_size": source.vocab_size,
        "tokenizer": None if info is None else str(cfg.get("tokenizer")),
        "pad_id": source.pad_id,
        "eos_id": source.eos_id,
        "loss_floor": source.loss_floor,
        "max_doc_tokens": max_doc_tokens,
        "source": cfg,
        "splits": splits,
    }
    write_meta(out_dir, meta)
    return meta
