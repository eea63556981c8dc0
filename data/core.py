"""The source-independent half of the pipeline: rows, batches, rank/worker sharding, exact resume.

Every source (c4, local, synthetic, tokens) only has to answer two questions:

* ``train_docs(reader, n_readers, seed, start, max_tokens)``: the documents of one *reader* (a
  disjoint part of the training stream), in a deterministic order that depends on ``seed`` and the
  epoch, as ``(position, token_ids, position_after)`` triples, starting exactly at ``start``;
* ``val_docs(max_tokens)``: the validation documents in their fixed order.

A position is three ints ``[epoch, major, minor]`` whose meaning belongs to the source (file and
document index for C4, index into a per-epoch permutation for local/tokens, row index for synthetic).
Positions are cheap to restore, which is the whole design: instead of a shuffle buffer (whose
contents ``datasets`` cannot checkpoint, see docs), shuffling is a pure function of
``(seed, epoch, file, window)``, so "where am I" is a few integers, not a buffer of documents.

Readers: rank ``r`` with ``W`` DataLoader workers owns readers ``r*W .. r*W+W-1`` out of
``world_size*W``. Workers therefore never read the same documents, and ranks are disjoint. A
DataLoader hands out batches round-robin over its workers (in order), so the batches a rank sees are
the readers' batches interleaved; the checkpoint stores every reader's position plus the number of
consumed batches, and a resumed loader rotates the worker-to-reader assignment so that worker 0
serves the reader whose turn is next.
"""
from __future__ import annotations

import warnings
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = ["DataModule", "Source", "doc_rows"]

Pos = list  # [epoch, major, minor]


class Source:
    """Base class of a document source (see the module docstring for the contract)."""

    name = "source"
    vocab_size: int | None = None  # set when the source brings its own vocabulary
    loss_floor: float | None = None
    pad_id: int = 0
    eos_id: int | None = None

    def train_docs(self, reader: int, n_readers: int, seed: int, start: Pos,
                   max_tokens: int | None) -> Iterator[tuple[Pos, np.ndarray, Pos]]:
        raise NotImplementedError

    def val_docs(self, max_tokens: int | None) -> Iterator[np.ndarray]:
        raise NotImplementedError


def doc_rows(docs, seq_len: int, packing: bool, pad_id: int, start_offset: int = 0):
    """Turn ``(pos, tokens, pos_after)`` documents into rows ``(row[seq_len], n_real, resume_state)``.

    Without packing (the paper): one document per row, truncated to seq_len and right-padded; the
    remainder of a long document is dropped. With packing: documents (each already ending in EOS)
    are concatenated and cut into full rows; a document cut at a row boundary continues in the next
    row, so ``resume_state`` is ``(position of the document in progress, tokens of it already used)``.
    """
    if not packing:
        for _, toks, after in docs:
            n = min(len(toks), seq_len)
            if n == 0:
                continue  # an all-pad row would have no loss at all
            row = np.full(seq_len, pad_id, dtype=np.int64)
            row[:n] = toks[:n]
            yield row, n, (list(after), 0)
        return
    parts, filled, first = [], 0, True
    for pos, toks, after in docs:
        off = start_offset if first else 0
        first = False
        while off < len(toks):
            take = min(seq_len - filled, len(toks) - off)
            parts.append(np.asarray(toks[off:off + take], dtype=np.int64))
            filled += take
            off += take
            if filled == seq_len:
                state = (list(after), 0) if off == len(toks) else (list(pos), off)
                yield np.concatenate(parts), seq_len, state
                parts, filled = [], 0


def _to_batch(rows: list) -> dict:
    ids = torch.from_numpy(np.stack([r[0] for r in rows]))
    labels = ids.clone()
    for i, (_, n, _) in enumerate(rows):
        labels[i, n:] = -100  # pad positions never count in the loss (mask by position, not by id)
    return {"input_ids": ids, "labels": labels}


def _identity(x):
    return x


class _TrainStream(IterableDataset):
    """One rank's training batches; inside a DataLoader each worker serves one reader."""

    def __init__(self, source, batch_size, seq_len, packing, rank, world_size, workers, seed,
                 reader_states, rotation):
        self.source, self.batch_size, self.seq_len, self.packing = source, batch_size, seq_len, packing
        self.rank, self.world_size, self.workers, self.seed = rank, world_size, workers, seed
        self.reader_states, self.rotation = reader_states, rotation

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        logical = (worker + self.rotation) % self.workers
        epoch, major, minor, offset = self.reader_states[logical]
        docs = self.source.train_docs(
            self.rank * self.workers + logical, self.world_size * self.workers, self.seed,
            [epoch, major, minor], None if self.packing else self.seq_len,
        )
        rows = []
        for row in doc_rows(docs, self.seq_len, self.packing, self.source.pad_id, offset):
            rows.append(row)
            if len(rows) == self.batch_size:
                batch = _to_batch(rows)
                pos, off = rows[-1][2]
                batch["_state"] = [int(pos[0]), int(pos[1]), int(pos[2]), int(off)]
                batch["_reader"] = logical
                rows = []
                yield batch


