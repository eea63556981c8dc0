"""The source-independent half of the pipeline: batches, logical readers, workers, exact resume.

Global micro-batch ``k`` is the ``k // R``-th batch of reader ``k % R`` (``R = data.readers``); rank
``r`` of ``W`` takes global micro-batches ``r, r + W, ...``, and DataLoader worker ``j`` the rank's
local micro-batches ``j, j + workers, ...``. So the sequence depends on (seed, data settings, micro-batch
size, R), never on the number of processes or workers. A rank's checkpoint part is its readers'
positions (a few integers: the shuffles are pure functions of seed, epoch and place) and its count of
micro-batches; ``merge_states`` makes one world-size-independent state. docs/data_pipeline.md.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import warnings
import weakref
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from frugal.checks import check_integer

from .errors import DataConfigError
from .rows import RowFormat, Source, doc_rows, to_batch

__all__ = ["DataModule", "merge_states", "DEFAULT_READERS", "STOP_SIGNALS"]

# any power-of-two layout up to 64 processes x workers; C4's 1024 files split into whole files (docs/data_pipeline.md)
DEFAULT_READERS = 64
# eval.mode: tokens, the token-weighted mean over the fixed validation set; authors, as the paper's code
# (GaLore's evaluate_model, PAPER_NOTES.md "Evaluation"): C4 validation through .shuffle(seed=42), batches
# until more than eval_tokens non-pad tokens, perplexity = exp(mean of the per-batch mean losses).
EVAL_MODES = ("tokens", "authors")
AUTHORS_VAL_SEED = 42
STATE_FORMAT = 2
# SLURM's scancel and preemption signal the whole process group: DataLoader workers must survive
# them and let the main process decide (checkpoint, exit 75).
STOP_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2") if hasattr(signal, s))


def _identity(x):
    return x


def _ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn: the main process alone decides what a stop signal means."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


# Workers ignore SIGTERM, which multiprocessing's exit hook sends them: shut live loaders down first
# (atexit runs the last-registered hook first, and this module is imported after multiprocessing).
_LIVE_ITERATORS: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _shutdown_live_iterators() -> None:
    for iterator in list(_LIVE_ITERATORS):
        iterator._shutdown_workers()  # torch's multi-process iterator; idempotent


@contextlib.contextmanager
def _stop_signals_blocked():
    """Block the stop signals while workers are forked (between fork and worker_init_fn a signal would
    kill a worker); the parent gets any such signal when the mask is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _reader_batches(source: Source, fmt: RowFormat, reader: int, n_readers: int, seed: int, state: list,
                    batch_size: int):
    """One logical reader's batches: ``(rows, state after the batch, epoch events)``, endlessly."""
    epoch, major, minor, offset = (int(x) for x in state)
    events: list[dict] = []

    def docs():
        last = epoch
        for pos, ids, after in source.train_docs(reader, n_readers, seed, [epoch, major, minor], fmt.text_tokens):
            if pos[0] > last:
                last = int(pos[0])
                events.append({"event": "epoch", "source": source.name, "reader": reader, "epoch": last})
            yield pos, ids, after

    rows = []
    for row in doc_rows(docs(), fmt, source.pad_id, offset):
        rows.append(row)
        if len(rows) == batch_size:
            pos, off = rows[-1][2]
            yield rows, [int(pos[0]), int(pos[1]), int(pos[2]), int(off)], list(events)
            rows, events[:] = [], []


