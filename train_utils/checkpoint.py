"""Atomic, verified, safely loadable checkpoints (docs/reliability.md).

    <run_dir>/checkpoints/step_00000100/  model.pt  optimizer.pt  trainer.pt  config.yaml  manifest.json
    <run_dir>/checkpoints/latest          text file naming the newest complete checkpoint

Writing: into a hidden temporary directory (every file fsync'ed, `manifest.json` with each file's size
and SHA-256 last), renamed into place, then `latest` replaced: a process killed at any moment leaves the
previous checkpoint or the new one as `latest`. A failed write raises CheckpointError naming the file
and the intact previous checkpoint. Reading: `find_intact` verifies against the manifest and skips a
damaged checkpoint (or `latest`) for the newest intact one, returning the reasons. Files hold only
tensors and plain data and load memory-mapped with `weights_only=True`; anything else is RefusedFile.
This module imports no other checkpoint module: sharded_checkpoint.py builds on it, resume.py writes
and restores a run's state in either format.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch


CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
LAST_GOOD = "last_good"  # the newest checkpoint whose next loss was not a spike (train_utils/divergence.py)
MANIFEST = "manifest.json"
DAMAGED_SUFFIX = ".damaged"
SHARDED_DIR = "dcp"  # a sharded (FSDP2) checkpoint's DCP files (train_utils/sharded_checkpoint.py)
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_CHUNK = 1 << 24


class CheckpointError(Exception):
    """A checkpoint that cannot be written or used; the message says which, why, and what is intact."""


class RefusedFile(CheckpointError):
    """A checkpoint file that holds something other than tensors and plain data (a pickled object
    that would run code when loaded): refused, never loaded. Its manifest proves nothing here, since
    whoever wrote the file also wrote the manifest."""


def refusal(path: str, what: str) -> RefusedFile:
    return RefusedFile(f"refused to load {path}: it holds {what}, not only tensors and plain data. A checkpoint is "
                       f"data, never code: nothing from it was run. Use a checkpoint written by this code, from a "
                       f"source you trust")


def _unsupported_global(err: Exception) -> str:
    """What torch's weights-only unpickler refused, from its message (e.g. `GLOBAL io.open`)."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    return f"a reference to {found.group(1)}" if found else f"data it cannot load safely ({_first_line(err)})"


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(err).__name__


