"""eval.py: the validation loss of a checkpoint equals what training reported for it; overrides;
clear errors for a missing checkpoint or an unknown key."""
import json
import os
import sys

import pytest
import torch

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
    with pytest.raises(ConfigError, match="data='nope' is not an option of configs/data/; valid options: c4, "):
        evaluate_ckpt.main([f"checkpoint={run_dir}", "data=nope"])
    with pytest.raises(ConfigError, match="missing checkpoint"):
        evaluate_ckpt.main([])
    for bad in ("0", "many"):
        with pytest.raises(ConfigError, match=f"train.eval_tokens=.*{bad}.* is invalid: expected an integer >= 1"):
            evaluate_ckpt.main([f"checkpoint={run_dir}", f"train.eval_tokens={bad}"])


def test_eval_names_the_closest_argument(trained):
    """A mistyped key, section, top-level argument or data option: one line naming it, what is valid
    there and the closest valid one."""
    run_dir, _ = trained

    def error(*argv) -> str:
        with pytest.raises(ConfigError) as info:
            evaluate_ckpt.main(list(argv))
        assert "\n" not in str(info.value)
        return str(info.value)

    msg = error(f"checkpoint={run_dir}", "train.eval_tokns=5")
    assert msg.startswith("unknown argument 'train.eval_tokns=5': train.eval_tokns is not a key of the checkpoint's "
                          "config (did you mean train.eval_tokens?); valid keys of train: steps, batch_size, "), msg
    assert "precision" in msg
    msg = error(f"checkpoint={run_dir}", "trian.eval_tokens=5")
    assert "has no section 'trian' (did you mean train.eval_tokens?); valid sections: " in msg and "model" in msg
    msg = error(f"checkpoint={run_dir}", "data.seq_lem=32")
    assert "data.seq_lem is not a key of the checkpoint's config (did you mean data.seq_len?)" in msg
    msg = error(f"chekpoint={run_dir}")  # named before the checkpoint is looked for
    assert msg.startswith(f"unknown argument 'chekpoint={run_dir}' (did you mean checkpoint?); valid arguments: "
                          "checkpoint=<checkpoint dir or run dir>, out=<file>, data=<option>"), msg
    msg = error(f"checkpoint={run_dir}", "data=synthtic")
    assert msg == ("data='synthtic' is not an option of configs/data/ (did you mean synthetic?); "
                   "valid options: c4, local, synthetic, tokens")


def test_eval_shows_progress_on_stderr(trained, tmp_path, capsys, monkeypatch):
    """A long evaluation says what it scores and how far it is, on stderr: a few lines where stderr is
    not a terminal, train.py's bar where it is; stdout stays the one JSON object."""
    run_dir, end = trained
    result = evaluate_ckpt.main([f"checkpoint={run_dir}", f"out={tmp_path / 'e.json'}"])
    out, err = capsys.readouterr()
    assert json.loads(out) == result and out.count("\n") == 1
    lines = err.splitlines()
    assert lines[0].startswith("evaluating ") and "(step 3) on 1,024 validation tokens of synthetic" in lines[0], err
    # 17 rows of 63 targets in micro-batches of 4: a line at each quarter of the 5 batches
    assert [ln.split(" in ")[0] for ln in lines[1:]] == [f"evaluated {i}/5 batches ({i * 20}%)" for i in (2, 3, 4, 5)]

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    again = evaluate_ckpt.main([f"checkpoint={run_dir}", f"out={tmp_path / 'e.json'}"])
    out, err = capsys.readouterr()
    assert json.loads(out) == again and out.count("\n") == 1
    assert "evaluating:" in err and "/5 [" in err and "evaluated " not in err  # the bar (it clears itself)


