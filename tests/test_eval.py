"""eval.py: the validation loss of a checkpoint equals what training reported for it; overrides;
clear errors for a missing checkpoint or an unknown key."""
import json
import os
import sys

import pytest

import eval as evaluate_ckpt
from _train_helpers import rows, run_cli, run_inprocess  # noqa: F401
from train_utils import checkpoint as ckpt
from train_utils.validation import ConfigError


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained")
    assert run_inprocess(run_dir, "train.steps=3") == 0
    end = rows(run_dir)[-1]
    return run_dir, end


def test_eval_matches_training_and_writes_json(trained):
    run_dir, end = trained
    result = evaluate_ckpt.main([f"checkpoint={run_dir}"])  # a run dir means its latest checkpoint
    assert result["step"] == 3 and result["val_tokens"] >= 1024 * 63 / 64  # targets: 63 per 64-token row
    assert result["val_loss"] == pytest.approx(end["val_loss"], abs=1e-6)
    assert result["val_ppl"] == pytest.approx(end["val_ppl"], rel=1e-5)
    latest = ckpt.latest(os.path.join(run_dir, "checkpoints"))
    with open(os.path.join(latest, "eval.json")) as f:
        assert json.load(f)["val_loss"] == result["val_loss"]


def test_eval_overrides(trained, tmp_path):
    run_dir, end = trained
    out = tmp_path / "more.json"
    more = evaluate_ckpt.main([f"checkpoint={run_dir}", "train.eval_tokens=3000", f"out={out}"])
    assert more["val_tokens"] >= 3000 * 63 / 64 and json.loads(out.read_text())["val_tokens"] == more["val_tokens"]
    # A data group swap composes the option from configs/data (here: the same corpus, re-set to 64 tokens).
    same = evaluate_ckpt.main([f"checkpoint={run_dir}", "data=synthetic", "data.seq_len=64", f"out={out}"])
    assert same["val_loss"] == pytest.approx(end["val_loss"], abs=1e-6)


def test_eval_bad_input(trained, tmp_path):
    run_dir, _ = trained
    with pytest.raises(ConfigError, match="no checkpoint there"):
        evaluate_ckpt.main([f"checkpoint={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match="unknown argument 'train.eval_tokenz=5'"):
        evaluate_ckpt.main([f"checkpoint={run_dir}", "train.eval_tokenz=5"])
    with pytest.raises(ConfigError, match="Available options in 'data'"):
        evaluate_ckpt.main([f"checkpoint={run_dir}", "data=nope"])
    with pytest.raises(ConfigError, match="missing checkpoint"):
        evaluate_ckpt.main([])


@pytest.mark.slow
def test_eval_command_line(trained):
    run_dir, end = trained
    proc = run_cli([sys.executable, "eval.py", f"checkpoint={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["val_loss"] == pytest.approx(end["val_loss"], abs=1e-6)
    missing = run_cli([sys.executable, "eval.py", "checkpoint=/nonexistent/run"])
    assert missing.returncode == 2 and "error: checkpoint='/nonexistent/run'" in missing.stderr
