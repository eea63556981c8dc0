"""Fault injection for train.py: kill, signal, damage and starve runs, then check how they end and
whether the resumed run is the uninterrupted one. Prints a table of trials and outcomes.

    python -m ops.fault_inject                      # modest counts, ~15 minutes on 2 shared CPU cores
    python -m ops.fault_inject --kills 20 --signals 8 --damage 16 --disk-full 4 --seed 1

Every trial trains the same tiny job (llama_tiny on the synthetic corpus, a checkpoint every step) in
its own run directory and compares its per-step losses and final weights with one uninterrupted
reference run, bitwise unless a trial says otherwise. The categories and what each expects (an exit
code, one error line naming the file, the same end): docs/reliability.md, "Fault injection", and
the `ok` condition of each trial below.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from train_utils import checkpoint as ckpt
from train_utils.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = 12
JOB = ["model=llama_tiny", "data=synthetic", "data.seq_len=64", "train.batch_size=8", "train.micro_batch_size=4",
       "train.eval_tokens=1024", "train.eval_every=0", "train.progress_bar=false", "train.plot=false",
       "wandb.mode=disabled", "checkpoint.every=1", "checkpoint.keep=3", "schedule=cosine_restarts",
       "schedule.cycle_length=8", "optimizer.update_gap=3", f"train.steps={STEPS}"]
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def command(run_dir: str, *extra: str) -> list[str]:
    return [sys.executable, os.path.join(REPO, "train.py"), *JOB, *extra, f"hydra.run.dir={run_dir}"]


def environment() -> dict:
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")


def run(run_dir: str, *extra: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    def limit():  # Python ignores SIGXFSZ, so writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    # a preexec_fn only where there is a limit: without one, subprocess can start the child the faster way
    return subprocess.run(command(run_dir, *extra), cwd=REPO, env=environment(), capture_output=True, text=True,
                          timeout=600, preexec_fn=limit if limit_bytes else None)


def start(run_dir: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command(run_dir, *extra), cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def logged_steps(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return sum('"loss"' in line for line in open(path).read().split("\n")[:-1])


def losses(run_dir: str) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r}


def final_weights(run_dir: str) -> dict:
    return ckpt.load(ckpt.latest(os.path.join(run_dir, ckpt.CHECKPOINT_DIR)), "model")


def same_as(reference: str, run_dir: str) -> bool:
    a, b = final_weights(reference), final_weights(run_dir)
    return losses(reference) == losses(run_dir) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def finish(reference: str, run_dir: str) -> tuple[str, bool]:
    """Run the same command again until it is done (at most twice) and compare with the reference."""
    codes = []
    for _ in range(2):
        proc = run(run_dir)
        codes.append(proc.returncode)
        if proc.returncode == 0:
            break
    ok = codes[-1] == 0 and same_as(reference, run_dir)
    return "/".join(map(str, codes)), ok


# ------------------------------------------------------------------------------------------ trials
def kill_trial(reference: str, run_dir: str, rng: random.Random, during_write: bool) -> dict:
    proc = start(run_dir)
    root = os.path.join(run_dir, ckpt.CHECKPOINT_DIR)
    target = rng.randint(1, STEPS - 1)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if logged_steps(run_dir) >= target and (
                not during_write or any(n.startswith(".tmp_") for n in os.listdir(root) if os.path.isdir(root))):
            break
        time.sleep(0.0005 if during_write else 0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed_after = logged_steps(run_dir)
    hit_write = os.path.isdir(root) and any(n.startswith(".tmp_") for n in os.listdir(root))
    latest = ckpt.latest(root) if os.path.isdir(root) else None
    intact = latest is None or ckpt.verify(latest) is None
    codes, ok = finish(reference, run_dir)
    detail = f"after step {killed_after}" + (", inside a checkpoint write" if hit_write else "")
    return {"fault": "SIGKILL", "detail": detail, "exit codes": f"-9 then {codes}",
            "outcome": "latest intact, resumed bitwise" if ok and intact else "FAILED", "ok": ok and intact,
            "in_write": hit_write}


def signal_trial(reference: str, run_dir: str, rng: random.Random, name: str) -> dict:
    proc = start(run_dir, "data.num_workers=2")
    target = rng.randint(1, STEPS - 2)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and logged_steps(run_dir) < target:
        time.sleep(0.01)
    os.killpg(proc.pid, getattr(signal, name))  # the whole group: main process and DataLoader workers
    out, err = proc.communicate()
    stopped = proc.returncode == 75 and "stopped by" in out
    codes, ok = finish(reference, run_dir)
    return {"fault": f"{name} to the group", "detail": f"after step {target}, 2 DataLoader workers",
            "exit codes": f"{proc.returncode} then {codes}",
            "outcome": "checkpoint + exit 75, resumed bitwise" if stopped and ok else f"FAILED: {last_line(err)}",
            "ok": stopped and ok}


def _overwrite(folder: str, name: str, rng: random.Random, n: int, flip: bool) -> None:
    """n bytes at a random place of a file, flipped or replaced by random ones."""
    path = os.path.join(folder, name)
    data = bytearray(open(path, "rb").read())
    at = rng.randrange(0, max(1, len(data) - n))
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n]) if flip else rng.randbytes(n)
    open(path, "wb").write(bytes(data))


DAMAGES = {
    "64 flipped bytes in model.pt": lambda c, rng: _overwrite(c, "model.pt", rng, 64, True),
    "4 KiB of random bytes in optimizer.pt": lambda c, rng: _overwrite(c, "optimizer.pt", rng, 4096, False),
    "trainer.pt truncated": lambda c, rng: os.truncate(os.path.join(c, "trainer.pt"),
                                                       os.path.getsize(os.path.join(c, "trainer.pt")) // 2),
    "optimizer.pt missing": lambda c, rng: os.remove(os.path.join(c, "optimizer.pt")),
    "manifest.json missing": lambda c, rng: os.remove(os.path.join(c, ckpt.MANIFEST)),
    "config.yaml emptied": lambda c, rng: open(os.path.join(c, "config.yaml"), "w").close(),
    "latest emptied": lambda c, rng: open(os.path.join(os.path.dirname(c), ckpt.LATEST), "w").close(),
    "latest garbled": lambda c, rng: open(os.path.join(os.path.dirname(c), ckpt.LATEST), "wb").write(rng.randbytes(12)),
}


def damage_trial(reference: str, run_dir: str, rng: random.Random, kind: str) -> dict:
    shutil.copytree(reference, run_dir)
    newest = ckpt.latest(os.path.join(run_dir, ckpt.CHECKPOINT_DIR))
    DAMAGES[kind](newest, rng)
    proc = run(run_dir)
    pointer_only = kind.startswith("latest")
    named = "skipped a damaged checkpoint" in proc.stdout
    ok = proc.returncode == 0 and "Traceback" not in proc.stderr and same_as(reference, run_dir) and (
        named or pointer_only) and ckpt.verify(ckpt.latest(os.path.join(run_dir, ckpt.CHECKPOINT_DIR))) is None
    outcome = ("pointer repaired, nothing lost" if pointer_only else "named and skipped, resumed bitwise") if ok \
        else f"FAILED: {last_line(proc.stderr or proc.stdout)}"
    return {"fault": "damaged file", "detail": kind, "exit codes": str(proc.returncode), "outcome": outcome, "ok": ok}


def disk_full_trial(reference: str, run_dir: str, rng: random.Random, resumed: bool) -> dict:
    previous = None
    if resumed:  # a run that already holds checkpoints: stop it part-way first
        proc = start(run_dir)
        target = rng.randint(2, STEPS - 2)
        while proc.poll() is None and logged_steps(run_dir) < target:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate()
        previous = ckpt.latest(os.path.join(run_dir, ckpt.CHECKPOINT_DIR))
    proc = run(run_dir, limit_bytes=1 << 20)  # below the size of model.pt
    line = last_line(proc.stderr)
    expected_tail = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    clean = (proc.returncode == 1 and "Traceback" not in proc.stderr and line.startswith("error: file too large")
             and "while writing" in line and line.endswith(expected_tail))
    codes, ok = finish(reference, run_dir)
    return {"fault": "file-size limit (full disk)", "detail": "run with checkpoints" if resumed else "fresh run",
            "exit codes": f"{proc.returncode} then {codes}",
            "outcome": (f"one line, {'previous checkpoint intact' if resumed else 'no checkpoint yet'}, "
                        f"resumed bitwise") if clean and ok else f"FAILED: {line}",
            "ok": clean and ok}


def catches_signal(pid: int, sig: int) -> bool:
    """The process has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (sig - 1)))


