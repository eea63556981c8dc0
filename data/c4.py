"""C4 (allenai/c4, "en") streamed through Hugging Face ``datasets``: from the Hub or local shards.

``path: null`` streams ``load_dataset("allenai/c4", "en", streaming=True)``; ``path: <dir>`` reads the
original shards ``c4-{train,validation}.XXXXX-of-NNNNN.json.gz`` (in ``<dir>/en/`` or ``<dir>/``)
through the same streaming code (``load_dataset("json", ...)``).

With ``F`` files and ``R`` readers, reader ``r`` reads the files of group ``r % gcd(F, R)`` and every
``R/gcd``-th document of them (``member = r // gcd``). ``datasets``' buffer shuffle cannot be resumed
exactly, so instead the file order is permuted by ``(seed, epoch)`` and a reader's documents of a file
are permuted in windows of ``shuffle_window`` by ``(seed, epoch, file, window, member)``. A position
is ``[epoch, file slot, index among the reader's documents of that file]``: resuming skips to the
window start and re-derives the permutation. Why, and the memory per reader: docs/data_pipeline.md.
"""
from __future__ import annotations

import glob
import math
import os

import numpy as np

from frugal.checks import check_integer

from .errors import DataConfigError, DataFileNotFoundError
from .rows import Source
from .tokenizer import encode_batch

__all__ = ["C4Source", "c4_files"]

JSON_CHUNK_BYTES = 1 << 20  # datasets' json reader block: bounds each open stream's buffers
RAW_BATCH = 256  # raw documents pulled from a stream at a time
CHUNK = 64  # documents tokenized together


def c4_files(path: str, split: str) -> list[str]:
    """The sorted local shard files of a split, accepting ``<dir>/en/`` or the ``en`` dir itself."""
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise DataFileNotFoundError(
            f"data.path={path!r} is not a directory. Point it at a folder of C4 shards "
            "(en/c4-train.00000-of-01024.json.gz ...), or set data.path=null to stream from the Hub.")
    for sub in ("en", "."):
        files = sorted(glob.glob(os.path.join(path, sub, f"c4-{split}.*.json.gz"))
                       + glob.glob(os.path.join(path, sub, f"c4-{split}.*.json")))
        if files:
            return files
    raise DataFileNotFoundError(
        f"data.path={path!r} has no C4 {split} shards: expected files like "
        f"{os.path.join(path, 'en', f'c4-{split}.00000-of-XXXXX.json.gz')}")


def _hub_error(exc: Exception) -> DataConfigError:
    return DataConfigError(
        "Could not stream allenai/c4 from the Hugging Face Hub "
        f"({type(exc).__name__}: {str(exc)[:200]}). Offline or on a cluster without internet, point "
        "data.path at a directory of local C4 shards, e.g. data.path=/datasets/c4 containing "
        "en/c4-train.00000-of-01024.json.gz ... and en/c4-validation.00000-of-00008.json.gz ... "
        "(download them once with `huggingface-cli download allenai/c4 --repo-type dataset "
        "--include 'en/*'`).")


