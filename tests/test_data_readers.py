"""Logical readers: the global micro-batch sequence does not depend on processes or DataLoader
workers, a run continues exactly on another world size, epoch events survive workers, and workers
survive stop signals sent to the whole process group."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from data import DataConfigError, build_data, merge_states
from test_data import ASSETS, VOCAB, c4_cfg, same, take

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_cfg(tok_dir, **kw):
    return {"name": "local", "path": ASSETS, "tokenizer": str(tok_dir), "seq_len": 64, "packing": True,
            "val_stride": 10, "readers": 4, **kw}


def global_sequence(make, world, workers, per_rank, state=None):
    """Micro-batches in global order (k = r + i * world) from `world` in-process "ranks"; each rank
    loads `state` first if given. Returns (batches, every rank's module)."""
    dms = [make(rank=r, world_size=world, num_workers=workers) for r in range(world)]
    if state is not None:
        for dm in dms:
            dm.load_state_dict(state)
    its = [dm.train_batches() for dm in dms]
    out = []
    for _ in range(per_rank):
        out += [next(it) for it in its]
    return out, dms


def makers(c4_dir, tok_dir):
    def make_c4(**kw):
        cfg = c4_cfg(c4_dir, tok_dir, num_workers=kw.pop("num_workers"))
        return build_data(cfg, micro_batch_size=3, model_vocab_size=VOCAB, seed=2, **kw)

    def make_local(**kw):
        cfg = local_cfg(tok_dir, num_workers=kw.pop("num_workers"))
        return build_data(cfg, micro_batch_size=2, model_vocab_size=VOCAB, seed=1, **kw)

    return {"c4": make_c4, "local-packing": make_local}


@pytest.mark.parametrize("source", ["c4", "local-packing"])
def test_global_order_is_independent_of_ranks_and_workers(c4_dir, t5_tokenizer_dir, source):
    make = makers(c4_dir, t5_tokenizer_dir)[source]
    single, _ = global_sequence(make, 1, 0, 24)
    ranks_workers, _ = global_sequence(make, 2, 2, 12)  # 2 ranks x 2 DataLoader workers
    assert same(single, ranks_workers)
    two_ranks, _ = global_sequence(make, 2, 0, 12)
    assert same(single, two_ranks)


@pytest.mark.parametrize("source", ["c4", "local-packing"])
def test_continue_on_another_world_size_is_exact(c4_dir, t5_tokenizer_dir, source):
    """Saved after k global micro-batches by 2 ranks, continued by 1 (and 1 -> 2 ranks with
    workers): the continued sequence is the uninterrupted one. Packing: the document in progress
    continues where it was cut."""
    make = makers(c4_dir, t5_tokenizer_dir)[source]
    reference, _ = global_sequence(make, 1, 0, 30)
    first, dms = global_sequence(make, 2, 0, 7)  # 14 global micro-batches
    state = merge_states([dm.state_dict() for dm in dms])
    json.dumps(state)
    assert state["consumed"] == 14
    rest, _ = global_sequence(make, 1, 0, 16, state)
    assert same(first + rest, reference)
    # ... and back: 1 process -> 2 ranks with 2 workers each, from an odd position (9 micro-batches:
    # rank 1 continues with global micro-batch 9, rank 0 with 10).
    head, (single,) = global_sequence(make, 1, 0, 9)
    state = merge_states([single.state_dict()])
    dms = [make(rank=r, world_size=2, num_workers=2) for r in range(2)]
    for dm in dms:
        dm.load_state_dict(state)
    its = [dm.train_batches() for dm in dms]
    tail = [next(its[1])]
    for _ in range(10):
        tail += [next(its[0]), next(its[1])]
    assert same(head + tail, reference[:30])


def test_rank_state_is_this_ranks_part_and_merge_checks_consistency():
    def make(r):
        return build_data({"name": "synthetic", "seq_len": 16, "readers": 4}, micro_batch_size=2, rank=r,
                          world_size=2)
    dms = [make(0), make(1)]
    its = [dm.train_batches() for dm in dms]
    for _ in range(3):
        next(its[0])
        next(its[1])
    parts = [dm.state_dict() for dm in dms]
    assert [p[0] for p in parts[1]["positions"]] == [1, 3]  # rank 1 of 2 serves readers 1 and 3
    assert merge_states(parts[::-1])["consumed"] == 6  # order of the parts does not matter
    next(its[0])
    next(its[0])
    with pytest.raises(ValueError, match="stopped at different places"):
        merge_states([dms[0].state_dict(), dms[1].state_dict()])
    with pytest.raises(ValueError, match="one state per rank"):
        merge_states([parts[0]])


def test_resume_refuses_changed_settings_naming_the_key():
    base = {"name": "synthetic", "seq_len": 16, "readers": 4}
    dm = build_data(base, micro_batch_size=2)
    take(dm, 3)
    state = merge_states([dm.state_dict()])
    for change, key in ((dict(micro_batch_size=4), "train.micro_batch_size"), (dict(seed=1), "train.seed"),
                        (dict(cfg={**base, "readers": 8}), "data.readers"),
                        (dict(cfg={**base, "seq_len": 32}), "data.seq_len"),
                        (dict(cfg={**base, "language_seed": 3}), "source language_seed")):
        kw = {"micro_batch_size": 2, **change}
        other = build_data(kw.pop("cfg", base), **kw)
        with pytest.raises(DataConfigError, match=key):
            other.load_state_dict(state)
    # World size and workers may change freely.
    build_data({**base, "num_workers": 2}, micro_batch_size=2, rank=1, world_size=2).load_state_dict(state)


def test_readers_must_fit_processes_and_workers():
    with pytest.raises(DataConfigError, match=r"data.readers=64 must be a multiple of world size \(8\) x DataLoader "
                                              r"workers per rank \(data.num_workers=3.*Valid data.num_workers for 8 "
                                              r"process\(es\): \[0, 1, 2, 4, 8\]"):
        build_data({"name": "synthetic", "num_workers": 3}, micro_batch_size=2, rank=0, world_size=8)
    with pytest.raises(DataConfigError, match="No worker count fits 6 processes"):
        build_data({"name": "synthetic"}, micro_batch_size=2, rank=0, world_size=6)


def test_epoch_events_come_with_the_batch_and_survive_workers_and_resume(tmp_path, t5_tokenizer_dir):
    """A small corpus wraps around: each reader reports its new epoch once, with the batch holding
    its first document of that epoch, through DataLoader workers, and a resume neither repeats nor
    loses an event."""
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document number {i} says hello"}) + "\n" for i in range(44)))
    cfg = {"name": "local", "path": str(corpus), "tokenizer": str(t5_tokenizer_dir), "seq_len": 32,
           "packing": False, "val_stride": 11, "readers": 2}  # 40 training documents, 20 per reader per epoch

    def run(workers, n, state=None):
        dm = build_data({**cfg, "num_workers": workers}, micro_batch_size=3, model_vocab_size=VOCAB)
        if state:
            dm.load_state_dict(state)
        events, it = [], dm.train_batches()
        for k in range(n):
            next(it)
            events += [(k, e["reader"], e["epoch"]) for e in dm.pop_events()]
        return events, dm

    plain, _ = run(0, 30)
    # Reader 0 serves local batches 0, 2, 4, ...: its 7th batch (global 12) holds its documents
    # 18-20, the 21st being epoch 1's first; 20 documents later (global 26), epoch 2.
    assert plain == [(12, 0, 1), (13, 1, 1), (26, 0, 2), (27, 1, 2)]
    with_workers, _ = run(2, 30)
    assert with_workers == plain
    first, dm = run(2, 13)  # stop right after reader 0 wrapped
    assert first == plain[:1]
    rest, _ = run(0, 17, merge_states([dm.state_dict()]))
    assert [(k + 13, r, e) for k, r, e in rest] == plain[1:]
    dm = build_data(cfg, micro_batch_size=3, model_vocab_size=VOCAB)
    take(dm, 13)
    assert dm.pop_events() == [{"event": "epoch", "source": "local", "reader": 0, "epoch": 1}]
    assert dm.pop_events() == []


SIGNAL_CHILD = textwrap.dedent("""
    import signal, sys
    from data import build_data

    got = []
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, lambda signum, frame: got.append(signal.Signals(signum).name))
    dm = build_data({"name": "synthetic", "seq_len": 32, "num_workers": 2, "readers": 2}, micro_batch_size=2)
    it = dm.train_batches()
    for _ in range(4):
        next(it)
    print("ready", flush=True)
    sys.stdin.readline()  # the test signals the whole process group meanwhile
    for _ in range(40):  # far more than the workers prefetched: they must still be serving
        next(it)
    print("served", dm.state_dict()["consumed"], "signals", sorted(set(got)), flush=True)
""")


@pytest.mark.slow
def test_workers_survive_stop_signals_to_the_process_group():
    """As SLURM's scancel and preemption do, another process signals the whole process group: the
    DataLoader workers keep serving and the main process alone sees the signals."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_CHILD], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: killpg hits only it
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            os.killpg(proc.pid, s)
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "served 44 signals ['SIGINT', 'SIGTERM', 'SIGUSR1', 'SIGUSR2']" in out