def early_signal_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    proc = start(run_dir)
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline and not catches_signal(proc.pid, signal.SIGTERM):
        time.sleep(0.001)  # the interpreter itself starts without any handler: from train.py's first lines on
    delay = rng.uniform(0.0, 3.0)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate()
    stopped = proc.returncode == 75 and "stopped by SIGTERM" in out and "Traceback" not in err
    codes, ok = finish(reference, run_dir)
    return {"fault": "SIGTERM during start-up", "detail": f"{delay:.1f} s after train.py's first line",
            "exit codes": f"{proc.returncode} then {codes}",
            "outcome": "message + exit 75, then the same end" if stopped and ok else f"FAILED: {last_line(err)}",
            "ok": stopped and ok}


def writer_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    first = start(run_dir)
    lock = os.path.join(run_dir, "run.lock")

    def holds() -> bool:
        try:
            return json.load(open(lock))["pid"] == first.pid and logged_steps(run_dir) >= 1
        except (OSError, ValueError, KeyError):
            return False

    deadline = time.time() + 300
    while first.poll() is None and time.time() < deadline and not holds():
        time.sleep(0.01)
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        second = run(run_dir)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    first.communicate()
    line = last_line(second.stderr)
    refused = (second.returncode == 2 and "Traceback" not in second.stderr
               and line.startswith(f"error: run dir {run_dir} is in use by another run (pid {first.pid} on host "))
    ok = refused and first.returncode == 0 and same_as(reference, run_dir)
    return {"fault": "second writer", "detail": "same run dir, first run under way",
            "exit codes": f"{second.returncode} (second), {first.returncode} (first)",
            "outcome": "refused with the holder named; first run exact" if ok else f"FAILED: {line}", "ok": ok}


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _rehash(ckpt_dir: str) -> None:
    files = {}
    for folder, _, names in os.walk(ckpt_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), ckpt_dir)
            if rel != ckpt.MANIFEST:
                data = open(os.path.join(ckpt_dir, rel), "rb").read()
                files[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(ckpt_dir, ckpt.MANIFEST), "w") as f:
        json.dump({"format": 1, "files": files}, f)


