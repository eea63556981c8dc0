"""data/: batches, rank/worker sharding, exact resume, the synthetic language, token files, bad input.

Fixtures c4_dir, c4_texts and t5_tokenizer_dir come from conftest.py (built once per session).
"""
import gzip
import json
import math
import os
import re

import numpy as np
import pytest
import torch

from data import build_data, build_source
from data.synthetic import MarkovLanguage
from data.tokenizer import TokenizerInfo, encode_batch, load_tokenizer
from data.tokens import pretokenize

VOCAB = 1000  # the test tokenizer's sentencepiece pieces (its 100 <extra_id_N> map to unk)
ASSETS = os.path.join(os.path.dirname(__file__), "assets")


def c4_cfg(c4_dir, tok_dir, **kw):
    return {"name": "c4", "path": None if c4_dir is None else str(c4_dir), "tokenizer": str(tok_dir), "seq_len": 256, "packing": False,
            "num_workers": 0, "shuffle": True, "shuffle_window": 16, **kw}


def norm(text):
    return re.sub(r"\s+", " ", text).strip()


def take(dm, n):
    it = dm.train_batches()
    return [next(it) for _ in range(n)]


def same(a, b):
    return all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
               for x, y in zip(a, b)) and len(a) == len(b)


def rows_of(batches):
    return [tuple(r[r != -100].tolist()) for b in batches for r in b["labels"]]


# --------------------------------------------------------------------------------------- c4 (local)
def test_c4_local_batches_shape_pads_and_roundtrip(c4_dir, c4_texts, t5_tokenizer_dir):
    dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir, shuffle=False), micro_batch_size=4, model_vocab_size=VOCAB,
                    max_positions=256)
    assert dm.vocab_size is None and dm.loss_floor is None
    tok = load_tokenizer(str(t5_tokenizer_dir))
    batches = take(dm, 10)
    truncated = padded = 0
    for i, b in enumerate(batches):
        ids, labels = b["input_ids"], b["labels"]
        assert ids.shape == labels.shape == (4, 256) and ids.dtype == labels.dtype == torch.long
        assert int(ids.max()) < VOCAB
        for r in range(4):
            text = c4_texts["train"][i * 4 + r]  # shuffle off: file order
            real = labels[r] != -100
            n = int(real.sum())
            assert real[:n].all() and not real[n:].any(), "pads must sit at the end"
            assert (ids[r, n:] == 0).all() and torch.equal(labels[r, :n], ids[r, :n])
            if n < 256:
                padded += 1
                assert ids[r, n - 1] == 1  # EOS closes a complete document
                assert norm(tok.decode(ids[r, :n - 1].tolist())) == norm(text)
            else:
                truncated += 1
                assert norm(text).startswith(norm(tok.decode(ids[r, :250].tolist())))
    assert truncated and padded


def test_prefix_tokenization_equals_full_tokenization(c4_texts, t5_tokenizer_dir):
    tok = load_tokenizer(str(t5_tokenizer_dir))
    info = TokenizerInfo(tok, VOCAB)
    texts = c4_texts["train"][:80]
    fast = encode_batch(tok, info, texts, max_tokens=64)
    full = encode_batch(tok, info, texts, max_tokens=None)
    assert all(np.array_equal(a, b[:64]) for a, b in zip(fast, full))


def test_t5_sentinels_map_to_unk_and_oversized_tokenizers_raise(t5_tokenizer_dir):
    tok = load_tokenizer(str(t5_tokenizer_dir))
    assert len(tok) == VOCAB + 100
    info = TokenizerInfo(tok, VOCAB)
    (ids,) = encode_batch(tok, info, ["Hear me <extra_id_0> speak"])
    assert ids.max() < VOCAB and info.unk_id in ids.tolist()
    with pytest.raises(ValueError, match="ordinary pieces"):
        TokenizerInfo(tok, 500)


