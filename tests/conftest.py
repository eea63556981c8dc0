"""Test-wide settings: nothing may reach the network, and wandb never asks for an account."""
import os

# Fail fast on any code path that would try to download from the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The run-directory resolvers (hydra.run.dir); configs/ composes without this import.
import train_utils  # noqa: E402,F401

# --------------------------------------------------------------------------------------------------
# Shared data fixtures (session-scoped, built once per test run in a temporary directory; nothing
# here reads outside the repository or touches the network).
#
# c4_dir            Path of a directory in the original C4 layout:
#                     en/c4-train.00000-of-01024.json.gz, en/c4-train.00001-of-01024.json.gz
#                     (150 documents each) and en/c4-validation.00000-of-00008.json.gz (100 docs),
#                   gzip'd JSON lines {"text", "timestamp", "url"}. Documents are sentences made
#                   from the words of tests/assets/tinyshakespeare_slice.txt (public domain), with
#                   lengths from a few words to ~700 (so some exceed 256 tokens and get truncated).
#                   Use it as data.path for the c4 source.
# c4_texts          {"train": [...300 texts in file order...], "validation": [...100 texts...]}.
# t5_tokenizer_dir  Path of a T5-style tokenizer directory: a sentencepiece unigram model
#                   (spiece.model, 1000 pieces, T5 id layout pad=0 eos=1 unk=2, no bos) trained on the
#                   c4_dir texts, plus tokenizer_config.json, so both transformers.T5Tokenizer and
#                   AutoTokenizer load it (len(tokenizer) == 1100: 1000 pieces + 100 <extra_id_N>).
#                   Pair it with a model/vocab of 1000 ids (data: model_vocab_size=1000).
# --------------------------------------------------------------------------------------------------
import gzip as _gzip
import json as _json
import random as _random
import re as _re
from pathlib import Path as _Path

import pytest as _pytest
import torch as _torch

ASSETS = _Path(__file__).parent / "assets"
TOKENIZER_VOCAB = 1000


def make_documents(n: int, seed: int) -> list[str]:
    """n varied documents: sentences of Shakespeare's words, 1 to ~50 sentences each."""
    words = _re.findall(r"[A-Za-z']+", (ASSETS / "tinyshakespeare_slice.txt").read_text())
    rng = _random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 50])):
            s = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
            sentences.append(s[0].upper() + s[1:] + rng.choice([".", ".", "!", "?"]))
        docs.append(" ".join(sentences))
    return docs


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker per core this process may run on (its affinity, not
    OMP_NUM_THREADS and not psutil's physical count, which is 1 on some 2-vCPU machines), at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


@_pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """With workers (pytest-xdist, `--dist loadgroup`), the tests that share a module-scoped fixture
    of their own module (a trained run, a torchrun result) go to one worker, so that fixture is built
    once, as in a run without workers."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        defs = getattr(item, "_fixtureinfo", None)
        defs = defs.name2fixturedefs if defs else {}
        for name in item.fixturenames:
            fixture = defs.get(name, [None])[-1]
            if fixture is not None and fixture.scope == "module" and fixture.baseid == module:
                item.add_marker(_pytest.mark.xdist_group(module))
                break


@_pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread in these tests and their subprocesses: on a shared 2-core machine two
    spinning OpenMP threads per process make tiny models 10-40x slower. (torchrun sets
    OMP_NUM_THREADS=1 itself.) The same thread count everywhere also keeps in-process and subprocess
    runs bitwise comparable. Autouse: every test module."""
    threads = _torch.get_num_threads()
    _torch.set_num_threads(1)
    yield
    _torch.set_num_threads(threads)


@_pytest.fixture(scope="session")
def c4_texts() -> dict:
    return {"train": make_documents(300, seed=1), "validation": make_documents(100, seed=2)}


@_pytest.fixture(scope="session")
def c4_dir(tmp_path_factory, c4_texts) -> _Path:
    root = tmp_path_factory.mktemp("c4")
    (root / "en").mkdir()
    shards = {
        "en/c4-train.00000-of-01024.json.gz": c4_texts["train"][:150],
        "en/c4-train.00001-of-01024.json.gz": c4_texts["train"][150:],
        "en/c4-validation.00000-of-00008.json.gz": c4_texts["validation"],
    }
    for name, texts in shards.items():
        with _gzip.open(root / name, "wt", encoding="utf-8") as f:
            for i, text in enumerate(texts):
                row = {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{name}/{i}"}
                f.write(_json.dumps(row) + "\n")
    return root


@_pytest.fixture(scope="session")
def t5_tokenizer_dir(tmp_path_factory, c4_texts) -> _Path:
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("t5_tokenizer")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(c4_texts["train"] + c4_texts["validation"]) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(root / "spiece"), vocab_size=TOKENIZER_VOCAB,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2, num_threads=1,
    )
    corpus.unlink()
    (root / "spiece.vocab").unlink(missing_ok=True)
    (root / "tokenizer_config.json").write_text(
        _json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 100, "model_max_length": 512})
    )
    return root


@_pytest.fixture
def fake_train(monkeypatch):
    """scripts/mini_repro.py with train.py replaced by a stand-in that writes the metrics a finished
    run leaves (the script's own logic is under test, not training): validation loss 4.0 at the
    learning rate 3e-3, worse away from it. Returns the overrides of every call."""
    import subprocess

    from scripts import mini_repro

    calls = []

    def run(cmd, **kwargs):
        overrides = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        calls.append(overrides)
        loss = 4.0 + abs(float(overrides["optimizer.lr"]) - 3e-3) * 100
        rows = [{"event": "start", "step": 0, "params": 1000},
                {"event": "end", "step": int(overrides["train.steps"]), "val_loss": loss, "val_ppl": 2.718 ** loss,
                 "optimizer_state_bytes": 4096}]
        (_Path(overrides["hydra.run.dir"]) / "metrics.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(mini_repro.subprocess, "run", run)
    return calls