def forged_trial(reference: str, run_dir: str, rng: random.Random, name: str) -> dict:
    shutil.copytree(reference, run_dir)
    newest = ckpt.latest(os.path.join(run_dir, ckpt.CHECKPOINT_DIR))
    path, marker = os.path.join(newest, name), os.path.join(run_dir, "PAYLOAD_RAN")
    state = torch.load(path, weights_only=True)
    state = {**state, "payload": _Payload(marker)}
    torch.save(state, path)
    _rehash(newest)
    proc = run(run_dir, f"train.steps={STEPS + 2}", "train.resume_changes=[train.steps]")
    line = last_line(proc.stderr)
    ok = (proc.returncode == 1 and "Traceback" not in proc.stderr and not os.path.exists(marker)
          and line.startswith(f"error: refused to load {path}"))
    return {"fault": "hand-made checkpoint", "detail": f"a pickled call in {name}", "exit codes": str(proc.returncode),
            "outcome": "refused in one line, nothing ran" if ok else f"FAILED: {line}", "ok": ok}


def resize_trial(reference: str, run_dir: str, rng: random.Random, parallelism: str) -> dict:
    half = STEPS // 2
    first = run(run_dir, f"train.parallelism={parallelism}", f"train.steps={half}")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                os.path.join(REPO, "train.py"), *JOB, f"train.parallelism={parallelism}",
                "train.resume_changes=[train.steps]", f"hydra.run.dir={run_dir}"]
    second = subprocess.run(torchrun, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=600)
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl")) if second.returncode == 0 else []
    mine, ref = losses(run_dir) if rows else {}, losses(reference)
    resized = any(r.get("event") == "world_size_changed" and r.get("from") == 1 and r.get("to") == 2 for r in rows)
    # The reference is a DDP run: a DDP first half is bitwise the same; FSDP2 computes with bf16 weights
    # (tests/test_fsdp_train.py), so its losses are compared within a tolerance throughout.
    bitwise = parallelism == "ddp"
    ok = (first.returncode == 0 and second.returncode == 0 and resized and rows[-1].get("event") == "end"
          and sorted(mine) == sorted(ref) and (not bitwise or all(mine[s] == ref[s] for s in range(1, half + 1)))
          and all(abs(mine[s] - ref[s]) < 0.02 for s in mine))
    gap = max((abs(mine[s] - ref[s]) for s in mine if s > half or not bitwise), default=float("nan"))
    return {"fault": f"{parallelism.upper()} 1 -> 2 processes", "detail": f"{half} steps on 1, {STEPS - half} on 2",
            "exit codes": f"{first.returncode} then {second.returncode}",
            "outcome": (f"continued on 2, {'first half bitwise, later ' if bitwise else ''}losses within {gap:.1e} "
                        f"of the DDP reference" if ok else f"FAILED: {last_line(second.stderr or first.stderr)}"),
            "ok": ok}


