"""C4 (allenai/c4, "en") streamed through Hugging Face ``datasets``: from the Hub or local shards.

``path: null`` streams ``load_dataset("allenai/c4", "en", streaming=True)``. ``path: <dir>`` reads the
original-format shards ``c4-train.XXXXX-of-01024.json.gz`` / ``c4-validation.XXXXX-of-00008.json.gz``
(in ``<dir>/en/`` or ``<dir>/`` itself) through the same streaming code
(``load_dataset("json", data_files=..., streaming=True)``): most clusters keep C4 on a shared disk.

Shuffling, designed for exact resume. ``datasets``' ``.shuffle(buffer_size=...)`` cannot be resumed
exactly (its buffer is not checkpointed; documents are lost). Instead:

1. the order of the shard files is a permutation seeded by ``(seed, epoch)``;
2. each file is read in windows of ``shuffle_window`` documents and every window is permuted by a
   generator seeded by ``(seed, epoch, file, window)``.

A position is then ``[epoch, file slot, window * shuffle_window + index in the permuted window]``;
resuming re-opens that file, skips to the window start (``IterableDataset.skip``), re-derives the same
permutation and continues at the same index: no replay, no skip. C4's files are themselves random
samples of the crawl, so file-order plus window shuffling decorrelates as well as a buffer would.

Sharding: with ``n`` readers (ranks x workers) and a file count divisible by ``n`` (C4 train: 1024
files), each reader owns whole files. Otherwise (a single local test shard, say) every reader
parses each file but keeps only documents ``r, r+n, ...`` of it -- still disjoint, and only its own
documents are tokenized (the expensive part).
"""
from __future__ import annotations

import glob
import os
from itertools import islice

import numpy as np

from .core import Source
from .tokenizer import encode_batch

__all__ = ["C4Source", "c4_files"]


def c4_files(path: str, split: str) -> list[str]:
    """The sorted local shard files of a split, accepting ``<dir>/en/`` or the ``en`` dir itself."""
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"data.path={path!r} is not a directory. Point it at a folder of C4 shards "
            "(en/c4-train.00000-of-01024.json.gz ...), or set data.path=null to stream from the Hub."
        )
    for sub in ("en", "."):
        files = sorted(glob.glob(os.path.join(path, sub, f"c4-{split}.*.json.gz"))
                       + glob.glob(os.path.join(path, sub, f"c4-{split}.*.json")))
        if files:
            return files
    raise FileNotFoundError(
        f"data.path={path!r} has no C4 {split} shards: expected files like "
        f"{os.path.join(path, 'en', f'c4-{split}.00000-of-XXXXX.json.gz')}"
    )


def _hub_error(exc: Exception) -> RuntimeError:
    return RuntimeError(
        "Could not stream allenai/c4 from the Hugging Face Hub "
        f"({type(exc).__name__}: {str(exc)[:200]}). Offline or on a cluster without internet, point "
        "data.path at a directory of local C4 shards, e.g. data.path=/datasets/c4 containing "
        "en/c4-train.00000-of-01024.json.gz ... and en/c4-validation.00000-of-00008.json.gz ... "
        "(download them once with `huggingface-cli download allenai/c4 --repo-type dataset "
        "--include 'en/*'`)."
    )


class C4Source(Source):
    name = "c4"

    def __init__(self, path, tokenizer, info, shuffle: bool = True, shuffle_window: int = 1024):
        import datasets

        self.path = path
        self.tok, self.info = tokenizer, info
        self.shuffle = bool(shuffle)
        self.window = int(shuffle_window)
        if self.window < 1:
            raise ValueError(f"data.shuffle_window must be >= 1, got {shuffle_window}")
        self.pad_id, self.eos_id = info.pad_id, info.eos_id
        try:
            if path is None:
                self._train = datasets.load_dataset("allenai/c4", "en", split="train", streaming=True)
                self._val = datasets.load_dataset("allenai/c4", "en", split="validation", streaming=True)
            else:
                files = {"train": c4_files(path, "train"), "validation": c4_files(path, "validation")}
                self._train = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
                self._val = datasets.load_dataset("json", data_files=files, split="validation", streaming=True)
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, FileNotFoundError) and path is not None:
                raise
            raise _hub_error(exc) from exc
        self.n_files = self._train.n_shards

    def _file_order(self, seed: int, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_files)
        return np.random.default_rng([int(seed), int(epoch), 11]).permutation(self.n_files)

    def train_docs(self, reader, n_readers, seed, start, max_tokens):
        W = self.window
        whole_files = self.n_files % n_readers == 0
        epoch, slot, minor = (int(x) for x in start)
        resuming, produced = True, 0  # a resumed epoch may legitimately have nothing left
        while True:
            order = self._file_order(seed, epoch)
            mine = order[reader::n_readers] if whole_files else order
            while slot < len(mine):
                fid = int(mine[slot])
                window, skip = divmod(minor, W)
                ds = self._train.shard(num_shards=self.n_files, index=fid)
                if window:
                    ds = ds.skip(window * W)
                # .iter(batch_size) rather than iter(ds): inside a DataLoader worker, iter(ds) would
                # re-split the shards across workers by itself (and stop workers beyond n_shards);
                # the partition here is ours, decided above.
                for raw in ds.iter(batch_size=W):
                    raw = raw["text"]
                    texts = [text for j, text in enumerate(raw)
                             if whole_files or (window * W + j) % n_readers == reader]
                    if self.shuffle:
                        perm = np.random.default_rng([int(seed), epoch, fid, window, 13]).permutation(len(texts))
                        texts = [texts[q] for q in perm]
                    toks = encode_batch(self.tok, self.info, texts[skip:], max_tokens) if skip < len(texts) else []
                    for k, t in enumerate(toks, start=skip):
                        yield [epoch, slot, window * W + k], t, [epoch, slot, window * W + k + 1]
                    produced += len(toks)
                    skip, window = 0, window + 1
                slot, minor = slot + 1, 0
            if produced == 0 and not resuming:
                raise RuntimeError(f"c4: reader {reader} of {n_readers} found no documents in a whole epoch")
            epoch, slot, resuming, produced = epoch + 1, 0, False, 0

    def val_docs(self, max_tokens):
        # The validation split in its natural (file, line) order: the same documents on every run.
        try:
            for batch in self._val.iter(batch_size=256):
                yield from encode_batch(self.tok, self.info, batch["text"], max_tokens)
        except ConnectionError as exc:  # a Hub stream that drops mid-way
            raise _hub_error(exc) from exc
