"""Token files and scripts/pretokenize.py: counts after truncation, both layouts, exact resume."""
import json

import numpy as np
import pytest

from data import DataConfigError, build_data
from data.indexed import BlockShuffle
from data.token_files import pretokenize
from scripts import pretokenize as pretokenize_cli
from test_data import VOCAB, c4_cfg, resume_check, rows_of, same, take


def tokens_cfg(path, **kw):
    return {"name": "tokens", "path": str(path), "seq_len": 256, "packing": False, "readers": 4, **kw}


def test_rows_layout_holds_what_a_run_reads(tmp_path, c4_dir, t5_tokenizer_dir):
    """Truncate-and-pad config: the files hold the rows (255 text ids + </s> at most), counted as a run
    consumes them: 120 rows, and validation by scored tokens (all but each row's first)."""
    cfg = c4_cfg(c4_dir, t5_tokenizer_dir)
    meta = pretokenize(cfg, str(tmp_path / "tok"), train_rows=120, val_tokens=3000, model_vocab_size=VOCAB)
    assert meta["layout"] == {"kind": "rows", "seq_len": 256, "truncation": "reference"}
    train, val = meta["splits"]["train"], meta["splits"]["validation"]
    assert train["rows"] == train["docs"] == 120 and train["tokens"] <= 120 * 256
    assert val["scored_tokens"] >= 3000 and val["scored_tokens"] == val["tokens"] - val["docs"]
    lengths = np.diff(np.load(tmp_path / "tok" / "train.idx.npy"))
    assert lengths.max() == 256 and (lengths == 256).sum() > 10  # long documents were truncated to a row
    dm = build_data(tokens_cfg(tmp_path / "tok"), micro_batch_size=5, model_vocab_size=VOCAB)
    c4 = build_data(dict(cfg, shuffle=False, readers=1), micro_batch_size=5, model_vocab_size=VOCAB)
    assert set(rows_of(take(dm, 24))) == set(rows_of(take(c4, 24)))  # the first 120 documents, own shuffle
    assert dm.check_validation(3000, strict=True) == 3000
    assert same(dm.val_batches(3000), c4.val_batches(3000))  # validation identical, in order
    for bad in (dict(seq_len=128), dict(packing=True), dict(truncation="prefix")):
        with pytest.raises(DataConfigError, match="finished rows of seq_len=256"):
            build_data(tokens_cfg(tmp_path / "tok", **bad), micro_batch_size=5)
    resume_check(lambda: build_data(tokens_cfg(tmp_path / "tok"), micro_batch_size=5, seed=1), total=30, cut=13)


@pytest.mark.parametrize("packing", [False, True])
def test_documents_layout_serves_any_rows(tmp_path, c4_dir, t5_tokenizer_dir, packing):
    cfg = c4_cfg(c4_dir, t5_tokenizer_dir, packing=packing, seq_len=64, shuffle=False, readers=1)
    meta = pretokenize(dict(cfg, packing=True), str(tmp_path / "tok"), train_rows=10**6, val_tokens=None,
                       model_vocab_size=VOCAB, layout="documents")
    assert meta["layout"] == {"kind": "documents"} and meta["splits"]["train"]["docs"] == 300  # one epoch
    tcfg = tokens_cfg(tmp_path / "tok", seq_len=64, packing=packing, shuffle=False, readers=1)
    dm = build_data(tcfg, micro_batch_size=4, model_vocab_size=VOCAB)
    c4 = build_data(cfg, micro_batch_size=4, model_vocab_size=VOCAB)
    assert same(take(dm, 20), take(c4, 20))  # unshuffled: the same rows in the same order
    assert same(dm.val_batches(5000), c4.val_batches(5000))
    resume_check(lambda: build_data(dict(tcfg, shuffle=True, num_workers=2, readers=4), micro_batch_size=4,
                                    model_vocab_size=VOCAB), total=10, cut=5)


def test_pretokenize_script_counts_rows_from_steps(tmp_path):
    mod = pretokenize_cli
    meta = mod.main(["--data", "synthetic", "--out", str(tmp_path / "syn"), "--steps", "10", "--batch-size", "4",
                     "--val-tokens", "1000", "data.seq_len=64"])
    assert meta["splits"]["train"]["rows"] == 40 and meta["splits"]["train"]["tokens"] == 40 * 64
    assert meta["splits"]["validation"]["scored_tokens"] >= 1000
    dm = build_data({"name": "tokens", "path": str(tmp_path / "syn"), "seq_len": 64}, micro_batch_size=2)
    assert dm.vocab_size == 512 and dm.loss_floor == pytest.approx(meta["loss_floor"])
    assert take(dm, 1)[0]["input_ids"].shape == (2, 64)
    # The defaults are the paper's: the model's steps x 512 rows, 10M scored validation tokens.
    assert mod.paper_settings("llama_130m", True) == {"steps": 200000, "batch_size": 512, "val_tokens": 10_000_000}
    assert mod.paper_settings("llama_1b", True)["steps"] == 300000
    with pytest.raises(SystemExit, match="pass --steps"):
        mod.paper_settings("my_model", True)


def test_old_token_files_are_refused(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1}))
    with pytest.raises(DataConfigError, match="format 1.*write them again"):
        build_data({"name": "tokens", "path": str(tmp_path)}, micro_batch_size=2)


def test_block_shuffle_is_a_seeded_permutation():
    n = 1000
    for block in (64, 10**6):  # many blocks (with a short last one), and a single one
        a = BlockShuffle(n, seed=3, epoch=0, block=block)(np.arange(n))
        assert sorted(a.tolist()) == list(range(n)) and not np.array_equal(a, np.arange(n))
        assert np.array_equal(a, BlockShuffle(n, 3, 0, block=block)(np.arange(n)))
        assert not np.array_equal(a, BlockShuffle(n, 3, 1, block=block)(np.arange(n)))
        part = np.array([999, 0, 500, 63, 64])
        assert np.array_equal(BlockShuffle(n, 3, 0, block=block)(part), a[part])  # random access
    assert np.array_equal(BlockShuffle(n, 3, 0, enabled=False)(np.arange(n)), np.arange(n))


def test_pretokenize_warns_when_the_validation_split_comes_out_short(tmp_path, c4_dir, t5_tokenizer_dir, capsys):
    mod = pretokenize_cli
    meta = mod.main(["--data", "c4", "--out", str(tmp_path / "c4"), "--train-rows", "8", "--val-tokens", "1000000000",
                     f"data.path={c4_dir}", f"data.tokenizer={t5_tokenizer_dir}"])
    scored = meta["splits"]["validation"]["scored_tokens"]
    err = capsys.readouterr().err
    assert 0 < scored < 10**9
    assert f"warning: the validation split holds {scored:,} scored tokens, fewer than the 1,000,000,000" in err
    assert f"train.eval_tokens={scored} train.require_eval_tokens=false" in err
    assert mod.short_validation_warning(1000, 1000) is None and mod.short_validation_warning(None, 5) is None