def dcp_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    first = run(run_dir, "train.parallelism=fsdp", "train.steps=2")
    newest = ckpt.latest(os.path.join(run_dir, ckpt.CHECKPOINT_DIR))
    path, marker = os.path.join(newest, "dcp", ".metadata"), os.path.join(run_dir, "PAYLOAD_RAN")
    with open(path, "wb") as f:
        pickle.dump(_Payload(marker), f)
    _rehash(newest)
    proc = run(run_dir, "train.parallelism=fsdp", "train.steps=3", "train.resume_changes=[train.steps]")
    line = last_line(proc.stderr)
    ok = (first.returncode == 0 and proc.returncode == 1 and "Traceback" not in proc.stderr
          and not os.path.exists(marker) and line.startswith(f"error: refused to load {path}"))
    return {"fault": "hand-made checkpoint", "detail": "a pickled call in a sharded dcp/.metadata",
            "exit codes": f"{first.returncode} then {proc.returncode}",
            "outcome": "refused in one line, nothing ran" if ok else f"FAILED: {line}", "ok": ok}


def diverge_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    diverging = ["optimizer.lr=1e6", "checkpoint.keep=1", "train.steps=6"]  # NaN by step 3; 6 steps suffice
    proc = run(run_dir, *diverging)
    line = last_line(proc.stderr)
    found = re.search(r"run the same command with (.*?) \(", line)
    remedy = found.group(1).split() if found else []
    followed = run(run_dir, *diverging, *remedy) if remedy else None
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl")) if followed and followed.returncode == 0 else []
    ok = (proc.returncode == 1 and "Traceback" not in proc.stderr and "Last checkpoint from before the divergence"
          in line and followed is not None and followed.returncode == 0 and rows and rows[-1].get("event") == "end"
          and all(r["loss"] == r["loss"] for r in rows if "loss" in r))
    return {"fault": "divergence (optimizer.lr=1e6)", "detail": "then the printed remedy, literally",
            "exit codes": f"{proc.returncode} then {followed.returncode if followed else '-'}",
            "outcome": "last good named, its remedy trains to the end" if ok
            else f"FAILED: {last_line((followed.stderr if followed else '') or line)}", "ok": ok}


def late_signal_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    proc = start(run_dir)
    path, deadline = os.path.join(run_dir, "metrics.jsonl"), time.time() + 300

    def ended() -> bool:
        try:
            return '"event": "end"' in open(path).read()
        except OSError:
            return False

    while proc.poll() is None and time.time() < deadline and not ended():
        time.sleep(0.005)
    delay = rng.uniform(0.0, 1.0)
    time.sleep(delay)
    alive = proc.poll() is None
    if alive:
        os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate()
    ok = proc.returncode == 0 and ended() and same_as(reference, run_dir)
    return {"fault": "SIGTERM after the end row", "detail": f"{delay:.1f} s later" + ("" if alive else
                                                                                       ", the process had exited"),
            "exit codes": str(proc.returncode),
            "outcome": "exit 0, the run as the reference" if ok else f"FAILED: {last_line(err)}", "ok": ok}