class C4Source(Source):
    name = "c4"

    def __init__(self, path, tokenizer, info, shuffle: bool = True, shuffle_window: int = 1024):
        import datasets
        from datasets.exceptions import DatasetNotFoundError

        check_integer("data.shuffle_window", shuffle_window, 1, error=DataConfigError)
        self.path, self.shuffle, self.window = path, bool(shuffle), int(shuffle_window)
        self._use_tokenizer(tokenizer, info)

        def stream(*args, split, **kwargs):
            return datasets.load_dataset(*args, split=split, streaming=True, chunksize=JSON_CHUNK_BYTES, **kwargs)

        if path is None:
            try:
                self._train = stream("allenai/c4", "en", split="train")
                self._val = stream("allenai/c4", "en", split="validation")
            # Offline (HF_DATASETS_OFFLINE) or no network: ConnectionError; a Hub that answers "no such
            # dataset" (a mirror, a gated copy): DatasetNotFoundError.
            except (ConnectionError, DatasetNotFoundError) as exc:
                raise _hub_error(exc) from exc
        else:
            files = {"train": c4_files(path, "train"), "validation": c4_files(path, "validation")}
            self._train = stream("json", data_files=files, split="train")
            self._val = stream("json", data_files=files, split="validation")
        self.n_files = self._train.n_shards

    def identity(self) -> dict:
        return {"name": self.name, "files": self.n_files, "shuffle": self.shuffle, "shuffle_window": self.window}

    def _file_order(self, seed: int, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_files)
        return np.random.default_rng([int(seed), int(epoch), 11]).permutation(self.n_files)

    def train_docs(self, reader, n_readers, seed, start, max_tokens):
        groups = math.gcd(self.n_files, n_readers)
        share, group, member = n_readers // groups, reader % groups, reader // groups
        epoch, slot, minor = (int(x) for x in start)
        produced, whole_epoch = 0, slot == 0 and minor == 0
        while True:
            files = self._file_order(seed, epoch)[group::groups]
            while slot < len(files):
                for k, ids in self._file_docs(int(files[slot]), share, member, seed, epoch, minor, max_tokens):
                    produced += 1
                    yield [epoch, slot, k], ids, [epoch, slot, k + 1]
                slot, minor = slot + 1, 0
            if produced == 0 and whole_epoch:
                raise DataConfigError(
                    f"c4: reader {reader} of data.readers={n_readers} found no documents in a whole epoch "
                    f"({self.n_files} shard file(s)); lower data.readers or add shards")
            epoch, slot, produced, whole_epoch = epoch + 1, 0, 0, True

    def _file_docs(self, fid, share, member, seed, epoch, start, max_tokens):
        """``(index, ids)`` of this reader's documents of one file (every share-th, from member),
        from the reader's own document ``start`` on, window-shuffled."""
        W = self.window
        window, skip = divmod(start, W)
        ds = self._train.shard(num_shards=self.n_files, index=fid)
        if window:
            ds = ds.skip(window * W * share)
        texts: list[str] = []
        # .iter(batch_size) rather than iter(ds): inside a DataLoader worker, iter(ds) would re-split
        # the shards across workers by itself; the partition here is ours.
        for raw in ds.iter(batch_size=RAW_BATCH * share):
            texts += raw["text"][member::share]
            while len(texts) >= W:
                yield from self._window(texts[:W], window, skip, fid, member, seed, epoch, max_tokens)
                texts, window, skip = texts[W:], window + 1, 0
        if texts:
            yield from self._window(texts, window, skip, fid, member, seed, epoch, max_tokens)

    def _window(self, texts, window, skip, fid, member, seed, epoch, max_tokens):
        if self.shuffle:
            perm = np.random.default_rng([int(seed), int(epoch), int(fid), int(window), int(member), 13])
            texts = [texts[q] for q in perm.permutation(len(texts))]
        for i in range(skip, len(texts), CHUNK):
            for k, ids in enumerate(encode_batch(self.tok, self.info, texts[i:i + CHUNK], max_tokens), start=i):
                yield window * self.window + k, ids

    shuffles_validation = True  # eval.mode=authors: val_docs(shuffle_seed=42)

    def val_docs(self, max_tokens, shuffle_seed: int | None = None):
        # The validation split in its natural (file, line) order: the same documents on every run; with
        # shuffle_seed, datasets' own streaming shuffle of it (shard order + a 1000-document buffer,
        # its defaults), as the paper's code called it: .shuffle(seed=42) (eval.mode=authors).
        val = self._val if shuffle_seed is None else self._val.shuffle(seed=shuffle_seed)
        try:
            for batch in val.iter(batch_size=CHUNK):
                yield from encode_batch(self.tok, self.info, batch["text"], max_tokens)
        except ConnectionError as exc:  # a Hub stream that drops mid-way
            raise _hub_error(exc) from exc
