"""One run per run directory: an exclusive lock held for the run's life (docs/reliability.md).

The main process takes `fcntl.flock(LOCK_EX)` on `<run dir>/run.lock` before anything there is read
or written and writes its pid, host and start time into it; a second writer is refused with one line
naming the holder (RunDirInUse, exit 2). The kernel drops a flock when its process ends, so a lock is
never stale; children forked while it is held close their copy at once (`os.register_at_fork`: a
DataLoader worker outlives a SIGKILLed parent by ~5 s). `EarlyLock`, a Hydra callback, takes it in
`on_run_start`, before Hydra writes `.hydra/`; train()'s `hold` then shares it (one flock per process
and file). A multirun's jobs are not covered (their `.hydra/` comes first). `release` unlocks at once.
On cluster file systems the lock is as good as their flock support (else same-node only).
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

from hydra.experimental.callback import Callback

from train_utils.validation import ConfigError

LOCK_FILE = "run.lock"
_HELD: set[int] = set()  # lock file descriptors this process holds
_OWN: dict[str, list[int]] = {}  # real path of a lock file this process holds -> [descriptor, holders]


def _close_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (closing, not unlocking: an unlock
    would release the parent's lock, which is the same open file)."""
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()
    _OWN.clear()


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
        key = os.path.realpath(self.path)
        if key in _OWN:  # taken earlier by this process (EarlyLock): share it
            _OWN[key][1] += 1
            self.fd = _OWN[key][0]
            return
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
        _OWN[key] = [fd, 1]

    def release(self) -> None:
        if self.fd is not None:
            shared = _OWN.get(os.path.realpath(self.path))
            if shared is not None and shared[0] == self.fd:
                shared[1] -= 1
                if shared[1] > 0:  # another holder in this process still needs it
                    self.fd = None
                    return
                del _OWN[os.path.realpath(self.path)]
            _HELD.discard(self.fd)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def hold(run_dir: str, accelerator) -> RunLock | None:
    """Take the run directory's lock on the main process (collective: every rank raises the same
    RunDirInUse when it is taken). Returns the lock (None on other ranks)."""
    from train_utils.distributed import on_main

    lock = RunLock(run_dir) if accelerator.is_main_process else None
    on_main(accelerator, lambda: lock.acquire(), RunDirInUse)
    return lock


def _launch_rank() -> int:
    """This process's rank before train() sets up the process group: torchrun's RANK, or the task of
    an `srun` step of several tasks (train_utils/slurm.py exports it as RANK later), else 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return 0


class EarlyLock(Callback):
    """A Hydra callback: the run directory's lock, taken before Hydra writes `.hydra/` there."""

    def __init__(self) -> None:
        self.lock: RunLock | None = None

    def on_run_start(self, config, **kwargs) -> None:
        if _launch_rank() != 0:  # rank 0 alone writes the run directory, and locks it
            return
        from omegaconf import OmegaConf

        from train_utils.validation import stop_with_error

        lock = RunLock(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir"))))
        try:
            lock.acquire()
        except RunDirInUse as err:
            stop_with_error(err, 2)  # exits: Hydra writes nothing, train() never runs
        self.lock = lock

    def on_run_end(self, config, **kwargs) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