def garbage_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    import sentencepiece as spm

    texts, tokenizer = run_dir + "_data", run_dir + "_tokenizer"
    os.makedirs(texts, exist_ok=True)
    os.makedirs(tokenizer, exist_ok=True)
    good = os.path.join(texts, "a.txt")
    with open(good, "w") as f:
        f.write("".join(f"document {i}: some words to train on, number {i * 7}.\n\n" for i in range(300)))
    # a small local tokenizer: the run must get as far as reading the files without a download
    spm.SentencePieceTrainer.train(input=good, model_prefix=os.path.join(tokenizer, "spiece"), vocab_size=128,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   hard_vocab_limit=False, character_coverage=1.0, minloglevel=2, num_threads=1)
    with open(os.path.join(tokenizer, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "model_max_length": 512}, f)
    garbage = os.path.join(texts, "b.txt")
    with open(garbage, "wb") as f:
        f.write(b"text at first\n" + bytes(range(128, 256)) * 32)  # no UTF-8 decoder accepts these
    proc = run(run_dir, "data=local", f"data.path={texts}", f"data.tokenizer={tokenizer}", "data.seq_len=64")
    line = last_line(proc.stderr)
    ok = (proc.returncode == 2 and "Traceback" not in proc.stderr
          and line.startswith(f"error: {garbage} is not UTF-8 text"))
    return {"fault": "binary text data file", "detail": "4 KiB of bytes >= 0x80 in a .txt",
            "exit codes": str(proc.returncode), "outcome": "one line naming the file" if ok else f"FAILED: {line}",
            "ok": ok}


def badline_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    shutil.copytree(reference, run_dir)
    path = os.path.join(run_dir, "metrics.jsonl")
    lines = open(path).read().splitlines()
    at = rng.randint(1, len(lines) - 2)  # never the last: a partial last line is dropped by itself
    with open(path, "w") as f:
        f.write("\n".join(lines[:at] + ["{not json"] + lines[at:]) + "\n")
    proc = run(run_dir, f"train.steps={STEPS + 2}", "train.resume_changes=[train.steps]")
    line = last_line(proc.stderr)
    ok = (proc.returncode == 1 and "Traceback" not in proc.stderr
          and line.startswith(f"error: {path}, line {at + 1} of {len(lines) + 1}: not a JSON row"))
    return {"fault": "bad metrics.jsonl line", "detail": f"line {at + 1} of {len(lines) + 1} is not JSON",
            "exit codes": str(proc.returncode), "outcome": "one line naming the file and line" if ok
            else f"FAILED: {line}", "ok": ok}


def stale_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    shutil.copytree(reference, run_dir)
    root = os.path.join(run_dir, ckpt.CHECKPOINT_DIR)
    listed = ckpt.list_checkpoints(root)
    older, newest = listed[rng.randrange(0, len(listed) - 1)], listed[-1]
    ckpt.point_latest(root, older)
    proc = run(run_dir)
    noted = (f"note: `latest` names {older}, but a newer intact checkpoint exists, {newest}" in proc.stdout
             and f"pass train.resume={newest}" in proc.stdout)
    same = proc.returncode == 0 and same_as(reference, run_dir)
    taken = run(run_dir, f"train.resume={newest}") if same else None  # the note's advice: a finished run
    ok = noted and same and taken is not None and taken.returncode == 0
    return {"fault": "stale `latest` pointer", "detail": f"names {os.path.basename(older)}, "
                                                           f"{os.path.basename(newest)} exists",
            "exit codes": f"{proc.returncode} then {taken.returncode if taken else '-'}",
            "outcome": "newer one noted, continued as `latest` says, same end" if ok
            else f"FAILED: {last_line(proc.stderr or proc.stdout)}", "ok": ok}