class DataModule:
    """What train.py consumes: infinite training batches with an exact resume point, fixed validation.

    Attributes: ``vocab_size`` (ids the model must embed if the source has its own vocabulary, else
    None), ``loss_floor`` (best achievable loss in nats/token if known), ``source`` (the document
    source), ``seq_len``, ``micro_batch_size``, ``rank``, ``world_size``.
    """

    def __init__(self, source: Source, *, micro_batch_size: int, seq_len: int, packing: bool = False,
                 num_workers: int = 0, rank: int = 0, world_size: int = 1, seed: int = 0):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        self.source = source
        self.micro_batch_size, self.seq_len, self.packing = int(micro_batch_size), int(seq_len), bool(packing)
        self.num_workers, self.rank, self.world_size, self.seed = int(num_workers), int(rank), int(world_size), int(seed)
        self._readers = max(1, self.num_workers)
        self._consumed = 0
        self._states = [[0, 0, 0, 0] for _ in range(self._readers)]
        self._val_cache: dict[int, list] = {}

    @property
    def vocab_size(self) -> int | None:
        return self.source.vocab_size

    @property
    def loss_floor(self) -> float | None:
        return self.source.loss_floor

    # ----------------------------------------------------------------------------------- training
    def train_batches(self) -> Iterator[dict]:
        """Infinite iterator of ``{"input_ids", "labels"}`` LongTensors of shape (B, seq_len).

        Starts at the current position (the start, or wherever ``load_state_dict`` / earlier
        consumption left it). The position advances when the caller receives a batch, so batches a
        DataLoader prefetched but the loop never took are not counted as seen.
        """
        stream = _TrainStream(self.source, self.micro_batch_size, self.seq_len, self.packing, self.rank,
                              self.world_size, self._readers, self.seed,
                              [list(s) for s in self._states], self._consumed % self._readers)
        if self.num_workers > 0:
            it = iter(DataLoader(stream, batch_size=None, num_workers=self.num_workers,
                                 collate_fn=_identity, prefetch_factor=2))
        else:
            it = iter(stream)
        for batch in it:
            reader = batch.pop("_reader")
            state = batch.pop("_state")
            self._states[reader] = [int(x) for x in state]
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict:
        """Plain-Python resume point: consumed micro-batches and every reader's stream position."""
        return {
            "source": self.source.name,
            "consumed": self._consumed,
            "readers": [list(s) for s in self._states],
            "world_size": self.world_size,
            "rank": self.rank,
            "num_workers": self.num_workers,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "packing": self.packing,
            "seed": self.seed,
        }

    def load_state_dict(self, sd: dict) -> None:
        # The stream's partition depends on these; continuing with others would silently replay or
        # skip data, so refuse and say what differs.
        for key in ("source", "rank", "world_size", "num_workers", "micro_batch_size", "seq_len", "packing", "seed"):
            mine = getattr(self, key) if key != "source" else self.source.name
            if key in sd and sd[key] != mine:
                raise ValueError(
                    f"cannot resume the data stream exactly: the checkpoint has {key}={sd[key]!r}, this run "
                    f"has {key}={mine!r}. Resume with the same data settings and number of processes "
                    "(each rank loads its own data state)."
                )
        readers = [[int(x) for x in s] for s in sd["readers"]]
        if len(readers) != self._readers:
            raise ValueError(f"checkpoint has {len(readers)} reader positions, expected {self._readers}")
        self._states = readers
        self._consumed = int(sd["consumed"])

    # --------------------------------------------------------------------------------- validation
    def val_batches(self, eval_tokens: int) -> list[dict]:
        """This rank's share of the fixed validation set, as a list of batches.

        The set is the first validation documents (in the split's fixed order, never shuffled) whose
        non-pad target tokens (what the loss scores: all but each row's first) reach ``eval_tokens``, built into rows exactly like training rows; row i
        belongs to rank ``i % world_size``. The last batch may be smaller than micro_batch_size.
        Callers weight the loss by label counts so the ranks' means combine exactly.
        """
        eval_tokens = int(eval_tokens)
        if eval_tokens not in self._val_cache:
            docs = (([0, 0, 0], t, [0, 0, 0]) for t in self.source.val_docs(None if self.packing else self.seq_len))
            rows, total = [], 0
            for row, n, _ in doc_rows(docs, self.seq_len, self.packing, self.source.pad_id):
                rows.append((row.astype(np.int32), n))
                total += max(n - 1, 0)  # scored targets: a row's first token is never predicted
                if total >= eval_tokens:
                    break
            if total < eval_tokens:
                warnings.warn(f"the validation split has only {total} tokens (< eval_tokens={eval_tokens}); using all")
            self.val_tokens_total = total
            self._val_cache = {eval_tokens: rows}  # keep one set only: 10M tokens is ~40 MB as int32
        mine = self._val_cache[eval_tokens][self.rank::self.world_size]
        out = []
        for i in range(0, len(mine), self.micro_batch_size):
            chunk = [(r.astype(np.int64), n, None) for r, n in mine[i:i + self.micro_batch_size]]
            out.append(_to_batch(chunk))
        return out
