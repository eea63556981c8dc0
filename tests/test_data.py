"""data/: batches and rows, the tokenizer, sources, the synthetic language, validation, bad input.

Logical readers, resume across world sizes, epoch events and signals: test_data_readers.py.
Token files and scripts/pretokenize.py: test_data_tokens.py.
Fixtures c4_dir, c4_texts and t5_tokenizer_dir come from conftest.py (built once per session).
Helpers here (c4_cfg, take, same, rows_of, VOCAB, ASSETS) are imported by the other test_data_* files.
"""
import gzip
import json
import math
import os
import re
import warnings

import numpy as np
import pytest
import torch

import data
from data import DataConfigError, build_data, build_source
from data.rows import RowFormat, Source
from data.stream import DataModule
from data.synthetic import MarkovLanguage
from data.tokenizer import TokenizerInfo, encode_batch, load_tokenizer

VOCAB = 1000  # the test tokenizer's sentencepiece pieces (its 100 <extra_id_N> map to unk)
ASSETS = os.path.join(os.path.dirname(__file__), "assets")
SHAKESPEARE = os.path.join(ASSETS, "tinyshakespeare_slice.txt")


def c4_cfg(c4_dir, tok_dir, **kw):
    return {"name": "c4", "path": None if c4_dir is None else str(c4_dir), "tokenizer": str(tok_dir),
            "seq_len": 256, "packing": False, "num_workers": 0, "shuffle": True, "shuffle_window": 16,
            "readers": 4, **kw}


def norm(text):
    return re.sub(r"\s+", " ", text).strip()


def take(dm, n):
    it = dm.train_batches()
    return [next(it) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x["input_ids"], y["input_ids"])
                                    and torch.equal(x["labels"], y["labels"])
                                    for x, y in zip(a, b))


def rows_of(batches):
    return [tuple(r[r != -100].tolist()) for b in batches for r in b["labels"]]


def hf_reference(tok, text, seq_len):
    """The reference pipeline's call (the paper's code), and its loss mask (pad positions -> -100)."""
    enc = tok(text, max_length=seq_len, truncation=True, padding="max_length")
    ids = torch.tensor(enc["input_ids"])
    labels = ids.masked_fill(torch.tensor(enc["attention_mask"]) == 0, -100)
    return ids, labels


# ------------------------------------------------------------------------------- rows: truncation
@pytest.mark.parametrize("seq_len", [256, 48])
def test_rows_equal_the_reference_tokenizer_call(c4_dir, c4_texts, t5_tokenizer_dir, seq_len):
    """Truncate-and-pad rows are what `tok(text, max_length, truncation=True, padding="max_length")`
    gives (T5: seq_len - 1 text tokens + </s> for a long document), pads masked in the labels; also
    through the fast prefix tokenization (most documents exceed 48 tokens, many exceed 256)."""
    tok = load_tokenizer(str(t5_tokenizer_dir))
    dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir, shuffle=False, readers=1, seq_len=seq_len),
                    micro_batch_size=10, model_vocab_size=VOCAB)
    batches = take(dm, 30)  # one epoch, file order
    long = 0
    for i, b in enumerate(batches):
        for r in range(10):
            ids, labels = hf_reference(tok, c4_texts["train"][i * 10 + r], seq_len)
            assert torch.equal(b["input_ids"][r], ids) and torch.equal(b["labels"][r], labels)
            long += bool(labels[-1] != -100)
    assert 30 < long < 290  # both long (truncated) and short (padded) documents were compared
    val = dm.val_batches(10**9)  # the whole validation split, same rule
    expected = [hf_reference(tok, t, seq_len) for t in c4_texts["validation"]]
    assert torch.equal(torch.cat([b["input_ids"] for b in val]), torch.stack([e[0] for e in expected]))
    assert torch.equal(torch.cat([b["labels"] for b in val]), torch.stack([e[1] for e in expected]))