class _TrainStream(IterableDataset):
    """One rank's training batches in global order; inside a DataLoader, worker j serves the rank's
    local micro-batches j, j + workers, ... and with them the readers whose turns those are."""

    def __init__(self, source, fmt, batch_size, rank, world_size, n_readers, slots, seed, positions, consumed):
        self.source, self.fmt, self.batch_size = source, fmt, batch_size
        self.rank, self.world_size, self.n_readers, self.slots, self.seed = rank, world_size, n_readers, slots, seed
        self.positions, self.consumed = positions, consumed

    def __iter__(self):
        info = get_worker_info()
        i = self.consumed + (info.id if info is not None else 0)  # this rank's local micro-batch index
        readers = {}  # opened lazily, on a reader's first turn
        while True:
            reader = (self.rank + i * self.world_size) % self.n_readers
            if reader not in readers:
                readers[reader] = _reader_batches(self.source, self.fmt, reader, self.n_readers, self.seed,
                                                  self.positions[reader], self.batch_size)
            rows, state, events = next(readers[reader])
            batch = to_batch(rows)
            batch.update(_reader=reader, _state=state, _events=events)
            yield batch
            i += self.slots


def _resolve_pin_memory(value) -> bool:
    """Pinned memory (non_blocking copies) exists only with CUDA: ``true`` without it means false."""
    if value == "auto" or value is None:
        return torch.cuda.is_available()
    if isinstance(value, bool):
        return value and torch.cuda.is_available()
    raise DataConfigError(f"data.pin_memory={value!r} is invalid; choose auto, true or false")


def _int_setting(key: str, value, minimum: int) -> int:
    return check_integer(key, value, minimum, error=DataConfigError)


AUTO_WORKERS = "auto"


