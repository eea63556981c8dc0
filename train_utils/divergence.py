"""Divergence: which checkpoint is from before the loss blew up, kept, and named when the run stops.

A non-finite loss ends a divergence that began steps earlier with finite, huge losses, and the
(finite) checkpoints between are useless. A checkpoint is judged by the next step's loss: healthy when
finite and at most SPIKE_FACTOR x the median of the last WINDOW healthy losses (spikes stay out of the
window). Then it becomes `last_good` (checkpoint.LAST_GOOD, never rotated away: `keep` + 1 may remain).
The window starts empty; a run resumed from its own checkpoint rebuilds it on the main process from
metrics.jsonl's training losses up to that step (exact with train.log_every=1). On a non-finite loss
or gradient norm the message names `last_good`, the step of the first spike, and a command continuing
from there with a lower learning rate, or how to start over (docs/reliability.md).
"""
from __future__ import annotations

import math
import os
import re
import statistics
from collections import deque

from omegaconf import OmegaConf

from train_utils import checkpoint as ckpt
from train_utils.loop import NonFiniteError
from train_utils.metrics import METRICS_FILE, read_metrics

SPIKE_FACTOR = 3.0
WINDOW = 100


def suggested_lr(current: float, optimizer_name: str, good_dir: str | None) -> float:
    """A learning rate to retry with: the one `good_dir` was trained with if lower than the current,
    else the optimizer's registry default if lower, else a tenth of the current one."""
    if good_dir:
        try:
            trained = float(OmegaConf.load(os.path.join(good_dir, "config.yaml")).optimizer.lr)
            if trained < current:
                return trained
        except Exception:  # noqa: BLE001 - a suggestion only: fall through to the others
            pass
    try:
        from frugal import registry

        default = float(registry.defaults(optimizer_name)["lr"])
        if default < current:
            return default
    except Exception:  # noqa: BLE001
        pass
    return current / 10


class LossWatch:
    """Follows the training loss to confirm checkpoints (`last_good`) and to word the stop on a
    non-finite loss. `check` every step before the update, `saved` after every checkpoint."""

    def __init__(self, ckpt_root: str, is_main: bool, cfg, resumed_from: str | None):
        self.root, self.is_main, self.cfg = ckpt_root, is_main, cfg
        self.losses: deque[float] = deque(maxlen=WINDOW)
        # The checkpoint whose weights the next loss is computed with; a resume from another run's
        # checkpoint (train.resume=<elsewhere>) has none of this run's to confirm.
        inside = resumed_from and os.path.dirname(os.path.abspath(resumed_from)) == os.path.abspath(ckpt_root)
        self.pending = resumed_from if inside else None
        self.spike: tuple[int, float, float] | None = None  # (step, loss, median) of the first spike
        numbered = re.match(r"^step_(\d+)$", os.path.basename(os.path.normpath(resumed_from or "")))
        if inside and is_main and numbered:
            run_dir = os.path.dirname(os.path.abspath(ckpt_root))
            self._replay(os.path.join(run_dir, METRICS_FILE), int(numbered.group(1)))

    def _replay(self, metrics_path: str, step: int) -> None:
        """Judge the losses the run logged up to `step` as `check` did (a missing or unreadable
        file leaves the window empty: a resume never fails over a heuristic)."""
        try:
            rows = read_metrics(metrics_path)
        except (OSError, ValueError):
            return
        for row in rows:
            loss = row.get("loss")
            if (row.get("event") is None and isinstance(row.get("step"), int) and row["step"] <= step
                    and isinstance(loss, (int, float)) and not isinstance(loss, bool)):
                self._judge(row["step"], float(loss))

    def _judge(self, step: int, loss: float) -> bool:
        """Whether a finite loss is healthy; a healthy one enters the window, the first unhealthy one
        of a run of them is remembered as where the spike began."""
        median = statistics.median(self.losses) if self.losses else None
        if median is None or loss <= SPIKE_FACTOR * median:
            self.losses.append(loss)
            self.spike = None
            return True
        if self.spike is None:
            self.spike = (step, loss, median)
        return False

    def saved(self, ckpt_dir: str | None) -> None:
        self.pending = ckpt_dir

    def check(self, step: int, loss: float, grad_norm: float, moved: int = 0) -> None:
        """Judge step `step`'s loss (computed with the current weights); raise NonFiniteError if it
        or the gradient norm is not finite. `moved`: tensors that already took step `step` (the step
        inside backward, frugal.in_backward), which the message then names."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite and self._judge(step, loss):
            if self.pending and self.is_main:
                ckpt.point_latest(self.root, self.pending, pointer=ckpt.LAST_GOOD)
            self.pending = None
            return
        self.pending = None  # its weights gave a spike (or worse): never `last_good`
        if self.spike is None:  # non-finite with no spike before it (_judge records a finite spike)
            self.spike = (step, loss, statistics.median(self.losses) if self.losses else float("nan"))
        if not finite:
            raise NonFiniteError(self.message(step, loss, grad_norm, moved))

    def message(self, step: int, loss: float, grad_norm: float, moved: int = 0) -> str:
        good = ckpt.last_good(self.root)
        first, spiked, median = self.spike
        began = ("" if first == step else
                 f" The loss first spiked at step {first} ({spiked:.4g}, over {SPIKE_FACTOR:g}x the running median "
                 f"{median:.4g}).")
        lr = suggested_lr(float(self.cfg.optimizer.lr), str(self.cfg.optimizer.name), good)
        stopped = ("stopped before applying it." if not moved else
                   f"stopped before applying the rest of it: with the step inside backward, {moved} tensors had "
                   f"already taken it before the non-finite gradient came, so the weights in memory mix two steps; "
                   f"nothing was saved from them.")
        head = (f"non-finite training loss or gradient norm (loss {loss}, gradient norm {grad_norm}) at step {step}; "
                f"{stopped}{began}")
        if good is None:
            return (f"{head} No checkpoint from before the divergence exists. Start over in a new run dir with a "
                    f"lower learning rate: the same command with hydra.run.dir=<new dir> optimizer.lr={lr:g} "
                    f"(or also train.grad_clip=1.0, or train.precision=fp32).")
        named = list(self.cfg.train.resume_changes or [])
        changes = ",".join(named + [k for k in ("optimizer.lr",) if k not in named])
        return (f"{head} Last checkpoint from before the divergence: {good} (kept; later checkpoints hold diverging "
                f"weights). To continue from it with a lower learning rate, run the same command with "
                f"train.resume={good} optimizer.lr={lr:g} train.resume_changes=[{changes}] (train.grad_clip=1.0 "
                f"or train.precision=fp32 may help too; name them in train.resume_changes as well).")