def test_prefix_truncation_keeps_the_first_seq_len_tokens(c4_dir, c4_texts, t5_tokenizer_dir):
    tok = load_tokenizer(str(t5_tokenizer_dir))
    dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir, shuffle=False, readers=1, truncation="prefix"),
                    micro_batch_size=10, model_vocab_size=VOCAB)
    b = take(dm, 1)[0]
    for r in range(10):
        text = tok(c4_texts["train"][r], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = min(len(text), 256)
        assert b["input_ids"][r, :n].tolist() == text[:n] and (b["labels"][r, n:] == -100).all()


def test_fast_prefix_tokenization_is_exact_on_awkward_whitespace(t5_tokenizer_dir, c4_texts):
    tok = load_tokenizer(str(t5_tokenizer_dir))
    info = TokenizerInfo(tok, VOCAB)
    texts = [t.replace(". ", ".\n\n", 3).replace(" ", "  ", 5).replace(" ", "\t", 2) for t in c4_texts["train"][:80]]
    texts += ["word" * 400, "x " * 300, " lead and trail " * 40 + "   "]
    for max_tokens in (1, 7, 64, 255):
        fast = encode_batch(tok, info, texts, max_tokens=max_tokens)
        full = [tok(t, add_special_tokens=False)["input_ids"][:max_tokens] for t in texts]
        assert [f.tolist() for f in fast] == full


def test_t5_sentinels_map_to_unk_and_oversized_tokenizers_raise(t5_tokenizer_dir):
    tok = load_tokenizer(str(t5_tokenizer_dir))
    assert len(tok) == VOCAB + 100
    info = TokenizerInfo(tok, VOCAB)
    assert (info.prefix, info.suffix) == ([], [tok.eos_token_id])
    (ids,) = encode_batch(tok, info, ["Hear me <extra_id_0> speak"])
    assert ids.max() < VOCAB and info.unk_id in ids.tolist()
    with pytest.raises(DataConfigError, match="ordinary pieces"):
        TokenizerInfo(tok, 500)


def test_row_format_for_tokenizers_without_end_token():
    """GPT-2-like tokenizers add no special tokens: the reference row is the first seq_len text ids;
    packing still closes each document with EOS."""
    src = Source()
    src.eos_id, src.prefix, src.suffix = 9, (), ()
    text = np.arange(20, 30)
    assert RowFormat(src, 8, False, "reference")(text).tolist() == list(range(20, 28))
    assert RowFormat(src, 8, False, "prefix")(text[:3]).tolist() == [20, 21, 22, 9]
    assert RowFormat(src, 8, True, "reference")(text[:3]).tolist() == [20, 21, 22, 9]
    src.prefix = (5,)  # a BOS-adding tokenizer (LLaMA's)
    assert RowFormat(src, 8, False, "reference")(text).tolist() == [5] + list(range(20, 27))


def test_rows_equal_the_reference_call_for_a_gpt2_style_tokenizer(tmp_path, c4_texts):
    """A byte-level BPE tokenizer like GPT-2's adds no special tokens: the reference row is the first
    seq_len text ids, padded (pad = EOS); packing still closes each document with EOS."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(c4_texts["train"], vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False)
    tok = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(tmp_path / "gpt2_like")
    docs = c4_texts["validation"][:40]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = {"name": "local", "path": str(tmp_path / "docs.jsonl"), "tokenizer": str(tmp_path / "gpt2_like"),
           "seq_len": 48, "packing": False, "val_stride": 40, "shuffle": False, "readers": 1}
    dm = build_data(cfg, micro_batch_size=39, model_vocab_size=1000)
    b = take(dm, 1)[0]
    assert dm.vocab_size == 600
    for r, text in enumerate(docs[1:]):  # document 0 is held out
        ids, labels = hf_reference(tok, text, 48)
        assert torch.equal(b["input_ids"][r], ids) and torch.equal(b["labels"][r], labels)
    packed = take(build_data(dict(cfg, packing=True), micro_batch_size=2, model_vocab_size=1000), 8)
    stream = [i for text in docs[1:] for i in tok(text)["input_ids"] + [tok.eos_token_id]]
    assert [i for row in rows_of(packed) for i in row] == stream[:8 * 2 * 48]


# --------------------------------------------------------------------------------------- c4 (local)
def test_c4_local_batches_shape_pads_and_roundtrip(c4_dir, c4_texts, t5_tokenizer_dir):
    dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir, shuffle=False, readers=1), micro_batch_size=4,
                    model_vocab_size=VOCAB, max_positions=256)
    assert dm.vocab_size is None and dm.loss_floor is None
    tok = load_tokenizer(str(t5_tokenizer_dir))
    batches = take(dm, 10)
    truncated = padded = 0
    for i, b in enumerate(batches):
        ids, labels = b["input_ids"], b["labels"]
        assert ids.shape == labels.shape == (4, 256) and ids.dtype == labels.dtype == torch.long
        assert int(ids.max()) < VOCAB
        for r in range(4):
            text = c4_texts["train"][i * 4 + r]  # shuffle off, one reader: file order
            real = labels[r] != -100
            n = int(real.sum())
            assert real[:n].all() and not real[n:].any(), "pads must sit at the end"
            assert (ids[r, n:] == 0).all() and torch.equal(labels[r, :n], ids[r, :n])
            assert ids[r, n - 1] == 1  # EOS closes every row, truncated or not (the reference rule)
            if n < 256:
                padded += 1
                assert norm(tok.decode(ids[r, :n - 1].tolist())) == norm(text)
            else:
                truncated += 1
                assert norm(text).startswith(norm(tok.decode(ids[r, :250].tolist())))
    assert truncated and padded


@pytest.mark.parametrize("n_readers", [2, 3, 64])  # whole files; every 3rd document; 32 readers per file
def test_readers_are_disjoint_and_cover_the_shards(c4_dir, t5_tokenizer_dir, n_readers):
    src = build_source(c4_cfg(c4_dir, t5_tokenizer_dir), model_vocab_size=VOCAB)
    everything = []
    for reader in range(n_readers):
        for pos, toks, _ in src.train_docs(reader, n_readers, 0, [0, 0, 0], 255):
            if pos[0] > 0:
                break
            everything.append(tuple(toks.tolist()))
    assert len(everything) == 300 and len(set(everything)) == 300  # disjoint, nothing twice
    expected = {tuple(t.tolist()) for t in encode_batch(src.tok, src.info, _shard_texts(c4_dir), 255)}
    assert set(everything) == expected  # union = the whole shard set


def test_ranks_see_disjoint_rows(c4_dir, t5_tokenizer_dir):
    seen = []
    for rank in range(2):
        dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir, readers=2), micro_batch_size=5, rank=rank, world_size=2,
                        model_vocab_size=VOCAB)
        seen.append(set(rows_of(take(dm, 30))))  # 150 documents = one epoch of the rank's reader
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 300


def _shard_texts(c4_dir):
    out = []
    for name in sorted(os.listdir(os.path.join(c4_dir, "en"))):
        if "train" in name:
            with gzip.open(os.path.join(c4_dir, "en", name), "rt") as f:
                out += [json.loads(line)["text"] for line in f]
    return out


def test_dataloader_workers_split_the_stream(c4_dir, t5_tokenizer_dir):
    dm = build_data(c4_cfg(c4_dir, t5_tokenizer_dir, num_workers=2, readers=2), micro_batch_size=5,
                    model_vocab_size=VOCAB)
    rows = rows_of(take(dm, 60))  # 300 documents: one epoch if no worker duplicates another's reading
    assert len(rows) == 300 and len(set(rows)) == 300
    # With 2 files and 2 readers, each reader reads (parses, tokenizes) only its own file.
    for reader in range(2):
        slots = set()
        for pos, _, _ in dm.source.train_docs(reader, 2, 0, [0, 0, 0], 255):
            if pos[0] > 0:
                break
            slots.add(pos[1])
        assert slots == {0}  # one file per reader per epoch


# ---------------------------------------------------------------------------------- exact resume
def resume_check(make, total=9, cut=4):
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
    resume_check(lambda: build_data(c4_cfg(c4_dir, t5_tokenizer_dir, packing=packing), micro_batch_size=3,
                                    model_vocab_size=VOCAB), total=12, cut=7)


def test_resume_c4_local_with_workers_across_an_epoch(c4_dir, t5_tokenizer_dir):
    # 2 workers, 2 readers, 300 docs: batches 21..25 of 7 docs cross each reader's epoch boundary (150 docs).
    def make():
        return build_data(c4_cfg(c4_dir, t5_tokenizer_dir, num_workers=2, readers=2), micro_batch_size=7,
                          model_vocab_size=VOCAB)
    resume_check(make, total=26, cut=21)


def test_resume_local_and_packing_rows(t5_tokenizer_dir):
    cfg = {"name": "local", "path": ASSETS, "tokenizer": str(t5_tokenizer_dir), "seq_len": 64, "packing": True,
           "val_stride": 10, "readers": 4}
    dm = build_data(cfg, micro_batch_size=2, model_vocab_size=VOCAB)
    b = take(dm, 1)[0]
    assert (b["labels"] != -100).all()  # packed rows are full
    assert (b["input_ids"] == 1).any()  # documents joined by EOS
    resume_check(lambda: build_data(cfg, micro_batch_size=2, model_vocab_size=VOCAB), total=30, cut=13)


def test_resume_synthetic():
    resume_check(lambda: build_data({"name": "synthetic", "seq_len": 32}, micro_batch_size=2, seed=3))


# ------------------------------------------------------------------------------------- validation
def test_validation_set_is_fixed_disjoint_and_token_counted(c4_dir, t5_tokenizer_dir):
    def make(rank, seed):
        return build_data(c4_cfg(c4_dir, t5_tokenizer_dir), micro_batch_size=4, rank=rank,
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
    assert single.check_validation(6000, strict=True) == 6000


class _Fixed(Source):
    """A source whose validation split is given: for the checks of empty and short sets."""

    name = "fixed"

    def __init__(self, val):
        self.val, self.eos_id, self.suffix = val, 1, (1,)

    def val_docs(self, max_tokens):
        return iter([np.asarray(v, dtype=np.int64) for v in self.val])


def test_check_validation_empty_short_and_strict():
    empty = DataModule(_Fixed([]), micro_batch_size=2, seq_len=16)
    with pytest.raises(DataConfigError, match="validation split is empty"):
        empty.check_validation(100, strict=False)
    short = DataModule(_Fixed([[5] * 30, [6] * 3]), micro_batch_size=2, seq_len=16)  # rows of 16 and 4 ids
    with pytest.raises(DataConfigError, match=r"holds 18 scored tokens, fewer than train.eval_tokens=100.*"
                                              r"train.require_eval_tokens=false"):
        short.check_validation(100, strict=True)
    with pytest.warns(UserWarning, match="holds 18 scored tokens"):
        assert short.check_validation(100, strict=False) == 18
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert short.check_validation(10, strict=True) == 10  # enough: capped at what was asked


# ---------------------------------------------------------------------------------- your own text
def test_local_text_source_holds_out_validation(t5_tokenizer_dir):
    cfg = {"name": "local", "path": SHAKESPEARE, "tokenizer": str(t5_tokenizer_dir), "seq_len": 256,
           "val_stride": 10}
    src = build_source(cfg, model_vocab_size=VOCAB)
    n = len(src.train_texts) + len(src.val_texts)
    assert n > 250 and len(src.val_texts) == math.ceil(n / 10)  # paragraphs; every 10th held out
    from data.local import read_documents

    docs = read_documents(src.files)
    assert src.val_texts == docs[::10] and src.train_texts == [d for i, d in enumerate(docs) if i % 10]
    dm = build_data(cfg, micro_batch_size=4, model_vocab_size=VOCAB)
    assert take(dm, 1)[0]["input_ids"].shape == (4, 256)
    assert rows_of(dm.val_batches(300)) == rows_of(dm.val_batches(300))


def test_local_defaults_pack_and_size_the_vocabulary_from_the_tokenizer(tmp_path, t5_tokenizer_dir):
    """configs/data/local.yaml: packing (no pad slots), the embedding sized to the tokenizer's 1000
    pieces rather than the model's 32000, and a small file still has a validation row."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(os.path.join(os.path.dirname(ASSETS), "..", "configs", "data",
                                                             "local.yaml")))
    small = tmp_path / "small.txt"
    paragraphs = open(SHAKESPEARE).read().split("\n\n")[:40]
    small.write_text("\n\n".join(paragraphs))
    cfg.update(path=str(small), tokenizer=str(t5_tokenizer_dir), readers=4)
    dm = build_data(cfg, micro_batch_size=4, model_vocab_size=32000)
    assert dm.packing and dm.vocab_size == VOCAB  # the sentinels (ids 1000-1099) map to unk
    b = take(dm, 3)[-1]
    assert (b["labels"] != -100).all() and int(b["input_ids"].max()) < VOCAB
    with pytest.warns(UserWarning, match="fewer than train.eval_tokens"):
        assert dm.check_validation(10**6, strict=False) > 0  # 1 held-out paragraph < one row: padded, kept
    val = dm.val_batches(10**6)
    assert len(val) == 1 and (val[0]["labels"][0] == -100).any()


