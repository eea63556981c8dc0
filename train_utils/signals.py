"""Stop signals become a flag that the training loop reads at step boundaries.

SIGTERM (scancel, preemption; DataLoader workers ignore it), SIGUSR1/SIGUSR2 (SLURM's time-limit warning)
and SIGINT (Ctrl-C): the run writes a checkpoint after the current step and exits with 75; a second
Ctrl-C stops at once. `STOP` is the process's one flag: train.py installs it before its heavy imports
(this module imports only `signal`), so a signal during start-up is remembered, and ignores signals
once done (`ignore`). `train.train()` installs it if nobody has and restores the previous handlers.
"""
from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class StopFlag:
    def __reduce__(self):
        # The process's one flag, never a copy: a launcher that pickles train.py's functions by value
        # (submitit's cloudpickle, with the globals they use) must not carry this process's installed
        # flag into the job, where it would look installed and no handler would catch the signals.
        return _process_flag, ()

    def __init__(self):
        self.received: str | None = None
        self.previous: dict | None = None

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C: the user does not want to wait for the step
        self.received = self.received or signal.Signals(signum).name

    def install(self) -> bool:
        """Start catching the stop signals; False (and nothing changes) if already installed."""
        if self.previous is not None:
            return False
        self.received = None
        self.previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return True

    def ignore(self) -> None:
        """Ignore the stop signals from now on: the process's work is done (its exit code decided).
        Python resets the handlers it installed to the default action (death by the signal) when the
        interpreter shuts down, and tearing down torch takes about a second; an ignored signal stays
        ignored, so a SIGTERM in that second no longer turns exit 0 (or 75) into -15."""
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def restore(self) -> None:
        for s, handler in (self.previous or {}).items():
            signal.signal(s, handler)
        self.previous = None


STOP = StopFlag()


def _process_flag() -> StopFlag:
    return STOP
