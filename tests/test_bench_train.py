"""bench/train_step.py: runs train.py, reads its per-step rates after the warm-up, and reports each
method's ratio to AdamW within each round (median over rounds)."""
import argparse

import pytest

from bench import train_step


@pytest.mark.slow
def test_rates_are_the_training_rows_after_the_warm_up(tmp_path):
    args = argparse.Namespace(model="llama_tiny", steps=3, warmup=1, batch_size=2, micro_batch_size=2, seq_len=32,
                              seed=0, overrides=[])
    rates = train_step.run_once("optimizer=adamw train.optimizer_in_backward=false", args, tmp_path / "run")
    assert len(rates) == 2 and all(r > 0 for r in rates)


def test_ratios_are_taken_within_rounds(monkeypatch, capsys):
    """Round 2 runs everything twice as fast (a quieter machine): the per-round ratios stay 0.9."""
    speed = {"adamw": 100.0, "frugal": 90.0, "frugal_rho0": 99.0, "galore": 80.0, "badam": 100.0}
    calls = []

    def fake_run(option, args, run_dir):
        calls.append(option)
        return [speed[option.removeprefix("optimizer=")] * (2 if len(calls) > 5 else 1)] * 3

    monkeypatch.setattr(train_step, "run_once", fake_run)
    assert train_step.main(["--rounds", "2"]) == 0
    out = capsys.readouterr().out
    # interleaved: round 1 every method, then round 2
    assert calls == [f"optimizer={name}" for name in train_step.METHODS.values()] * 2
    assert "| FRUGAL 0.25 | 135 | 0.900 | 0.900-0.900 | >= 0.98: missed |" in out
    assert "| FRUGAL 0.0 | 148 | 0.990 | 0.990-0.990 | >= 0.98: met |" in out


def test_the_step_in_backward_is_compared_with_the_ordinary_step_of_its_round(monkeypatch, capsys):
    calls = []

    def fake_run(option, args, run_dir):
        calls.append(option)
        base = {"optimizer=adamw": 100.0, "optimizer=frugal": 90.0}.get(option, 81.0)  # in backward: 0.9 of 90
        return [base * (1 + len(calls) // 4)] * 3  # each round faster than the last: ratios stay

    monkeypatch.setattr(train_step, "run_once", fake_run)
    assert train_step.main(["--rounds", "2", "--in-backward", "--methods", "FRUGAL 0.25"]) == 0
    out = capsys.readouterr().out
    assert calls == ["optimizer=adamw", "optimizer=frugal", "optimizer=frugal train.optimizer_in_backward=true"] * 2
    assert "| FRUGAL 0.25 in backward | 122 | 0.810 | 0.810-0.810 | 0.900 (0.900-0.900) of the ordinary step, " \
           ">= 0.95: missed |" in out, out


def test_bad_warm_up_is_refused():
    with pytest.raises(SystemExit):
        train_step.main(["--steps", "3", "--warmup", "3"])
