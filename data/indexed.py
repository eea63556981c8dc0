"""Sources with random access to numbered training documents: your own text, pre-tokenized files.

One seeded shuffle of the ``n`` training documents per epoch; reader ``r`` of ``R`` reads documents
``r, r + R, ...`` of the endless sequence epoch 0, epoch 1, ..., its position ``[epoch of the last
document read, counter, 0]``. The shuffle is blockwise (blocks of 2^20, block order and each block
permuted by ``(seed, epoch, block)``), so a permutation of ``n`` is never materialised.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .rows import Source

__all__ = ["IndexedSource", "BlockShuffle"]


class BlockShuffle:
    """A seeded permutation of ``range(n)`` for one epoch, evaluated lazily, block by block."""

    BLOCK = 1 << 20

    def __init__(self, n: int, seed: int, epoch: int, enabled: bool = True, block: int | None = None):
        self.n, self.seed, self.epoch, self.enabled = int(n), int(seed), int(epoch), bool(enabled)
        self.block = int(block or self.BLOCK)
        blocks = -(-self.n // self.block)
        self.order = (np.random.default_rng([self.seed, self.epoch, 7]).permutation(blocks) if self.enabled
                      else np.arange(blocks))
        self.sizes = np.minimum(self.block, self.n - self.order * self.block)
        self.ends = np.cumsum(self.sizes)
        self._inner: OrderedDict = OrderedDict()  # the few blocks in use: readers advance together

    def _perm(self, b: int) -> np.ndarray:
        if b not in self._inner:
            size = min(self.block, self.n - b * self.block)
            self._inner[b] = np.random.default_rng([self.seed, self.epoch, b, 9]).permutation(size).astype(np.int64)
            if len(self._inner) > 4:
                self._inner.popitem(last=False)
        self._inner.move_to_end(b)
        return self._inner[b]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if not self.enabled:
            return positions
        slot = np.searchsorted(self.ends, positions, side="right")
        offset = positions - (self.ends[slot] - self.sizes[slot])
        blocks = self.order[slot]
        out = np.empty_like(positions)
        for b in np.unique(blocks):
            here = blocks == b
            out[here] = b * self.block + self._perm(int(b))[offset[here]]
        return out


class IndexedSource(Source):
    """Subclasses give ``n_train()``, ``get_train(indices, max_tokens)`` and ``val_docs``."""

    shuffle = True
    CHUNK = 64  # documents fetched (and tokenized) together per reader: bounded, batched work

    def n_train(self) -> int:
        raise NotImplementedError

    def get_train(self, indices: np.ndarray, max_tokens: int | None) -> list[np.ndarray]:
        raise NotImplementedError

    def _shuffle(self, seed: int, epoch: int) -> BlockShuffle:
        cache = self.__dict__.setdefault("_shuffles", OrderedDict())
        key = (int(seed), int(epoch))
        if key not in cache:
            cache[key] = BlockShuffle(self.n_train(), seed, epoch, self.shuffle)
            if len(cache) > 2:
                cache.popitem(last=False)
        return cache[key]

    def train_docs(self, reader, n_readers, seed, start, max_tokens):
        n = self.n_train()
        j = int(start[1])
        while True:
            counters = np.arange(j, j + self.CHUNK)
            places = reader + counters * n_readers  # places in the endless sequence of epochs
            epochs = places // n
            ids = np.empty_like(places)
            for e in np.unique(epochs):
                here = epochs == e
                ids[here] = self._shuffle(seed, int(e))(places[here] % n)
            for c, e, toks in zip(counters, epochs, self.get_train(ids, max_tokens)):
                yield [int(e), int(c), 0], toks, [int(e), int(c) + 1, 0]
            j += self.CHUNK

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_shuffles", None)  # rebuilt lazily in each DataLoader worker
        return state
