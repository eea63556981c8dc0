"""bench/budget_study.py: cells run cheapest budget first, are appended to the results file as they
finish, and a rerun skips them (resumable); the report orders methods per budget with the seed spread.

train.py is replaced by the stand-in of tests/conftest.py (`fake_train`): the script's logic is under
test, not training; the tokenizer is a real sentencepiece model of a slice of the corpus."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import budget_study

ASSET = Path(__file__).parent / "assets" / "tinyshakespeare_slice.txt"


def _main(tmp_path, *extra):
    args = ["--corpus", str(ASSET), "--workdir", str(tmp_path / "work"), "--results", str(tmp_path / "r.json"),
            "--vocab", "300", "--budgets", "0.5,2", "--seeds", "0,1", "--methods", "adamw,muon,frugal_muon_0.25",
            *extra]
    assert budget_study.main(args) == 0
    path = tmp_path / "r.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_cells_are_appended_and_skipped_on_rerun(fake_train, tmp_path, capsys):
    results = _main(tmp_path, "--stop-after", "0")  # stops before the first cell
    assert fake_train == [] and results == {}
    results = _main(tmp_path)
    assert len(fake_train) == len(results) == 2 * 2 * 3
    steps = [int(c["train.steps"]) for c in fake_train]
    assert steps == sorted(steps)  # budget by budget, cheapest first
    params = budget_study.count_params(type("A", (), {"hidden": 32, "intermediate": 88, "layers": 4, "vocab": 300})())
    assert {r["tokens_per_param"]: r["steps"] for r in results.values()} == {
        b: round(b * params / (16 * 128)) for b in (0.5, 2)}
    # the update gap scales with the run: the same number of subspace switches at every budget
    gaps = {(c["train.steps"], c.get("optimizer.update_gap")) for c in fake_train if c["optimizer"] == "frugal_muon"}
    assert len(gaps) == 2 and all(int(g) == max(1, round(int(s) / 12)) for s, g in gaps)
    assert {c["train.seed"] for c in fake_train} == {"0", "1"}
    _main(tmp_path)  # all cached: nothing runs again
    assert len(fake_train) == 12
    _main(tmp_path, "--budgets", "0.5,2,8", "--seeds", "0")  # a longer study continues: only the new cells
    assert len(fake_train) == 15 and {c["train.steps"] for c in fake_train[12:]} == {str(round(8 * params / 2048))}
    out = capsys.readouterr().out
    assert "8 tok/param (partial)" in out  # one seed of two: shown, not ordered


def test_report_orders_methods_and_shows_the_spread():
    results = {}
    for budget, losses in [(1, {"adamw": (4.0, 4.2), "muon": (3.9, 3.95)}),
                           (4, {"adamw": (3.5, 3.6), "muon": (3.7, 3.8)})]:
        for method, pair in losses.items():
            for seed, loss in enumerate(pair):
                results[budget_study.cell_key(method, budget, seed, "d")] = {
                    "method": method, "tokens_per_param": budget, "seed": seed, "val_loss": loss, "digest": "d"}
    summary = budget_study.summarise(results, "d")
    assert summary[1]["adamw"] == {"mean": pytest.approx(4.1), "min": 4.0, "max": 4.2, "seeds": 2}
    text = budget_study.report(summary, ["adamw", "muon"], 2)
    assert "1 tokens/param: Muon < AdamW" in text and "4 tokens/param: AdamW < Muon" in text
    assert "1 -> 4 tokens/param: -1.00" in text
    assert budget_study.spearman(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert "4 tokens/param, rank correlation with the paper's order of its 1 methods" in text  # AdamW only
    assert budget_study.spearman(["b", "a", "x"], ["a", "b"]) == -1.0  # items of one side only are left out


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown --methods.*valid choices"):
        budget_study.main(["--corpus", str(ASSET), "--methods", "adam", "--results", str(tmp_path / "r.json")])