def spare_cores() -> int:
    """CPU cores this process may use (its affinity) per local process, less the training process's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)  # torchrun's processes on this node
    return max(0, cores // max(1, local) - 1)


def auto_workers(need: int, readers: int, world_size: int) -> int:
    """``data.num_workers=auto``: ``need`` DataLoader workers per rank (train.py sizes it from the device's
    demand), at most one per spare CPU core, a count whose product with the world size divides the readers."""
    workers = min(int(need), spare_cores())
    while workers > 0 and readers % (world_size * workers):
        workers -= 1
    return workers


# Settings a checkpoint's data state must share with the run that continues it, with their config keys.
_RESUME_KEYS = {"micro_batch_size": "train.micro_batch_size", "seq_len": "data.seq_len", "packing": "data.packing",
                "truncation": "data.truncation", "readers": "data.readers", "seed": "train.seed"}


class DataModule:
    """What train.py consumes: endless training batches with an exact resume point, fixed validation
    (docs/data_pipeline.md has the calls and attributes)."""

    def __init__(self, source: Source, *, micro_batch_size: int, seq_len: int, packing: bool = False,
                 truncation: str = "reference", readers: int = DEFAULT_READERS, num_workers: int = 0,
                 pin_memory="auto", rank: int = 0, world_size: int = 1, seed: int = 0, eval_mode: str = "tokens"):
        if eval_mode not in EVAL_MODES:
            raise DataConfigError(f"eval.mode={eval_mode!r} is invalid; valid choices: {', '.join(EVAL_MODES)}")
        if eval_mode == "authors" and not getattr(source, "shuffles_validation", False):
            raise DataConfigError(
                f"eval.mode=authors evaluates as the paper's code did, on C4's validation split shuffled with "
                f"seed {AUTHORS_VAL_SEED}; data.name={getattr(source, 'name', '?')!r} has no such split: use data=c4 "
                "or eval.mode=tokens")
        self.eval_mode = eval_mode
        self.micro_batch_size = _int_setting("train.micro_batch_size", micro_batch_size, 1)
        self.seq_len = _int_setting("data.seq_len", seq_len, 2)
        self.readers = _int_setting("data.readers", readers, 1)
        self.world_size = _int_setting("world_size", world_size, 1)
        if num_workers == AUTO_WORKERS:
            num_workers = auto_workers(1, self.readers, self.world_size)
        self.num_workers = check_integer("data.num_workers", num_workers, 0, error=DataConfigError,
                                         why=", or 'auto' (as many as the device needs, within the spare CPU cores)")
        if not 0 <= rank < world_size:
            raise DataConfigError(f"rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.seed = int(rank), int(seed)
        self.source, self.packing, self.truncation = source, bool(packing), str(truncation)
        self.fmt = RowFormat(source, self.seq_len, self.packing, self.truncation)
        self._check_finished_rows()
        slots = max(1, self.num_workers)
        if self.readers % (self.world_size * slots):
            raise DataConfigError(self._readers_message(slots))
        self.pin_memory = _resolve_pin_memory(pin_memory)
        self._consumed = 0  # micro-batches this rank has handed out
        self._positions = [[0, 0, 0, 0] for _ in range(self.readers)]
        self._events: list[dict] = []
        self._val: tuple[tuple, list] | None = None  # ((eval_tokens, eval_mode), rows of all ranks)
        self._warned_short = False

    def _readers_message(self, slots: int) -> str:
        per_rank = self.readers // self.world_size if self.readers % self.world_size == 0 else 0
        workers = [0] + [d for d in range(1, per_rank + 1) if per_rank % d == 0] if per_rank else []
        multiple = self.world_size * slots
        return (
            f"data.readers={self.readers} must be a multiple of world size ({self.world_size}) x DataLoader "
            f"workers per rank (data.num_workers={self.num_workers}, counted as {slots}) = {multiple}. "
            + (f"Valid data.num_workers for {self.world_size} process(es): {workers}. " if workers else
               f"No worker count fits {self.world_size} processes. ")
            + f"Or set data.readers to a multiple of {multiple} "
            f"(e.g. {multiple * max(1, -(-self.readers // multiple))}); "
            "that changes the order of the training data, so keep it fixed across runs you compare.")

    def _check_finished_rows(self) -> None:
        spec = self.source.rows
        if spec is None:
            return
        if spec.get("truncation") is None:  # complete windows (synthetic): packing changes nothing
            mismatch = spec["seq_len"] != self.seq_len
        else:
            mismatch = (spec["seq_len"], spec["truncation"], False) != (self.seq_len, self.truncation, self.packing)
        if mismatch:
            raise DataConfigError(
                f"the {self.source.name} data holds finished rows of seq_len={spec['seq_len']} "
                f"(truncation={spec.get('truncation')}, no packing), but this run asks for "
                f"data.seq_len={self.seq_len}, "
                f"data.truncation={self.truncation}, data.packing={self.packing}. Use those settings, or write "
                "token files with `scripts/pretokenize.py --layout documents` (any seq_len, packing or not).")

    @property
    def vocab_size(self) -> int | None:
        return self.source.vocab_size

    @property
    def loss_floor(self) -> float | None:
        return self.source.loss_floor

    # ----------------------------------------------------------------------------------- training
    def train_batches(self) -> Iterator[dict]:
        """Endless ``{"input_ids", "labels"}`` LongTensors (B, seq_len) from the current position, which
        advances when the caller receives a batch (prefetched batches never taken are not seen)."""
        stream = _TrainStream(self.source, self.fmt, self.micro_batch_size, self.rank, self.world_size,
                              self.readers, max(1, self.num_workers), self.seed,
                              [list(p) for p in self._positions], self._consumed)
        workers = self.num_workers
        loader = DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=_identity,
                            pin_memory=self.pin_memory, worker_init_fn=_ignore_stop_signals if workers else None,
                            prefetch_factor=2 if workers else None)
        with _stop_signals_blocked() if workers else contextlib.nullcontext():
            it = iter(loader)
        if workers:
            _LIVE_ITERATORS.add(it)
        try:
            for batch in it:
                reader = batch.pop("_reader")
                self._positions[reader] = [int(x) for x in batch.pop("_state")]
                self._events.extend(batch.pop("_events"))
                self._consumed += 1
                yield batch
        finally:  # the generator closed or collected: stop the workers now, the orderly way
            stop = getattr(it, "_shutdown_workers", None)  # inline: module globals may be gone at exit
            if stop is not None:
                stop()

    def pop_events(self) -> list[dict]:
        """Events since the last call, e.g. ``{"event": "epoch", "source", "reader", "epoch"}`` when a
        reader's data wrapped around (reported with the batch that holds the first document of it)."""
        events, self._events = self._events, []
        return events

    def _settings(self) -> dict:
        return {"source": self.source.identity(), "micro_batch_size": self.micro_batch_size,
                "seq_len": self.seq_len, "packing": self.packing, "truncation": self.truncation,
                "readers": self.readers, "seed": self.seed}

    def state_dict(self) -> dict:
        """This rank's part of the resume point (plain Python): its micro-batch count and the
        positions of the readers it serves. Combine all ranks' parts with ``merge_states``."""
        served = range(self.rank, self.readers, self.world_size)
        return {"format": STATE_FORMAT, "rank": self.rank, "world_size": self.world_size,
                "num_workers": self.num_workers, "consumed": self._consumed,
                "positions": [[r, list(self._positions[r])] for r in served], **self._settings()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a global state (``merge_states``), on any world size and worker count that
        divide ``data.readers``. A single rank's own part (same rank and world size) works too."""
        if state.get("format") != STATE_FORMAT:
            raise DataConfigError(
                "the checkpoint's data position was written by an older version of the pipeline (readers per "
                "process) and cannot be continued exactly by this one; start a new run (train.resume=never "
                "in a new run dir)")
        if "rank" in state:  # one rank's part
            if state["world_size"] == 1:
                state = merge_states([state])
            elif (state["rank"], state["world_size"]) != (self.rank, self.world_size):
                raise DataConfigError(
                    f"got rank {state['rank']} of {state['world_size']}'s data state on rank {self.rank} of "
                    f"{self.world_size}: pass data.merge_states(<every rank's state_dict()>) instead")
        self._check_settings(state)
        if "rank" in state:
            for reader, pos in state["positions"]:
                self._positions[int(reader)] = [int(x) for x in pos]
            self._consumed = int(state["consumed"])
            return
        total = int(state["consumed"])
        self._positions = [[int(x) for x in pos] for pos in state["positions"]]
        # Global micro-batches 0 .. total-1 are done; this rank's next one is the first k >= total
        # with k % world_size == rank.
        self._consumed = max(0, -(-(total - self.rank) // self.world_size))

    def _check_settings(self, state: dict) -> None:
        mine = self._settings()
        for key, name in _RESUME_KEYS.items():
            if key in state and state[key] != mine[key]:
                raise DataConfigError(
                    f"cannot continue the data stream: the checkpoint has {name}={state[key]!r}, this run has "
                    f"{name}={mine[key]!r}. Resume with the checkpoint's value (the order of the training data "
                    "depends on it).")
        theirs = state.get("source", {})
        for key in sorted(set(theirs) | set(mine["source"])):
            if theirs.get(key) != mine["source"].get(key):
                raise DataConfigError(
                    f"cannot continue the data stream: the data source differs from the checkpoint's "
                    f"(source {key}: checkpoint {theirs.get(key)!r}, this run {mine['source'].get(key)!r}). "
                    "Resume on the same data.")

    # --------------------------------------------------------------------------------- validation
    def _val_rows(self, eval_tokens: int) -> list:
        """The whole validation set (every rank's rows). tokens: the first documents whose scored tokens
        (all but each row's first) reach ``eval_tokens``. authors: the split shuffled with seed 42, whole
        global batches while at most ``eval_tokens`` non-pad tokens came before."""
        eval_tokens = int(eval_tokens)
        key = (eval_tokens, self.eval_mode)
        if self._val is None or self._val[0] != key:
            authors = self.eval_mode == "authors"
            texts = (self.source.val_docs(self.fmt.text_tokens, shuffle_seed=AUTHORS_VAL_SEED) if authors
                     else self.source.val_docs(self.fmt.text_tokens))
            docs = ((None, ids, None) for ids in texts)
            rows, total, group = [], 0, self.micro_batch_size * self.world_size
            for row, n, _ in doc_rows(docs, self.fmt, self.source.pad_id, pad_last=True):
                if authors and len(rows) % group == 0 and total > eval_tokens:
                    break
                rows.append((row.astype(np.int32), n))
                total += n if authors else max(n - 1, 0)
                if not authors and total >= eval_tokens:
                    break
            self._val = (key, rows)  # keep one set only: 10M tokens is ~40 MB as int32
        return self._val[1]

    def check_validation(self, eval_tokens: int, strict: bool) -> int:
        """Scored tokens the validation set provides (capped at ``eval_tokens``). DataConfigError when it
        is empty, or short and ``strict``; otherwise a short set is a warning."""
        # The authors' loop counts non-pad input tokens; ours the scored ones (all but each row's first).
        total = sum(n if self.eval_mode == "authors" else max(n - 1, 0) for _, n in self._val_rows(eval_tokens))
        where = f"the {self.source.name} validation split" + (
            f" ({self.source.describe_validation()})" if hasattr(self.source, "describe_validation") else "")
        if total == 0:
            raise DataConfigError(f"{where} is empty: nothing to evaluate on (a perplexity of nan). Give the "
                                  "source more data, or a smaller data.val_stride for your own text.")
        if total < eval_tokens:
            message = (f"{where} holds {total:,} scored tokens, fewer than train.eval_tokens={eval_tokens:,}")
            if strict:
                raise DataConfigError(message + "; evaluate on fewer tokens (train.eval_tokens=...), or accept the "
                                      "smaller set with train.require_eval_tokens=false")
            if not self._warned_short:
                warnings.warn(message + "; evaluating on all of it", stacklevel=2)
                self._warned_short = True
        return min(total, int(eval_tokens))

    def val_batches(self, eval_tokens: int) -> list[dict]:
        """This rank's share of the validation set (row i: rank ``i % world_size``) as batches, the last
        maybe smaller; callers weight the loss by label counts so the ranks' means combine exactly."""
        mine = self._val_rows(eval_tokens)[self.rank::self.world_size]
        out = []
        for i in range(0, len(mine), self.micro_batch_size):
            batch = to_batch([(r.astype(np.int64), n, None) for r, n in mine[i:i + self.micro_batch_size]])
            out.append({k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch)
        return out


def merge_states(per_rank_states: list[dict]) -> dict:
    """One world-size-independent data state from every rank's ``DataModule.state_dict()``; a ValueError
    (a caller's bug) unless the parts are one run's ranks 0..W-1 stopped at a common place."""
    if not per_rank_states:
        raise ValueError("merge_states needs the state of every rank, got none")
    world = len(per_rank_states)
    by_rank = sorted(per_rank_states, key=lambda s: s["rank"])
    if [s["rank"] for s in by_rank] != list(range(world)) or any(s["world_size"] != world for s in by_rank):
        raise ValueError(f"merge_states needs one state per rank 0..{world - 1} of a {world}-process run, got ranks "
                         f"{[s['rank'] for s in per_rank_states]} of world sizes "
                         f"{sorted({s['world_size'] for s in per_rank_states})}")
    first = by_rank[0]
    for s in by_rank[1:]:
        for key in ("source", *_RESUME_KEYS):
            if s[key] != first[key]:
                raise ValueError(f"ranks 0 and {s['rank']} disagree on {key}: {first[key]!r} vs {s[key]!r}")
    total = sum(int(s["consumed"]) for s in by_rank)
    for s in by_rank:
        expected = max(0, -(-(total - s["rank"]) // world))
        if int(s["consumed"]) != expected:
            raise ValueError(f"the ranks stopped at different places in the stream (consumed micro-batches: "
                             f"{[s['consumed'] for s in by_rank]}): save at an optimizer-step boundary")
    positions: list = [None] * first["readers"]
    for s in by_rank:
        for reader, pos in s["positions"]:
            positions[int(reader)] = [int(x) for x in pos]
    if any(p is None for p in positions):
        raise ValueError("merge_states: some readers have no position (a rank's state is incomplete)")
    settings = {k: first[k] for k in ("source", *_RESUME_KEYS)}
    return {"format": STATE_FORMAT, "consumed": total, "positions": positions, **settings}

