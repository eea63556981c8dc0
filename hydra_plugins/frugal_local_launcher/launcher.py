"""hydra/launcher=local with a console: where each job runs, and each job's result as it ends.

hydra-submitit-launcher's `submitit_local` starts every job at once and sends their output to
submitit's log files (`<sweep dir>/.submitit/<job id>/`) without a word. `LocalLauncher`
(configs/hydra/launcher/local.yaml's `_target_`) adds, in the launching process: before the jobs
start, a line per job (its run dir, `tail -F` on its train.log); as each job's first task ends (its
result file, looked for every second), its steps, validation loss and time, or its error and where
its full output is. The jobs themselves are unchanged (`super().launch`). Hydra imports this module
whenever it scans its plugins: it imports neither torch nor the repository's packages.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Callable, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)
POLL_S = 1.0


def end_summary(run_dir: str) -> str:
    """`N steps, validation loss L (perplexity P), T s of training` from the end row of the run's
    metrics.jsonl (train.py's)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            end = next((json.loads(line) for line in reversed(f.readlines()) if '"event": "end"' in line), None)
    except (OSError, ValueError):
        end = None
    if end is None:
        return "no end row in its metrics.jsonl"
    return (f"{end['step']} steps, validation loss {end['val_loss']:.4f} (perplexity {end['val_ppl']:.3f}), "
            f"{end['seconds']:.0f} s of training")


def _name(num: int | None, job_id: str) -> str:
    return f"#{num}" if num is not None else f"job {job_id}"


class JobWatch:
    """Reports each job of a sweep once, when submitit's result file of its first task appears."""

    def __init__(self, submitit_folder: str, run_dirs: dict[int, str], say: Callable[[str], None]):
        from submitit.core.utils import JobPaths

        self.pattern = str(JobPaths(submitit_folder, "*", 0).result_pickle)
        self.run_dirs, self.say = run_dirs, say
        self.seen = set(glob.glob(self.pattern))  # a rerun's sweep dir holds the last run's results
        self.reported: set[int | None] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="local-launcher-watch", daemon=True)

    def poll(self) -> None:
        for path in sorted(set(glob.glob(self.pattern)) - self.seen):
            self.seen.add(path)
            num, line = self.describe(path)
            self.reported.add(num)
            self.say(line)

    def _num_of(self, job_id: str) -> int | None:
        """The sweep's number of submitit job `job_id`, from the Hydra config its run dir keeps."""
        for num, run_dir in self.run_dirs.items():
            saved = os.path.join(run_dir, ".hydra", "hydra.yaml")
            if num not in self.reported and os.path.isfile(saved):
                job = OmegaConf.select(OmegaConf.load(saved), "hydra.job", default=None)
                if job is not None and str(job.get("id")) == job_id:
                    return num
        return None

    def describe(self, result_pickle: str) -> tuple[int | None, str]:
        """(the job's number in the sweep if known, its one line) from submitit's result file."""
        folder = os.path.dirname(result_pickle)
        job_id = os.path.basename(result_pickle).removesuffix("_0_result.pkl")
        output = os.path.join(folder, f"{job_id}_0_log.err")
        try:
            with open(result_pickle, "rb") as f:
                outcome, value = pickle.load(f)
        except Exception as err:  # unreadable: still say where to look
            num = self._num_of(job_id)
            return num, f"{_name(num, job_id)} ended; its result could not be read ({err}); its output: {output}"
        if outcome != "success" or not isinstance(value, JobReturn):  # died outside Hydra's job runner
            last = str(value).strip().splitlines()[-1:] or ["?"]
            num = self._num_of(job_id)
            return num, f"{_name(num, job_id)} failed: {last[0]}; its full output: {output}"
        num = value.hydra_cfg.hydra.job.num if value.hydra_cfg is not None else None
        run_dir = self.run_dirs.get(num, value.working_dir)
        if value.status == JobStatus.COMPLETED:
            return num, f"#{num} done: {end_summary(run_dir)}; run dir {run_dir}"
        err = value._return_value  # the job's exception (JobReturn.return_value would re-raise it)
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not text.startswith("error:"):
            text = f"{type(err).__name__}: {text}"
        return num, f"#{num} failed: {text}; its full output: {output}"

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.poll()  # the jobs that ended since the last look, before Hydra's own closing lines
        for num, run_dir in self.run_dirs.items():  # e.g. ended by a signal (sys.exit) or killed: no result file
            if num not in self.reported:
                self.say(f"#{num}: no result (stopped, killed or still running); its log: "
                         f"{os.path.join(run_dir, 'train.log')}")


class LocalLauncher(submitit_launcher.LocalLauncher):
    """hydra-submitit-launcher's local launcher, saying where each job runs and how each one ended."""

    def run_dir(self, overrides: Sequence[str], num: int) -> str:
        """Job `num`'s run dir, composed as the job composes it (the sweep dir and subdir)."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
        return str(Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        run_dirs = {initial_job_idx + i: self.run_dir(o, initial_job_idx + i) for i, o in enumerate(job_overrides)}
        for num, run_dir in run_dirs.items():
            log.info(f"#{num} runs in {run_dir}; follow it with: tail -F {os.path.join(run_dir, 'train.log')}")
        folder = self.params["submitit_folder"]
        log.info(f"each job's full output (tracebacks too): {folder.replace('%j', '<job id>')}/; "
                 f"a line per job follows as it ends")
        with JobWatch(folder, run_dirs, log.info):
            return super().launch(job_overrides, initial_job_idx)
