"""One run per run directory: an exclusive lock held for the run's life.

Two `train.py` processes writing one run directory (a second launch, or the ranks a killed
torchrun left running) would interleave `metrics.jsonl` rows and replace each other's checkpoints.
The main process (rank 0: the one that writes the run directory; other ranks write sharded
checkpoint files only into the temporary directory rank 0 creates) takes `fcntl.flock(LOCK_EX)` on
`<run dir>/run.lock` before anything in the directory is read or written, and writes who holds it
(pid, host, start time) into the file. A second writer is refused with one line naming the holder
(RunDirInUse, exit 2).

The kernel releases a flock when its process ends, however it ends (SIGKILL, OOM kill, a crash), so
a lock is never stale: the file a dead run leaves behind is taken over by the next run. The lock
belongs to the open file, which a forked child would share and keep locked after the run died (a
DataLoader worker lives ~5 s past a SIGKILLed parent): every child forked while the lock is held
closes its copy at once (`os.register_at_fork`), so the run's own process alone holds it. `release`
unlocks explicitly, so a run that returns (an in-process caller) frees the directory at once. On a
cluster file system, flock works across nodes where the file system supports it (NFSv4, Lustre
with `flock` mounted, GPFS); where it does not, the lock protects against a second run on the same
node only.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

from train_utils.validation import ConfigError

LOCK_FILE = "run.lock"
_HELD: set[int] = set()  # lock file descriptors this process holds


def _close_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (closing, not unlocking: an unlock
    would release the parent's lock, which is the same open file)."""
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class RunDirInUse(ConfigError):
    """Another live process holds this run directory's lock."""


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


class RunLock:
    """The run directory's lock, held by this process until `release` or the process's end."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirInUse(f"run dir {os.path.dirname(self.path)} is in use by another run ({holder}; lock "
                              f"{self.path}); wait for it to end or stop it, or use another hydra.run.dir") from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        self.fd = fd
        _HELD.add(fd)

    def release(self) -> None:
        if self.fd is not None:
            _HELD.discard(self.fd)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def hold(run_dir: str, accelerator) -> RunLock | None:
    """Take the run directory's lock on the main process (collective: every rank raises the same
    RunDirInUse when it is taken). Returns the lock (None on other ranks)."""
    from accelerate.utils import broadcast_object_list

    lock, error = None, None
    if accelerator.is_main_process:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunDirInUse as err:
            lock, error = None, str(err)
    error = broadcast_object_list([error])[0]
    if error is not None:
        raise RunDirInUse(error)
    return lock