@pytest.mark.slow
def test_eval_command_line(trained):
    run_dir, end = trained
    proc = run_cli([sys.executable, "eval.py", f"checkpoint={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is the one JSON object; progress goes to stderr
    assert result["val_loss"] == pytest.approx(end["val_loss"], abs=1e-6)
    assert "evaluated 5/5 batches (100%)" in proc.stderr
    missing = run_cli([sys.executable, "eval.py", "checkpoint=/nonexistent/run"])
    assert missing.returncode == 2 and "error: checkpoint='/nonexistent/run'" in missing.stderr
    typo = run_cli([sys.executable, "eval.py", f"checkpoint={run_dir}", "train.eval_tokns=5"])
    assert typo.returncode == 2 and typo.stdout == "", typo.stderr[-3000:]
    assert typo.stderr.strip().splitlines()[-1].startswith("error: unknown argument 'train.eval_tokns=5'")
    assert "(did you mean train.eval_tokens?)" in typo.stderr


# ---- eval.mode=authors: the paper's code's evaluation ---------------------------------------------
SEQ, MICRO, TARGET = 64, 4, 1500


def _tiny_model(seed=0):
    import torch
    from omegaconf import OmegaConf

    import models

    torch.manual_seed(seed)
    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "configs", "model", "llama_tiny.yaml"))
    cfg.merge_with({"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2})
    return models.build_model(cfg, vocab_size=1000)


def _c4(c4_dir, tok_dir, mode, micro=MICRO):
    import data

    cfg = {"name": "c4", "path": str(c4_dir), "tokenizer": str(tok_dir), "seq_len": SEQ, "packing": False,
           "num_workers": 0, "readers": 1}
    return data.build_data(cfg, micro_batch_size=micro, model_vocab_size=1000, max_positions=SEQ, eval_mode=mode)


def test_authors_mode_is_the_papers_evaluation(c4_dir, t5_tokenizer_dir):
    """eval.mode=authors against a transcription of the paper's evaluation loop (GaLore's
    evaluate_model as the FRUGAL code runs it, dividing by the number of batches): the validation
    split through datasets' .shuffle(seed=42), the HF tokenizer call, batches while at most TARGET
    non-pad tokens came before, the mean of the HF models' own per-batch losses."""
    import datasets
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from train_utils.loop import evaluate

    model = _tiny_model()
    dm = _c4(c4_dir, t5_tokenizer_dir, "authors")
    got = evaluate(model, dm, TARGET, "fp32", Accelerator(cpu=True))
    assert got["val_mode"] == "authors"

    files = sorted(str(p) for p in (c4_dir / "en").glob("c4-validation.*.json.gz"))
    val = datasets.load_dataset("json", data_files={"validation": files}, split="validation", streaming=True)
    tok = AutoTokenizer.from_pretrained(str(t5_tokenizer_dir))
    texts, losses, seen = [d["text"] for d in val.shuffle(seed=42)], [], 0
    with torch.no_grad():
        for i in range(0, len(texts), MICRO):
            if seen > TARGET:
                break
            batch = tok(texts[i:i + MICRO], max_length=SEQ, truncation=True, padding="max_length", return_tensors="pt")
            labels = batch["input_ids"].clone()
            labels[labels == tok.pad_token_id] = -100
            losses.append(model(**batch, labels=labels).loss.double().item())
            seen += int((batch["input_ids"] != tok.pad_token_id).sum())
    expected = sum(losses) / len(losses)
    assert seen > TARGET and len(losses) < len(texts) / MICRO  # the stop rule was exercised
    assert got["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert got["val_ppl"] == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-6)

    # The default differs: token-weighted, on the split's natural order.
    tokens = evaluate(model, _c4(c4_dir, t5_tokenizer_dir, "tokens"), TARGET, "fp32", Accelerator(cpu=True))
    assert tokens["val_mode"] == "tokens" and tokens["val_loss"] != pytest.approx(got["val_loss"], rel=1e-6)


def test_authors_mode_splits_over_ranks_as_one_set(c4_dir, t5_tokenizer_dir):
    """Two ranks (micro-batch 2) share the one process's set (micro-batch 4: the same global batch of 4
    rows): together they hold its rows, and the all-reduced result is the mean over both ranks'
    batches of each batch's own mean loss."""
    import torch

    import data
    from train_utils.loop import evaluate

    class TwoRanks:  # the all-reduce of two ranks scored one after the other: the sum of their tensors
        device = torch.device("cpu")

        def __init__(self):
            self.parts = []

        def reduce(self, t, reduction):
            self.parts.append(t.clone())
            return sum(self.parts) if len(self.parts) == 2 else t

    model, acc = _tiny_model(), TwoRanks()
    one = _c4(c4_dir, t5_tokenizer_dir, "authors")
    batch_means, rows = [], []
    for rank in range(2):
        cfg = {"name": "c4", "path": str(c4_dir), "tokenizer": str(t5_tokenizer_dir), "seq_len": SEQ,
               "packing": False, "num_workers": 0, "readers": 2}
        dm = data.build_data(cfg, micro_batch_size=2, rank=rank, world_size=2, model_vocab_size=1000,
                             max_positions=SEQ, eval_mode="authors")
        result = evaluate(model, dm, TARGET, "fp32", acc)
        for b in dm.val_batches(TARGET):
            rows += [tuple(r.tolist()) for r in b["input_ids"]]
            with torch.no_grad():
                batch_means.append(model(input_ids=b["input_ids"], labels=b["labels"]).loss.double().item())
    whole = [tuple(r.tolist()) for b in one.val_batches(TARGET) for r in b["input_ids"]]
    assert sorted(rows) == sorted(whole) and len(batch_means) == 2 * len(one.val_batches(TARGET))
    assert result["val_loss"] == pytest.approx(sum(batch_means) / len(batch_means), rel=1e-6)


def test_eval_mode_bad_input(c4_dir, t5_tokenizer_dir):
    import data

    with pytest.raises(data.DataConfigError, match="eval.mode='nope' is invalid; valid choices: tokens, authors"):
        _c4(c4_dir, t5_tokenizer_dir, "nope")
    with pytest.raises(data.DataConfigError, match="eval.mode=authors .* data.name='synthetic' .* use data=c4"):
        data.build_data({"name": "synthetic", "seq_len": 32, "readers": 1}, micro_batch_size=2, eval_mode="authors")


@pytest.mark.slow
def test_train_and_eval_py_take_eval_mode(c4_dir, t5_tokenizer_dir, tmp_path):
    """eval.mode=authors reaches train.py's evaluations (their rows name the mode) and eval.py, which
    scores the checkpoint as its run did unless eval.mode= says otherwise."""
    c4 = ["data=c4", f"data.path={c4_dir}", f"data.tokenizer={t5_tokenizer_dir}", "data.num_workers=0",
          "data.seq_len=64", "train.eval_tokens=1500", "train.steps=2"]
    assert run_inprocess(tmp_path, *c4, "eval.mode=authors") == 0
    evals = [r for r in rows(tmp_path) if "val_mode" in r]
    assert evals and {r["val_mode"] for r in evals} == {"authors"}
    again = evaluate_ckpt.main([f"checkpoint={tmp_path}", f"out={tmp_path / 'a.json'}"])
    assert again["eval_mode"] == "authors" and again["val_loss"] == pytest.approx(evals[-1]["val_loss"], abs=1e-6)
    tokens = evaluate_ckpt.main([f"checkpoint={tmp_path}", "eval.mode=tokens", f"out={tmp_path / 't.json'}"])
    assert tokens["val_mode"] == "tokens" and tokens["val_loss"] != pytest.approx(again["val_loss"], abs=1e-6)


def test_eval_mode_is_free_to_change_on_resume():
    """eval.mode changes only how evaluations score (each row names its mode), so a resume may change
    it, and a checkpoint written before the setting existed resumes unchanged."""
    from omegaconf import OmegaConf

    from train_utils.resume import config_changes

    cfg = OmegaConf.create({"train": {"steps": 10}, "eval": {"mode": "authors"}})
    assert config_changes("train:\n  steps: 10\n", cfg) == {}
    assert config_changes("train:\n  steps: 10\neval:\n  mode: tokens\n", cfg) == {}
    assert config_changes("train:\n  steps: 9\n", cfg) == {"train.steps": (9, 10)}
