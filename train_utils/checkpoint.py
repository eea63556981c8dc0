"""Atomic, safely loadable checkpoints.

Layout of a run directory's checkpoints:

    <run_dir>/checkpoints/
        step_00000100/      model.pt  optimizer.pt  trainer.pt  config.yaml
        step_00000200/      ...
        latest              text file: the name of the newest complete checkpoint ("step_00000200")

A checkpoint is first written into a hidden temporary directory (every file flushed and fsync'ed),
which is then renamed to its final name; `latest` is replaced (write temp file + os.replace) only
after that. Renames are atomic on POSIX file systems, so a process killed at any moment (SIGKILL,
node failure) leaves either the previous checkpoint or the new one as `latest`, never a half-written
one; leftover temporary directories are removed by the next run.

Every file holds only tensors and plain Python containers/numbers/strings, so it loads with
`torch.load(..., weights_only=True)` (torch >= 2.6's safe default): RNG states are converted to
tensors and lists, the config is stored as YAML text.
"""
from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: str) -> None:
    # Make the rename itself durable; some file systems do not support opening directories.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(root: str, step: int, files: dict, texts: dict | None = None, keep: int = 2) -> str:
    """Write `files` (name -> object for torch.save) and `texts` (name -> str) as checkpoint `step`
    under `root`, atomically; then point `latest` at it and prune the oldest others so that `keep` remain."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, f".tmp_{step_dir_name(step)}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, obj in files.items():
        path = os.path.join(tmp, f"{name}.pt")
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    for name, text in (texts or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving the same step (e.g. a resumed run that was already done)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    # `latest` moves only once the directory it names is complete.
    pointer_tmp = os.path.join(root, f".{LATEST}.tmp_{os.getpid()}")
    with open(pointer_tmp, "w") as f:
        f.write(step_dir_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, os.path.join(root, LATEST))
    _fsync_dir(root)
    # Prune the oldest, but never the checkpoint just written (the one `latest` names), even when
    # the directory also holds higher-numbered ones (a run resumed from an earlier checkpoint).
    others = [c for c in list_checkpoints(root) if c != final]
    for old in others[: max(len(others) - (keep - 1), 0)] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under `root`, oldest first (temporaries are never listed)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return [os.path.join(root, name) for _, name in sorted(found)]


def remove_temporaries(root: str) -> None:
    """Delete what a killed writer left behind (never a complete checkpoint)."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(".tmp_") or name.startswith(f".{LATEST}.tmp"):
                path = os.path.join(root, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)


def latest(root: str) -> str | None:
    """The checkpoint `latest` names; if the pointer is missing (killed between the rename and the
    pointer update) the newest complete directory, which is equally valid."""
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.isdir(path):
            return path
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve(path: str) -> str | None:
    """A checkpoint directory from a checkpoint dir, a run's `checkpoints/` dir or a run dir."""
    if os.path.isfile(os.path.join(path, "trainer.pt")):
        return path
    for root in (path, os.path.join(path, CHECKPOINT_DIR)):
        found = latest(root) if os.path.isdir(root) else None
        if found:
            return found
    return None


def load(ckpt_dir: str, name: str, map_location="cpu"):
    return torch.load(os.path.join(ckpt_dir, f"{name}.pt"), map_location=map_location, weights_only=True)


def rng_state() -> dict:
    """This process's RNG states as tensors/lists (safe to load with weights_only=True)."""
    version, keys, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [version, list(keys), gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str, step: int, *, model, optimizer, scheduler, dm, accelerator, tokens: int,
                    config_yaml: str, keep: int, extra: dict | None = None) -> str | None:
    """Write the training state after `step` (collective: call on every rank).

    Every rank's data position and RNG state go into the one checkpoint the main process writes;
    nobody moves on (or exits) before it exists. Returns its path on the main process."""
    from accelerate.utils import gather_object

    per_rank = gather_object([{"data": dm.state_dict(), "rng": rng_state()}])
    path = None
    if accelerator.is_main_process:
        trainer = {"step": step, "tokens": tokens, "world_size": accelerator.num_processes,
                   "scheduler": scheduler.state_dict(), "data": [r["data"] for r in per_rank],
                   "rng": [r["rng"] for r in per_rank], "config": config_yaml, **(extra or {})}
        path = save(root, step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                 "trainer": trainer}, texts={"config.yaml": config_yaml}, keep=keep)
    accelerator.wait_for_everyone()
    return path