@pytest.mark.parametrize("world_size", [2, 3])  # 2 files: whole files per rank; 3 ranks: every 3rd document
def test_ranks_are_disjoint_and_cover_the_shards(c4_dir, t5_tokenizer_dir, world_size):
    per_rank = []
    for rank in range(world_size):
        dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir), micro_batch_size=1, rank=rank, world_size=world_size,
                        model_vocab_size=VOCAB)
        docs = []
        for pos, toks, _ in dm.source.train_docs(rank, world_size, 0, [0, 0, 0], 256):
            if pos[0] > 0:
                break
            docs.append(tuple(toks.tolist()))
        per_rank.append(docs)
    everything = [d for docs in per_rank for d in docs]
    assert len(everything) == 300 and len(set(everything)) == 300  # disjoint, nothing twice
    src = build_source(c4_cfg(c4_dir, t5_tokenizer_dir), model_vocab_size=VOCAB)
    expected = {tuple(t.tolist()) for t in encode_batch(src.tok, src.info, _shard_texts(c4_dir), 256)}
    assert set(everything) == expected  # union = the whole shard set
    # The batch stream of each rank shows the same partition.
    if world_size == 2:
        seen = []
        for rank in range(2):
            dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir), micro_batch_size=5, rank=rank, world_size=2,
                            model_vocab_size=VOCAB)
            seen.append(set(rows_of(take(dm, 30))))  # 150 documents = one epoch of the rank
        assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 300


def _shard_texts(c4_dir):
    out = []
    for name in sorted(os.listdir(os.path.join(c4_dir, "en"))):
        if "train" in name:
            with gzip.open(os.path.join(c4_dir, "en", name), "rt") as f:
                out += [json.loads(line)["text"] for line in f]
    return out


def test_dataloader_workers_split_the_stream(c4_dir, t5_tokenizer_dir):
    dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir, num_workers=2), micro_batch_size=5, model_vocab_size=VOCAB)
    rows = rows_of(take(dm, 60))  # 300 documents: one epoch if no worker duplicates another's reading
    assert len(rows) == 300 and len(set(rows)) == 300
    # With 2 files and 2 readers, each worker reads (parses, tokenizes) only its own file.
    for reader in range(2):
        slots = set()
        for pos, _, _ in dm.source.train_docs(reader, 2, 0, [0, 0, 0], 256):
            if pos[0] > 0:
                break
            slots.add(pos[1])
        assert slots == {0}  # one file per reader per epoch


# ---------------------------------------------------------------------------------- exact resume
def _resume_check(make, total=9, cut=4):
    reference = take(make(), total)
    first = make()
    it = first.train_batches()
    for _ in range(cut):
        next(it)
    state = first.state_dict()
    json.dumps(state)  # plain Python only
    assert state["consumed"] == cut  # consumed, not prefetched
    resumed = make()
    resumed.load_state_dict(state)
    assert same(take(resumed, total - cut), reference[cut:])
    assert not same(take(make(), total - cut), reference[cut:])  # the check is not vacuous


@pytest.mark.parametrize("packing", [False, True])
def test_resume_c4_local(c4_dir, t5_tokenizer_dir, packing):
    _resume_check(lambda: build_data(c4_cfg(c4_dir, t5_tokenizer_dir, packing=packing), micro_batch_size=3,
                                     model_vocab_size=VOCAB), total=12, cut=7)


def test_resume_c4_local_with_workers_across_an_epoch(c4_dir, t5_tokenizer_dir):
    # 2 workers, 300 docs: batches 25..34 of 7 docs cross the epoch boundary of each worker (150 docs).
    make = lambda: build_data(c4_cfg(c4_dir, t5_tokenizer_dir, num_workers=2), micro_batch_size=7,
                              model_vocab_size=VOCAB)
    _resume_check(make, total=26, cut=21)


def test_resume_local_and_packing_rows(tmp_path, t5_tokenizer_dir):
    cfg = {"name": "local", "path": ASSETS, "tokenizer": str(t5_tokenizer_dir), "seq_len": 64, "packing": True,
           "val_every": 10}
    dm = build_data(cfg, micro_batch_size=2, model_vocab_size=VOCAB)
    b = take(dm, 1)[0]
    assert (b["labels"] != -100).all()  # packed rows are full
    assert (b["input_ids"] == 1).any()  # documents joined by EOS
    _resume_check(lambda: build_data(cfg, micro_batch_size=2, model_vocab_size=VOCAB), total=30, cut=13)


def test_resume_synthetic():
    _resume_check(lambda: build_data({"name": "synthetic", "seq_len": 32}, micro_batch_size=2, seed=3))