# -------------------------------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic_by_seed():
    def make(seed):
        return build_data({"name": "synthetic", "seq_len": 64}, micro_batch_size=4, seed=seed)
    assert same(take(make(0), 3), take(make(0), 3))
    assert not same(take(make(0), 3), take(make(1), 3))
    assert same(make(0).val_batches(1000), make(1).val_batches(1000))
    other = build_data({"name": "synthetic", "seq_len": 64, "language_seed": 1}, micro_batch_size=4)
    assert other.loss_floor != make(0).loss_floor
    b = take(make(0), 1)[0]
    assert b["input_ids"].max() < 512 and (b["labels"] != -100).all()


def _log_probs(lang, rows: np.ndarray) -> np.ndarray:
    """-log p(x_t | x_{t-2}, x_{t-1}) for t >= 2 under the true model, shape (B, L-2)."""
    B, L = rows.shape
    # Pair index of (x_{t-2}, x_{t-1}) needs j with succ[a, j] == b.
    succ = lang.pair_second.reshape(lang.V, lang.s)
    out = np.empty((B, L - 2))
    for t in range(2, L):
        a, b, c = rows[:, t - 2], rows[:, t - 1], rows[:, t]
        j = np.argmax(succ[a] == b[:, None], axis=1)
        pair = a * lang.s + j
        k = np.argmax(lang.next_token[pair] == c[:, None], axis=1)
        out[:, t - 2] = -np.log(lang.probs[pair, k])
    return out


