"""Shared by the train/resume/ddp/eval tests: compose configs, run train.py in-process or as a
subprocess, read metrics.jsonl, checkpoints and wandb's offline run file."""
from __future__ import annotations

import contextlib
import copy
import glob
import json
import os
import re
import struct
import subprocess
import sys

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from _forkserver import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")

# A tiny, fast job: ~0.9M-parameter LLaMA, 64-token rows of the synthetic language, 8 sequences per
# step as 2 micro-batches of 4 (so gradient accumulation is exercised), a small fixed validation set.
TINY = [
    "model=llama_tiny", "data=synthetic", "data.seq_len=64",
    "train.batch_size=8", "train.micro_batch_size=4", "train.eval_tokens=1024", "train.eval_every=0",
    "train.progress_bar=false", "train.plot=false", "wandb.mode=disabled", "checkpoint.every=0",
    # restarts of a fixed length: the schedule does not depend on train.steps, so N and 2N step
    # runs share their first N learning rates (needed by the 2N == N + N resume tests)
    "schedule=cosine_restarts", "schedule.cycle_length=8", "optimizer.update_gap=3",
]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


_PARSED: dict[tuple, object] = {}  # (config file, its mtime and size) -> what Hydra's file source loaded from it


@contextlib.contextmanager
def _yaml_files_parsed_once():
    """While composing, each configs/ file is read and parsed once per session (about half of a compose's time is
    parsing the same ~50 files again): Hydra gets a deep copy of what it loaded the first time, as it would
    parse it again (a file changed since is parsed again)."""
    from hydra._internal.core_plugins.file_config_source import FileConfigSource

    load = FileConfigSource.load_config

    def cached(source, config_path):
        path = os.path.realpath(os.path.join(source.path, source._normalize_file_name(config_path)))
        stat = os.stat(path) if os.path.exists(path) else None
        if stat is None:
            return load(source, config_path)  # raises as Hydra does
        key = (source.path, config_path, stat.st_mtime_ns, stat.st_size)
        if key not in _PARSED:
            _PARSED[key] = load(source, config_path)
        return copy.deepcopy(_PARSED[key])

    FileConfigSource.load_config = cached
    try:
        yield
    finally:
        FileConfigSource.load_config = load


_COMPOSED: dict[tuple, object] = {}  # overrides -> the composed config (hydra node included), once per session


def compose_once(*overrides: str, hydra_cfg: bool = False):
    """compose(config) of these exact overrides, composed once per session (several tests compose the same
    sweep job): a deep copy each call, so a test that changes its config changes no other test's; without
    hydra_cfg, the hydra node removed as compose(return_hydra_config=False) does."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=CONFIGS, version_base=None), _yaml_files_parsed_once():
            _COMPOSED[key] = compose(config_name="config", overrides=list(key), return_hydra_config=True)
    cfg = copy.deepcopy(_COMPOSED[key])
    if not hydra_cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def run_inprocess(run_dir, *overrides: str, base=TINY) -> int:
    import train

    return train.train(compose_cfg(*base, *overrides), str(run_dir))


def train_cmd(run_dir, *overrides: str, base=TINY) -> list[str]:
    return [sys.executable, "train.py", *base, *overrides, f"hydra.run.dir={run_dir}"]


def torchrun_cmd(run_dir, *overrides: str, nproc: int = 2, base=TINY) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "train.py", *base, *overrides, f"hydra.run.dir={run_dir}"]


def subprocess_env() -> dict:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")


def run_cli(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """`cmd` from the repository with subprocess_env(); a `python script.py` command and a plain
    `torchrun --standalone --nproc_per_node=N` launch (its ranks) are forked from a warm interpreter
    (tests/_forkserver.py), other torchrun commands and `python -c` run as fresh processes."""
    return run_python(cmd, cwd=REPO, env=subprocess_env(), timeout=timeout)


_HEADERS = ("Traceback (most recent call last)", "Fatal Python error")
_STACK_LINES = ("Traceback", "Fatal Python error", "Thread 0x", "Current thread", "Stack (most recent",
                "During handling", "The above exception", "File ")


def failure(proc: subprocess.CompletedProcess, tail: int = 1500) -> str:
    """Why a command of several processes (torchrun, two Popens) failed, for an assertion's message:
    first every process's Python traceback and faulthandler's fatal-error stack (its thread stacks, to the
    failing call), with torchrun's per-rank exit lines, then the end of stderr. Faulthandler's list of
    extension modules (one line of some 3,000 characters) is left out everywhere: as the last thing a
    crashed rank prints, it used to fill the whole message."""
    lines = [ln for ln in (proc.stderr or "").splitlines() if "Extension modules:" not in ln]
    causes, inside = [], False
    for ln in lines:
        body = re.sub(r"^\[(?:rank|default)?\d+\]:\s?", "", ln)  # torchrun's per-rank prefix
        if body.startswith(_HEADERS):
            inside = True
            causes.append("----")
        if inside:
            causes.append(ln)
            ends = body and not body[0].isspace() and not body.startswith(_STACK_LINES)
            inside = not ends and len(causes) < 400
        elif re.search(r"exitcode\s*:|Signal \d+ \(|rank\s*:\s*\d+ \(local_rank", body):
            causes.append(ln)
    end = "\n".join(lines)[-tail:]
    return (f"exit {proc.returncode}; what each process reported:\n" + "\n".join(causes[:400])
            + f"\n---- the last {tail} characters of stderr ----\n{end}")


def rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def weights(ckpt_dir) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(ckpt_dir, "model.pt"), weights_only=True)


def assert_same_weights(a: dict, b: dict, exact: bool = True, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs"
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def read_wandb_records(run_dir) -> list:
    """Records of the offline run file `<run_dir>/wandb/offline-run-*/run-*.wandb`.

    wandb 0.31 ships no reader for it. The format is LevelDB's log: a 7-byte file header
    (":W&B", magic, version), then 32 KiB blocks of records, each with a 7-byte header (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last) and a payload, a serialized
    `wandb_internal_pb2.Record`; a block's tail shorter than a header is zero padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        raw = f.read()
    ident, _magic, _version = struct.unpack("<4sHB", raw[:7])
    assert ident == b":W&B", ident
    block, header = 32768, 7
    pos, payloads, pending = 7, [], b""
    while pos + header <= len(raw):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + header])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk = raw[pos + header:pos + header + length]
        pos += header + length
        if kind == 1:
            payloads.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            payloads.append(pending + chunk)
            pending = b""
    records = []
    for payload in payloads:
        record = pb.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def wait_for_wandb_run(run_dir, timeout: float = 60.0) -> list:
    """The records once the run's `exit` record is there: wandb's service process may still be
    writing the file for a moment after `wandb.finish()` has returned."""
    import time

    deadline = time.time() + timeout
    while True:
        try:
            records = read_wandb_records(run_dir)
        except (ValueError, AssertionError):  # no file yet / header not written yet
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.time() > deadline:
            return records
        time.sleep(0.2)


def wandb_history(run_dir) -> list[dict]:
    """The logged history rows ({key: value}) of the offline run."""
    out = []
    for r in wait_for_wandb_run(run_dir):
        if r.WhichOneof("record_type") == "history":
            out.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return out