def test_resume_tokens_and_pretokenized_rows_match_the_source(tmp_path, c4_dir, t5_tokenizer_dir):
    cfg = c4_cfg(c4_dir, t5_tokenizer_dir)
    meta = pretokenize(cfg, str(tmp_path / "tok"), model_vocab_size=VOCAB)
    assert meta["dtype"] == "uint16" and meta["splits"]["train"]["docs"] == 300
    assert meta["splits"]["validation"]["docs"] == 100
    tcfg = {"name": "tokens", "path": str(tmp_path / "tok"), "seq_len": 256, "packing": False}
    dm = build_data(tcfg, micro_batch_size=5, model_vocab_size=VOCAB)
    c4 = build_data(cfg, micro_batch_size=5, model_vocab_size=VOCAB)
    assert set(rows_of(take(dm, 60))) == set(rows_of(take(c4, 60)))  # same documents, own shuffle
    assert same(dm.val_batches(5000), c4.val_batches(5000))  # validation identical, in order
    _resume_check(lambda: build_data(tcfg, micro_batch_size=5, model_vocab_size=VOCAB, seed=1), total=70, cut=33)
    _resume_check(lambda: build_data(dict(tcfg, packing=True, num_workers=2), micro_batch_size=4,
                                     model_vocab_size=VOCAB), total=10, cut=5)


def test_pretokenize_script_on_synthetic(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "pretok", os.path.join(os.path.dirname(__file__), "..", "scripts", "pretokenize.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    meta = mod.main(["--data", "synthetic", "--out", str(tmp_path / "syn"), "--train-tokens", "5000",
                     "--val-tokens", "1000", "data.seq_len=64"])
    dm = build_data({"name": "tokens", "path": str(tmp_path / "syn"), "seq_len": 64}, micro_batch_size=2)
    assert dm.vocab_size == 512 and dm.loss_floor == pytest.approx(meta["loss_floor"])
    assert take(dm, 1)[0]["input_ids"].shape == (2, 64)


# ------------------------------------------------------------------------------------- validation
def test_validation_set_is_fixed_disjoint_and_token_counted(c4_dir, t5_tokenizer_dir):
    make = lambda rank, seed: build_data(c4_cfg(c4_dir, t5_tokenizer_dir), micro_batch_size=4, rank=rank,
                                         world_size=2, seed=seed, model_vocab_size=VOCAB)
    a0, a1, b0 = make(0, 0).val_batches(6000), make(1, 0).val_batches(6000), make(0, 5).val_batches(6000)
    assert same(a0, b0)  # independent of the training seed
    r0, r1 = rows_of(a0), rows_of(a1)
    assert not set(r0) & set(r1)
    targets = [len(r) - 1 for r in r0 + r1]  # scored tokens: all but each row's first
    assert sum(targets) >= 6000
    single = build_data(c4_cfg(c4_dir, t5_tokenizer_dir), micro_batch_size=4, model_vocab_size=VOCAB)
    all_rows = rows_of(single.val_batches(6000))
    assert sorted(all_rows) == sorted(r0 + r1)
    assert sum(len(r) - 1 for r in all_rows[:-1]) < 6000  # the first documents, and no more than needed


# -------------------------------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic_by_seed():
    make = lambda seed: build_data({"name": "synthetic", "seq_len": 64}, micro_batch_size=4, seed=seed)
    assert same(take(make(0), 3), take(make(0), 3))
    assert not same(take(make(0), 3), take(make(1), 3))
    assert same(make(0).val_batches(1000), make(1).val_batches(1000))
    other = build_data({"name": "synthetic", "seq_len": 64, "language_seed": 1}, micro_batch_size=4)
    assert other.loss_floor != make(0).loss_floor
    b = take(make(0), 1)[0]
    assert b["input_ids"].max() < 512 and (b["labels"] != -100).all()