def torch_load(path_or_file, name: str, **kwargs):
    """torch.load with weights_only=True (tensors, containers, numbers, strings only); anything else
    is RefusedFile naming `name` (the file) in one line."""
    try:
        return torch.load(path_or_file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise refusal(name, _unsupported_global(err)) from err


def is_sharded(ckpt_dir: str) -> bool:
    """Written by a sharded run (DCP files) rather than as whole-model files. Here, not in
    sharded_checkpoint, so telling the two apart does not import torch.distributed.checkpoint."""
    return os.path.isdir(os.path.join(ckpt_dir, SHARDED_DIR))


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


class _HashingFile:
    """What torch.save writes to: hashes and counts the bytes on their way to the file, and keeps
    the OSError of a failed write (torch's zip writer turns it into an opaque RuntimeError)."""

    def __init__(self, f):
        self.f, self.sha, self.size, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as err:
            self.error = err
            raise
        self.sha.update(data)
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def _write_file(path: str, obj) -> dict:
    """Write one checkpoint file (a torch object, or str as UTF-8 text); return its manifest entry."""
    with open(path, "wb") as f:
        out = _HashingFile(f)
        if isinstance(obj, str):
            out.write(obj.encode())
        else:
            try:
                torch.save(obj, out)
            except RuntimeError as err:
                if out.error is None:
                    raise
                raise out.error from err
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": out.size, "sha256": out.sha.hexdigest()}


def _describe_write_error(err: OSError, path: str, previous: str | None) -> str:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on device"
    elif err.errno == errno.EFBIG:
        reason = "file too large (the file-size limit was reached)"
    else:
        reason = err.strerror or str(err)
    intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return f"{reason} while writing {path}; {intact}"


def out_of_space(err: OSError, run_dir: str) -> CheckpointError | None:
    """A full disk (or quota, or file-size limit) outside a checkpoint write, e.g. appending to
    metrics.jsonl: one line naming the file and the intact latest checkpoint. None for other errors."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    where = err.filename or f"a file in {run_dir}"
    message = _describe_write_error(err, where, latest(os.path.join(run_dir, CHECKPOINT_DIR)))
    return CheckpointError(message.replace("the previous checkpoint", "the latest checkpoint") +
                           "; free space, then run the same command again to continue")


def temporary_dir(root: str, step: int) -> str:
    """Where checkpoint `step` is written before it is renamed into place."""
    return os.path.join(root, f".tmp_{step_dir_name(step)}_{os.getpid()}")


def save(root: str, step: int, files: dict, texts: dict | None = None, keep: int = 2,
         written: tuple[str, dict] | None = None) -> str:
    """Write `files` (name -> object for torch.save, stored as <name>.pt) and `texts` (file name ->
    str) as checkpoint `step` under `root`, atomically, with the manifest last; then point `latest`
    at it and prune the oldest others so that `keep` remain.

    `written`: (temporary directory, {relative path: manifest entry}) of files other writers already
    put there (the shards of a sharded checkpoint, train_utils/sharded_checkpoint.py); they join the
    manifest and the directory is renamed with the rest."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, step_dir_name(step))
    tmp, entries = written if written else (temporary_dir(root, step), {})
    previous = latest(root)
    if not written:
        shutil.rmtree(tmp, ignore_errors=True)
    contents = {f"{name}.pt": obj for name, obj in files.items()} | dict(texts or {})
    path, renamed = tmp, False
    try:
        os.makedirs(tmp, exist_ok=True)
        manifest = {"format": 1, "step": step, "files": dict(entries)}
        for name, obj in contents.items():
            path = os.path.join(tmp, name)
            manifest["files"][name] = _write_file(path, obj)
        path = os.path.join(tmp, MANIFEST)
        _write_file(path, json.dumps(manifest, indent=1) + "\n")
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving the same step (e.g. over a damaged copy of it)
            shutil.rmtree(final)
        os.replace(tmp, final)
        renamed = True
        _fsync_dir(root)
        path = os.path.join(root, LATEST)  # `latest` moves only once the directory it names is complete
        point_latest(root, final)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if renamed:  # complete, but `latest` could not be moved to it: the previous one stays the latest
            shutil.rmtree(final, ignore_errors=True)
        raise CheckpointError(_describe_write_error(err, path.replace(tmp, final), previous)) from err
    # Prune the oldest, but never the checkpoint just written (the one `latest` names), even when
    # the directory also holds higher-numbered ones (a run resumed from an earlier checkpoint), nor
    # the last one from before a loss spike (`last_good`): so `keep` + 1 may remain.
    others = [c for c in list_checkpoints(root) if c != final]
    for old in others[: max(len(others) - (keep - 1), 0)] if keep > 0 else []:
        if old != last_good(root):
            shutil.rmtree(old, ignore_errors=True)
    return final


def point_latest(root: str, ckpt_dir: str, pointer: str = LATEST) -> None:
    """Make `latest` (or another pointer) name `ckpt_dir` (atomically: temp file + rename)."""
    tmp = os.path.join(root, f".{pointer}.tmp_{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(os.path.basename(ckpt_dir) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, pointer))
    _fsync_dir(root)


def last_good(root: str) -> str | None:
    """The checkpoint `last_good` names, if it is still there: the newest one whose next step's loss
    was within the spike factor of the running median (train_utils/divergence.py)."""
    try:
        with open(os.path.join(root, LAST_GOOD)) as f:
            name = f.read(256).strip()
    except (OSError, UnicodeDecodeError):
        return None
    path = os.path.join(root, name)
    return path if _STEP_DIR.match(name) and os.path.isdir(path) else None


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
            if name.startswith((".tmp_", f".{LATEST}.tmp", f".{LAST_GOOD}.tmp")):
                path = os.path.join(root, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)


def _pointer(root: str) -> tuple[str | None, str | None]:
    """The checkpoint `latest` names, and what is wrong with the pointer (None if nothing)."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None, ("the `latest` pointer is missing" if list_checkpoints(root) else None)
    try:
        with open(path, "rb") as f:
            name = f.read(256).decode().strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"the `latest` pointer is unreadable ({err})"
    if not name:
        return None, "the `latest` pointer is empty"
    if not _STEP_DIR.match(name) or not os.path.isdir(os.path.join(root, name)):
        return None, f"the `latest` pointer names {name[:40]!r}, which is not a checkpoint here"
    return os.path.join(root, name), None


def latest(root: str) -> str | None:
    """The checkpoint `latest` names; if the pointer is missing or damaged (e.g. killed between the
    rename and the pointer update) the newest complete directory, which is equally valid.
    Not verified: see `find_intact`."""
    named, _ = _pointer(root)
    if named:
        return named
    found = list_checkpoints(root)
    return found[-1] if found else None


def _outside_entry(ckpt_dir: str, names: list) -> str | None:
    """What is wrong with the first manifest name that does not name a file inside `ckpt_dir` (an
    absolute path, a `..` component, or a path resolving elsewhere), else None. A hand-made manifest
    would otherwise make verification read, and vouch for, any file the process can open."""
    base = os.path.realpath(ckpt_dir)
    own = "a manifest names files of its own checkpoint only: use a checkpoint written by this code"
    for name in names:
        shown = repr(name)[:120]
        if not isinstance(name, str) or not name:
            return f"{MANIFEST} lists an entry {shown} that is not a file name; {own}"
        parts = name.replace("\\", "/").split("/")
        if os.path.isabs(name) or ".." in parts:
            return f"{MANIFEST} lists {shown}, outside the checkpoint directory (an absolute path or `..`); {own}"
        resolved = os.path.realpath(os.path.join(ckpt_dir, name))
        if os.path.commonpath([base, resolved]) != base:
            return f"{MANIFEST} lists {shown}, which resolves to {resolved}, outside the checkpoint directory; {own}"
    return None


def _symlink_in(ckpt_dir: str) -> str | None:
    """The first symbolic link inside the checkpoint (this code never writes one; a link would make
    loading read whatever it points at, verified or not), else None."""
    for folder, dirs, files in os.walk(ckpt_dir):
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            if os.path.islink(path):
                return (f"{os.path.relpath(path, ckpt_dir)} is a symbolic link (to {os.readlink(path)}); a checkpoint "
                        f"holds its own files only: replace the link with the file, or use a checkpoint written by "
                        f"this code")
    return None


def file_entry(path: str) -> dict:
    """A written file's manifest entry, read back: its size and SHA-256."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def verify(ckpt_dir: str) -> str | None:
    """None if every file of the checkpoint matches its manifest, else what is wrong."""
    try:
        with open(os.path.join(ckpt_dir, MANIFEST)) as f:
            manifest = json.load(f)
        entries = manifest["files"].items()
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {err})"
    outside = _symlink_in(ckpt_dir) or _outside_entry(ckpt_dir, [name for name, _ in entries])
    if outside:
        return outside
    for name, entry in entries:
        path = os.path.join(ckpt_dir, name)
        try:
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                return f"{name} has {size} bytes, its manifest says {entry['bytes']} (truncated or overwritten)"
            sha256 = file_entry(path)["sha256"]
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name} is unreadable ({err})"
        if sha256 != entry["sha256"]:
            return f"{name} does not match its checksum (damaged)"
    return None