def full_metrics_trial(reference: str, run_dir: str, rng: random.Random, _arg) -> dict:
    # 6000 bytes: above .hydra's files, below 30 steps of rows; no checkpoint before the last step
    extra = ("train.steps=30", "checkpoint.every=0")
    proc = run(run_dir, *extra, limit_bytes=6000)
    line = last_line(proc.stderr)
    path = os.path.join(run_dir, "metrics.jsonl")
    ok = (proc.returncode == 1 and "Traceback" not in proc.stderr and line == (
        f"error: file too large (the file-size limit was reached) while writing {path}; no earlier checkpoint "
        f"exists; free space, then run the same command again to continue"))
    return {"fault": "file-size limit (full disk)", "detail": "metrics.jsonl, no checkpoint yet",
            "exit codes": str(proc.returncode), "outcome": "one line naming metrics.jsonl" if ok
            else f"FAILED: {line}", "ok": ok}


FORGED = ("model.pt", "optimizer.pt", "trainer.pt")
TRIALS = {"kill": kill_trial, "signal": signal_trial, "damage": damage_trial, "disk": disk_full_trial,
          "early": early_signal_trial, "writer": writer_trial, "forged": forged_trial, "resize": resize_trial,
          "dcp": dcp_trial, "diverge": diverge_trial, "late": late_signal_trial, "garbage": garbage_trial,
          "badline": badline_trial, "stale": stale_trial, "fullmeta": full_metrics_trial}
ONE_EACH = ("dcp", "diverge", "late", "garbage", "badline", "stale", "fullmeta")  # a count of trials each


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("kills", 6), ("signals", 4), ("damage", 8), ("disk-full", 2), ("early", 2), ("writers", 1),
                          ("forged", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--resize", type=int, default=2, help="alternately DDP and FSDP2, 1 -> 2 processes")
    for kind in ONE_EACH:
        parser.add_argument(f"--{kind}", type=int, default=1, help=f"trials of the {kind} category")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the run dirs here (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the trials to this file")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    # absolute: the runs start in the repository, not in this directory
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="fault_inject_"))
    os.makedirs(workdir, exist_ok=True)
    reference = os.path.join(workdir, "reference")
    shutil.rmtree(reference, ignore_errors=True)
    done = run(reference)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    trials, damages = [], list(DAMAGES)
    plan = ([("kill", i % 2 == 1) for i in range(args.kills)]
            + [("signal", SIGNALS[i % 4]) for i in range(args.signals)]
            + [("damage", damages[i % len(damages)]) for i in range(args.damage)]
            + [("disk", i % 2 == 1) for i in range(args.disk_full)] + [("early", None) for _ in range(args.early)]
            + [("writer", None) for _ in range(args.writers)]
            + [("forged", FORGED[i % len(FORGED)]) for i in range(args.forged)]
            + [("resize", ("ddp", "fsdp")[i % 2]) for i in range(args.resize)]
            + [(kind, None) for kind in ONE_EACH for _ in range(getattr(args, kind))])
    for i, (kind, arg) in enumerate(plan):
        run_dir = os.path.join(workdir, f"trial_{i:03d}")
        shutil.rmtree(run_dir, ignore_errors=True)
        trial = TRIALS[kind](reference, run_dir, rng, arg)
        trials.append(trial)
        print(f"  trial {i + 1}/{len(plan)}: {trial['fault']}, {trial['detail']}: {trial['outcome']}", file=sys.stderr)
    columns = ("fault", "detail", "exit codes", "outcome")
    widths = [max(len(c), *(len(str(t[c])) for t in trials)) for c in columns]
    n = len(str(len(trials)))
    print(f"| {'#'.rjust(n)} | " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print(f"|{'-' * (n + 2)}|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for i, t in enumerate(trials, 1):
        print(f"| {str(i).rjust(n)} | " + " | ".join(str(t[c]).ljust(w) for c, w in zip(columns, widths)) + " |")
    passed = sum(t["ok"] for t in trials)
    writes = sum(t.get("in_write", False) for t in trials)
    print(f"\n{passed}/{len(trials)} trials ended as promised ({writes} of the {args.kills} kills landed inside a "
          f"checkpoint write); reference: {STEPS} steps of llama_tiny, checkpoint every step.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(trials, f, indent=1)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if passed == len(trials) else 1


if __name__ == "__main__":
    sys.exit(main())