def test_synthetic_entropy_rate_matches_a_long_sample():
    lang = MarkovLanguage(512, 8, 3, 0.5, seed=0)
    assert 0 < lang.entropy_rate < lang.first_step_entropy < math.log(8) < lang.unigram_entropy <= math.log(512)
    rows = lang.sample(np.random.default_rng(123).random((1200, 256)))  # ~3e5 transitions
    surprisal = lang.log_probs(rows)  # -log p(x_t | x_{t-2}, x_{t-1}), t >= 2
    per_row = surprisal.mean(axis=1)  # rows are independent draws: their means are i.i.d.
    stderr = per_row.std(ddof=1) / math.sqrt(len(per_row))
    assert abs(per_row.mean() - lang.entropy_rate) < 4 * stderr, (per_row.mean(), lang.entropy_rate, stderr)
    assert stderr < 0.01  # the sample is long enough for the check to mean something
    # Rows start from the stationary pair distribution: the first prediction's surprisal
    # -log pi(x0, x1) / pi(x0) averages to the stated H(X1 | X0).
    succ = lang.pair_second.reshape(lang.V, lang.s)
    pair = rows[:, 0] * lang.s + np.argmax(succ[rows[:, 0]] == rows[:, 1][:, None], axis=1)
    marginal = np.bincount(lang.pair_first, weights=lang.pi, minlength=lang.V)
    first = -np.log(lang.pi[pair] / marginal[rows[:, 0]])
    assert abs(first.mean() - lang.first_step_entropy) < 4 * first.std(ddof=1) / math.sqrt(len(first))
    assert lang.loss_floor(256) == pytest.approx((lang.first_step_entropy + 254 * lang.entropy_rate) / 255)


# -------------------------------------------------------------------------------------- bad input
def test_bad_input_gives_clear_errors(tmp_path, c4_dir, t5_tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="does not exist|not a directory"):
        build_data(c4_cfg(tmp_path / "nope", t5_tokenizer_dir), micro_batch_size=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no C4 train shards"):
        build_data(c4_cfg(tmp_path / "empty", t5_tokenizer_dir), micro_batch_size=2)
    with pytest.raises(FileNotFoundError, match="holds no data files"):
        build_data({"name": "local", "path": str(tmp_path / "empty"), "tokenizer": str(t5_tokenizer_dir)},
                   micro_batch_size=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_data({"name": "local", "path": str(tmp_path / "missing.jsonl"), "tokenizer": str(t5_tokenizer_dir)},
                   micro_batch_size=2)
    with pytest.raises(FileNotFoundError, match="meta.json"):
        build_data({"name": "tokens", "path": str(tmp_path / "empty")}, micro_batch_size=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops\n{"text": "fine"}\n{"no_text": 1}\n')
    with pytest.raises(ValueError, match=r"2 malformed line\(s\).*bad.jsonl:2.*bad.jsonl:4"):
        build_data({"name": "local", "path": str(bad), "tokenizer": str(t5_tokenizer_dir)}, micro_batch_size=2)
    with pytest.raises(ValueError, match="seq_len=512 is longer than the model's max_position_embeddings=256"):
        build_data({"name": "synthetic", "seq_len": 512}, micro_batch_size=2, max_positions=256)
    with pytest.raises(ValueError, match="valid choices"):
        build_data({"name": "c5"}, micro_batch_size=2)
    with pytest.raises(OSError, match="data.tokenizer='t5-base'.*local directory"):
        build_data(c4_cfg(c4_dir, "t5-base"), micro_batch_size=2)
    with pytest.raises(RuntimeError, match="data.path at a directory of local C4 shards"):
        build_data(c4_cfg(None, t5_tokenizer_dir), micro_batch_size=2)
    dm = build_data({"name": "synthetic", "seq_len": 32}, micro_batch_size=2)
    sd = dm.state_dict()
    with pytest.raises(ValueError, match="world_size"):
        build_data({"name": "synthetic", "seq_len": 32}, micro_batch_size=2, rank=0, world_size=2).load_state_dict(sd)


def test_local_text_source_holds_out_validation(t5_tokenizer_dir):
    cfg = {"name": "local", "path": os.path.join(ASSETS, "tinyshakespeare_slice.txt"),
           "tokenizer": str(t5_tokenizer_dir), "seq_len": 256, "val_every": 10}
    src = build_source(cfg, model_vocab_size=VOCAB)
    n = len(src.train_texts) + len(src.val_texts)
    assert n > 250 and len(src.val_texts) == math.ceil(n / 10)  # paragraphs; every 10th held out
    from data.local import read_documents

    docs = read_documents(src.files)
    assert src.val_texts == docs[::10] and src.train_texts == [d for i, d in enumerate(docs) if i % 10]
    dm = build_data(cfg, micro_batch_size=4, model_vocab_size=VOCAB)
    assert take(dm, 1)[0]["input_ids"].shape == (4, 256)
    assert rows_of(dm.val_batches(300)) == rows_of(dm.val_batches(300))