def test_synthetic_entropy_rate_matches_a_long_sample():
    lang = MarkovLanguage(512, 8, 3, 0.5, seed=0)
    assert 0 < lang.entropy_rate < lang.first_step_entropy < math.log(8) < lang.unigram_entropy <= math.log(512)
    rows = lang.sample(np.random.default_rng(123).random((1200, 256)))  # ~3e5 transitions
    surprisal = _log_probs(lang, rows)  # -log p(x_t | x_{t-2}, x_{t-1}), t >= 2
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
    assert issubclass(DataConfigError, ValueError) and issubclass(data.DataFileNotFoundError, FileNotFoundError)
    with pytest.raises(data.DataFileNotFoundError, match="does not exist|not a directory"):
        build_data(c4_cfg(tmp_path / "nope", t5_tokenizer_dir), micro_batch_size=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataFileNotFoundError, match="no C4 train shards"):
        build_data(c4_cfg(tmp_path / "empty", t5_tokenizer_dir), micro_batch_size=2)
    with pytest.raises(data.DataFileNotFoundError, match="holds no data files"):
        build_data({"name": "local", "path": str(tmp_path / "empty"), "tokenizer": str(t5_tokenizer_dir)},
                   micro_batch_size=2)
    with pytest.raises(data.DataFileNotFoundError, match="does not exist"):
        build_data({"name": "local", "path": str(tmp_path / "missing.jsonl"), "tokenizer": str(t5_tokenizer_dir)},
                   micro_batch_size=2)
    with pytest.raises(data.DataFileNotFoundError, match="meta.json"):
        build_data({"name": "tokens", "path": str(tmp_path / "empty")}, micro_batch_size=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops\n{"text": "fine"}\n{"no_text": 1}\n')
    with pytest.raises(DataConfigError, match=r"2 malformed line\(s\).*bad.jsonl:2.*bad.jsonl:4"):
        build_data({"name": "local", "path": str(bad), "tokenizer": str(t5_tokenizer_dir)}, micro_batch_size=2)
    with pytest.raises(DataConfigError, match="seq_len=512 is longer than the model's max_position_embeddings=256"):
        build_data({"name": "synthetic", "seq_len": 512}, micro_batch_size=2, max_positions=256)
    with pytest.raises(DataConfigError, match="valid choices"):
        build_data({"name": "c5"}, micro_batch_size=2)
    with pytest.raises(DataConfigError, match="data.truncation='middle' is invalid; choose one of"):
        build_data({"name": "synthetic", "truncation": "middle"}, micro_batch_size=2)
    with pytest.raises(DataConfigError, match="data.pin_memory='yes' is invalid"):
        build_data({"name": "synthetic", "pin_memory": "yes"}, micro_batch_size=2)
    with pytest.raises(DataConfigError, match="data.vocab_from='mine' is invalid"):
        build_data(c4_cfg(c4_dir, t5_tokenizer_dir, vocab_from="mine"), micro_batch_size=2)
    with pytest.raises(DataConfigError, match="data.val_stride=1 is invalid"):
        build_data({"name": "local", "path": SHAKESPEARE, "tokenizer": str(t5_tokenizer_dir), "val_stride": 1},
                   micro_batch_size=2)
    with pytest.raises(DataConfigError, match="data.tokenizer='t5-base'.*local directory"):
        build_data(c4_cfg(c4_dir, "t5-base"), micro_batch_size=2)


def test_c4_from_the_hub_offline_is_one_clear_error(t5_tokenizer_dir, monkeypatch):
    """data=c4 with data.path=null and no Hub (a local tokenizer): a DataConfigError saying how to
    point at local shards, not a traceback from inside datasets."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataConfigError, match="point data.path at a directory of local C4 shards") as err:
        build_data(c4_cfg(None, t5_tokenizer_dir), micro_batch_size=2)
    assert "allenai/c4" in str(err.value)


def test_pin_memory_setting():
    def make(value):
        return build_data({"name": "synthetic", "seq_len": 16, "pin_memory": value}, micro_batch_size=2)
    assert make("auto").pin_memory == make(True).pin_memory == torch.cuda.is_available()
    assert make(False).pin_memory is False


def test_batches_come_from_a_pinning_dataloader_when_cuda_is_there(monkeypatch):
    """No GPU here: check that the DataLoader is asked to pin (and that workers get the signal guard)."""
    import data.stream

    seen = {}
    real = data.stream.DataLoader

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **{**kwargs, "pin_memory": False})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(data.stream, "DataLoader", recording)
    dm = build_data({"name": "synthetic", "seq_len": 16, "num_workers": 1, "readers": 4}, micro_batch_size=2)
    assert dm.pin_memory and take(dm, 1)[0]["input_ids"].shape == (2, 16)
    assert seen["pin_memory"] is True and seen["worker_init_fn"] is data.stream._ignore_stop_signals


def test_yaml_files_state_the_code_defaults():
    """configs/data/<source>.yaml states every default of data.DEFAULTS with the same value (the
    code's defaults serve build_data called with a partial mapping; a run's config shows them all),
    except num_workers: 0 in code, the training runs' worker counts in the files. The synthetic
    language's rows are generated seq_len long, so its file leaves out truncation (nothing to cut)."""
    from omegaconf import OmegaConf

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "data")
    for name, defaults in data.DEFAULTS.items():
        yaml = OmegaConf.to_container(OmegaConf.load(os.path.join(root, f"{name}.yaml")))
        for key, value in defaults.items():
            if (name, key) == ("synthetic", "truncation"):
                continue
            assert key in yaml, f"configs/data/{name}.yaml does not state {key} (code default {value!r})"
            if key != "num_workers":
                assert yaml[key] == value, f"configs/data/{name}.yaml: {key}={yaml[key]!r}, code default {value!r}"
