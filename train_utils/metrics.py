"""Where the numbers and lines go: `metrics.jsonl` in the run directory (the project's own record,
read by the table and plot scripts), wandb (a view of the same rows), and the console, whose lines
are also kept in `train.log`. Only the main process writes."""
from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import sys
import time

import torch

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"


class Console:
    """The run's console lines: printed (above the progress bar) and appended, time-stamped, to
    <run_dir>/train.log, so a job's log file holds what its console showed. Silent when disabled
    (ranks other than the main process)."""

    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled, self.path = enabled, os.path.join(run_dir, LOG_FILE)

    def __call__(self, text: str = "", error: bool = False, console: bool = True) -> None:
        """Print `text` (stderr if `error`; not at all unless `console`) and append it to train.log."""
        if not self.enabled:
            return
        from tqdm import tqdm

        if console:
            tqdm.write(text, file=sys.stderr if error else sys.stdout)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            with open(self.path, "a") as f:
                f.writelines(f"[{stamp}] {line}\n" for line in (text.strip("\n").splitlines() or [""]))
        except OSError:
            pass  # a full disk must not hide the message itself, which is already on the console


@contextlib.contextmanager
def _named(path: str):
    """A failed write (a full disk) names its file: the OSError of a write or close has no filename."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, path) from err


def _plain(value):
    """JSON-friendly scalars (tensors -> numbers, NaN/inf -> None so every line stays valid JSON)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Append rows to metrics.jsonl and mirror them to wandb (when enabled)."""

    def __init__(self, run_dir: str, enabled: bool, wandb_cfg=None, run_config: dict | None = None,
                 name: str = "run", group: str | None = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.wandb, self.note = None, None  # note: wandb's one console line (where its run is)
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            import wandb  # imported only when used: it is slow to import

            # One wandb run per run directory: a resumed job continues the same run id.
            id_file = os.path.join(run_dir, "wandb_id.txt")
            if os.path.exists(id_file):
                run_id = open(id_file).read().strip()
            else:
                run_id = secrets.token_hex(4)  # os.urandom: leaves the seeded RNGs untouched
                with open(id_file, "w") as f:
                    f.write(run_id)
            # Quiet: wandb's own banner, sync hints and run summary (~34 lines per run) stay out of the
            # console, and it does not capture it (train.log keeps the console); `note` is its one line.
            self.wandb = wandb.init(
                project=wandb_cfg.project, entity=wandb_cfg.entity, name=name, group=group,
                mode=wandb_cfg.mode, dir=run_dir, config=run_config, id=run_id, resume="allow",
                settings=wandb.Settings(silent=True, console="off"),
            )
            sync_dir = os.path.join(run_dir, "wandb", os.path.basename(self.wandb.settings.sync_dir))
            if not os.path.relpath(sync_dir).startswith(".."):
                sync_dir = os.path.relpath(sync_dir)
            self.note = (f"wandb: offline run in {sync_dir}; upload it later with `wandb sync {sync_dir}`"
                         if wandb_cfg.mode == "offline" else f"wandb: {self.wandb.url or self.wandb.name}")

    def truncate_after(self, step: int) -> list[dict]:
        """Drop rows newer than `step` (logged after the checkpoint a run resumes from), the `end` row
        of a run that now continues, and a partial last line, so the file reads as one uninterrupted
        run; step < 0 empties it. Returns the rows kept."""
        if not self.enabled or not os.path.exists(self.path):
            return []
        kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= step and row.get("event") != "end"]
        tmp = self.path + ".tmp"
        with _named(tmp), open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        os.replace(tmp, self.path)
        return kept

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: _plain(v) for k, v in row.items()}
        with _named(self.path), open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            event = row.get("event")
            if event is None:
                self.wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])
            else:  # one-off facts (start, end, switches) go to the run summary, keyed by event
                for k, v in row.items():
                    if k not in ("event", "step") and isinstance(v, (int, float, str)):
                        self.wandb.summary[f"{event}/{k}"] = v

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class MetricsFileError(ValueError):
    """A damaged metrics.jsonl: a line that is not JSON before its last line."""


def read_metrics(path) -> list[dict]:
    """The rows of a metrics.jsonl file. A last line that is not valid JSON (a write cut short by a
    kill or a full disk) is dropped; a bad line anywhere else is an error naming the file and line."""
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break  # the partial last line of an interrupted append
            raise MetricsFileError(f"{path}, line {number} of {len(lines)}: not a JSON row ({err}); only a partial "
                                   f"last line is dropped by itself: fix or delete this line, then run again") from err
    return rows


def plot_losses(metrics_path: str, out_path: str, loss_floor: float | None = None, title: str = "") -> str:
    """Training loss (per logged step) and validation loss (per evaluation) against steps."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r and r["loss"] is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r and r.get("event") is None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), lw=1, alpha=0.8, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    if loss_floor is not None:
        ax.axhline(loss_floor, color="gray", ls="--", label=f"corpus loss floor ({loss_floor:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