def find_intact(root: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under `root` that passes `verify` (the one `latest` names first, then
    the others, newest first), and what was passed over: [(path, reason)], path being a checkpoint
    directory or the `latest` pointer itself."""
    named, problem = _pointer(root)
    skipped = [(os.path.join(root, LATEST), problem)] if problem else []
    candidates = ([named] if named else []) + [c for c in reversed(list_checkpoints(root)) if c != named]
    for candidate in candidates:
        reason = verify(candidate)
        if reason is None:
            return candidate, skipped
        skipped.append((candidate, reason))
    return None, skipped


def set_aside(ckpt_dir: str) -> str:
    """Rename a damaged checkpoint out of the way (kept for inspection, never listed or pruned)."""
    target, n = ckpt_dir + DAMAGED_SUFFIX, 1
    while os.path.exists(target):
        n += 1
        target = f"{ckpt_dir}{DAMAGED_SUFFIX}{n}"
    os.replace(ckpt_dir, target)
    return target


def resolve(path: str) -> str | None:
    """A checkpoint directory from a checkpoint dir, a run's `checkpoints/` dir or a run dir (not verified)."""
    if os.path.isfile(os.path.join(path, "trainer.pt")):
        return path
    for root in (path, os.path.join(path, CHECKPOINT_DIR)):
        found = latest(root) if os.path.isdir(root) else None
        if found:
            return found
    return None


def load(ckpt_dir: str, name: str, map_location="cpu"):
    """One file of a checkpoint, memory-mapped: pages are read when copied, not all up front."""
    path = os.path.join(ckpt_dir, f"{name}.pt")
    return torch_load(path, path, map_location=map_location, mmap=True)


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
        # This process's device only: a resume may see another number of GPUs per process (torchrun
        # on 8 visible GPUs, then SLURM binding one GPU to each task), and every rank stores its own.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # older checkpoints: one state per visible GPU
            index = torch.cuda.current_device()
            # the entry of the device this process uses; none for it (fewer GPUs were visible then):
            # the dropout stream seeded at start-up stays
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def nonfinite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """Name the first weight or optimizer-state tensor holding inf/NaN, or None if all are finite.
    One host sync for the common (finite) case. Sharded (FSDP2) tensors: this rank's shards."""
    from frugal.sharding import local

    named = [(f"weight {n}", p) for n, p in model.named_parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        named += [(f"optimizer state {k!r} of {names.get(id(p), 'a parameter')}", t) for k, t in state.items()
                  if torch.is_tensor(t) and t.is_floating_point()]
    named = [(name, local(t).detach()) for name, t in named]
    if not named or bool(torch.stack([t.isfinite().all() for _, t in named]).all()):
        return None
    return next(name for name, t in named if not bool(t.isfinite().all()))
