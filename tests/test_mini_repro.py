"""scripts/mini_repro.py reuses a cached run or tokenizer only for the same corpus content and settings.

train.py is replaced by a stand-in that writes the metrics a finished run leaves (the script's own
logic, not training, is under test); the tokenizers are real sentencepiece models of two corpora.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import mini_repro

ASSET = Path(__file__).parent / "assets" / "tinyshakespeare_slice.txt"



@pytest.fixture
def corpora(tmp_path):
    lines = ASSET.read_text().splitlines()
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n".join(lines[: len(lines) // 2]))
    b.write_text("\n".join(lines[len(lines) // 2:]))
    return a, b


def _main(corpus, workdir, *extra):
    args = ["--corpus", str(corpus), "--workdir", str(workdir), "--vocab", "300", "--lr-grid", "1e-3,3e-3", *extra]
    assert mini_repro.main(args) == 0


def test_cached_runs_and_tokenizers_are_keyed_by_corpus_and_settings(fake_train, corpora, tmp_path, capsys,
                                                                     monkeypatch):
    from scripts import plot_runs

    # the stand-in runs leave metrics only; the plot (drawn by default) is scripts/plot_runs.py's to test
    monkeypatch.setattr(plot_runs, "plot", lambda dirs, out, **kw: Path(out).write_bytes(b""))
    a, b = corpora
    work = tmp_path / "work"
    runs = 2 + len(mini_repro.METHODS) - 1  # the AdamW grid, then every other method
    _main(a, work)
    assert len(fake_train) == runs
    # the results land in the work directory by default, never in the tracked docs/
    assert {p.name for p in work.iterdir()} >= {"results.json", "mini_repro.md", "mini_repro.png"}
    _main(b, work)  # another corpus: everything again, with its own tokenizer
    assert len(fake_train) == 2 * runs
    assert len(list((work / "tokenizers").iterdir())) == 2
    tokenizers = {c["data.tokenizer"] for c in fake_train}
    assert len(tokenizers) == 2 and all(Path(t, "spiece.model").exists() for t in tokenizers)
    _main(a, work)  # the first corpus and settings again: all cached
    assert len(fake_train) == 2 * runs
    _main(a, work, "--steps", "10")  # one setting changed: all runs again, same tokenizer
    assert len(fake_train) == 3 * runs and {c["train.steps"] for c in fake_train[-runs:]} == {"10"}
    assert len(list((work / "tokenizers").iterdir())) == 2
    _main(a, work, "--steps", "10", "--force")
    assert len(fake_train) == 4 * runs


def test_a_cache_entry_of_other_settings_is_refused(tmp_path):
    entry = mini_repro.cached_dir(tmp_path, "x", {"steps": 1})
    (entry / mini_repro.SETTINGS_FILE).write_text(json.dumps({"steps": 2}))
    with pytest.raises(SystemExit, match="holds a run of other settings"):
        mini_repro.cached_dir(tmp_path, "x", {"steps": 1})


def test_a_missing_corpus_says_where_to_get_the_documented_one(tmp_path):
    with pytest.raises(SystemExit, match="curl -O https://raw.githubusercontent.com/karpathy/char-rnn"):
        mini_repro.main(["--corpus", str(tmp_path / "input.txt"), "--workdir", str(tmp_path / "w")])
