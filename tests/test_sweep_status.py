"""ops/sweep_status.py: a line per job of a sweep, its state, and an exit code to wait on.

One real toy sweep (2 jobs of train.py, 2 steps each: a few seconds) must come back all done, with
the perplexity of each job's end row, exit 0. The other states are built from copies of its run dirs,
edited the way a run leaves them: a running one (training rows and a live lock of this process), a
failed one (train.py's `error: ...` record in train.log), one whose process died without a record,
one on another host with no progress for hours, one stopped by a signal, one whose exception only
submitit recorded, and a queued job (no run dir).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from _forkserver import run_python
from omegaconf import OmegaConf

from ops import sweep_status
from tests._train_helpers import REPO, rows, run_cli, subprocess_env

TOY = ["model=llama_tiny", "data=synthetic", "data.seq_len=32", "train.steps=2", "train.batch_size=2",
       "train.micro_batch_size=2", "train.eval_every=0", "train.eval_tokens=64", "checkpoint.every=0",
       "train.plot=false", "train.progress_bar=false", "wandb.mode=disabled"]
SWEPT = "optimizer.density=0.125,0.25"
LINE = re.compile(r"^#(\d+)\s+(\S+)\s+(done|running|stopped|queued|stalled|failed)\s+(.*)$")


@pytest.fixture(scope="module")
def toy_sweep(tmp_path_factory) -> Path:
    sweep = tmp_path_factory.mktemp("sweep_status") / "toy"
    proc = run_cli([sys.executable, "train.py", "-m", *TOY, SWEPT, f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


def status(capsys, sweep: Path, *args: str) -> tuple[int, list[str]]:
    code = sweep_status.main([str(sweep), *args])
    return code, capsys.readouterr().out.splitlines()


def parsed(lines: list[str]) -> dict[int, tuple[str, str, str]]:
    """{job number: (swept values, state, details)} of the report's job lines."""
    return {int(m[1]): (m[2], m[3], m[4]) for m in map(LINE.match, lines) if m}


def with_density(override: str, values: str) -> str:
    """`override` with the density's values replaced; its `++` (train.py force-adds such keys) kept."""
    key = override.split("=", 1)[0]
    return f"{key}={values}" if key.lstrip("+") == "optimizer.density" else override


def copy_sweep(toy_sweep: Path, dest: Path, densities: str) -> Path:
    """The toy sweep without its checkpoints, its command line now sweeping `densities`."""
    shutil.copytree(toy_sweep, dest, ignore=shutil.ignore_patterns("checkpoints"))
    master = OmegaConf.load(dest / "multirun.yaml")
    master.hydra.overrides.task = [with_density(o, densities) for o in master.hydra.overrides.task]
    OmegaConf.save(master, dest / "multirun.yaml")
    return dest


def add_job(sweep: Path, num: int, density: str, metrics: list[dict], job_id: str | None = None) -> Path:
    """Job `num`'s run dir as train.py leaves it: job 1's .hydra with this job's number, density and
    100 steps, `metrics` as its metrics.jsonl, and job 1's run.lock (written by a process that has ended)."""
    run = sweep / str(num)
    shutil.copytree(sweep / "1", run, ignore=shutil.ignore_patterns("metrics.jsonl", "train.log"))
    hydra = OmegaConf.load(run / ".hydra" / "hydra.yaml")
    hydra.hydra.job.num, hydra.hydra.job.id = num, job_id or num
    hydra.hydra.overrides.task = [with_density(o, density) for o in hydra.hydra.overrides.task]
    OmegaConf.save(hydra, run / ".hydra" / "hydra.yaml")
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    cfg.train.steps = 100
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return run


def training(sweep: Path, last: int) -> list[dict]:
    """The start row of a real run, then training rows to step `last` at 0.5 s per step."""
    start = rows(sweep / "1")[0]
    return [start, *({"step": s, "loss": 5.0 - s / 100, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s,
                      "step_time_s": 0.5} for s in range(1, last + 1))]


def test_file_names_are_train_pys():
    from train_utils import metrics, run_lock

    assert (sweep_status.METRICS_FILE, sweep_status.LOG_FILE, sweep_status.LOCK_FILE) == \
        (metrics.METRICS_FILE, metrics.LOG_FILE, run_lock.LOCK_FILE)


@pytest.mark.slow
def test_a_finished_toy_sweep_is_all_done(toy_sweep):
    """As a script: each job's line has its end row's numbers; the counts; exit 0."""
    proc = run_python([sys.executable, "-m", "ops.sweep_status", str(toy_sweep)], cwd=REPO, env=subprocess_env(),
                      timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    jobs = parsed(lines)
    assert len(lines) == 3 and sorted(jobs) == [0, 1], lines
    for num, density in enumerate(("0.125", "0.25")):
        end = rows(toy_sweep / str(num))[-1]
        assert end["event"] == "end"
        assert jobs[num] == (f"optimizer.density={density}", "done",
                             f"step 2, validation loss {end['val_loss']:.4f}, perplexity {end['val_ppl']:.3f}")
    assert lines[-1] == f"{toy_sweep}: 2 jobs: 2 done"


@pytest.mark.slow
def test_json_gives_each_runs_own_numbers(toy_sweep, capsys):
    code, lines = status(capsys, toy_sweep, "--json")
    report = json.loads("\n".join(lines))
    assert code == report["exit_code"] == 0 and report["swept"] == ["optimizer.density"]
    assert report["counts"] == {"done": 2, "running": 0, "stopped": 0, "queued": 0, "stalled": 0, "failed": 0}
    for job in report["jobs"]:
        end = rows(toy_sweep / str(job["num"]))[-1]
        assert job["state"] == "done" and job["run_dir"] == str(toy_sweep / str(job["num"]))
        assert (job["step"], job["val_loss"], job["val_ppl"]) == (end["step"], end["val_loss"], end["val_ppl"])
    assert [job["values"] for job in report["jobs"]] == [{"optimizer.density": "0.125"}, {"optimizer.density": "0.25"}]


@pytest.mark.slow
def test_every_state_has_its_line_and_exit_code(toy_sweep, tmp_path, capsys):
    from train_utils.metrics import Console
    from train_utils.report import stopped_message
    from train_utils.run_lock import RunLock

    sweep = copy_sweep(toy_sweep, tmp_path / "sweep", "0.125,0.25,0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    # 2: running (training rows to step 40 of 100, this process holds its lock).
    running = add_job(sweep, 2, "0.3", training(sweep, 40))
    # 3: failed, with the error line train.py writes into train.log.
    failed = add_job(sweep, 3, "0.4", training(sweep, 10))
    error = ("error: non-finite training loss or gradient norm (loss nan, gradient norm 2.5) at step 11; stopped "
             "before applying it. No checkpoint from before the divergence exists.")
    Console(str(failed))(error, error=True, console=False)
    # 4: its process died without a record; an older attempt's error does not count (a start came after it).
    died = add_job(sweep, 4, "0.5", training(sweep, 30))
    Console(str(died))("error: an earlier attempt's", error=True, console=False)
    Console(str(died))(f"run dir {died}", console=False)
    # 5: held on another host, nothing written for two hours.
    stalled = add_job(sweep, 5, "0.6", training(sweep, 10))
    (stalled / "run.lock").write_text(json.dumps({"pid": 1, "host": "another-node", "started": "then"}) + "\n")
    # 6: stopped by a signal after its checkpoint (train.py's preempted row and console line).
    stopped = add_job(sweep, 6, "0.7", [*training(sweep, 20), {"event": "preempted", "step": 20, "signal": "SIGUSR2"}])
    Console(str(stopped))(stopped_message("SIGUSR2", 20, str(stopped / "checkpoints"), str(stopped)), console=False)
    # 7: queued (no run dir). 8: an exception only submitit recorded (its result file, its log of stderr).
    crashed = add_job(sweep, 8, "0.9", training(sweep, 5), job_id="4242")
    folder = sweep / ".submitit" / "4242"
    folder.mkdir(parents=True)
    (folder / "4242_0_result.pkl").write_bytes(pickle.dumps(
        ("error", "Traceback (most recent call last):\n  File ...\nRuntimeError: boom")))
    (folder / "4242_0_log.err").write_text("Traceback (most recent call last):\n")
    two_hours_ago = time.time() - 7200
    for path in [*stalled.rglob("*"), stalled]:
        os.utime(path, (two_hours_ago, two_hours_ago))
    lock = RunLock(str(running))
    lock.acquire()
    try:
        code, lines = status(capsys, sweep)
        jobs = parsed(lines)
        assert code == 3, lines
        assert jobs[2] == ("optimizer.density=0.3", "running", "step 40/100, loss 4.6000, ETA 30 s (0.50 s/step)")
        assert jobs[3] == ("optimizer.density=0.4", "failed",
                           f"step 10/100: {error}; full log: {failed / 'train.log'}")
        assert jobs[4][1] == "failed" and re.fullmatch(
            r"step 30/100: ended without a record \(its process \d+ (is gone|no longer holds the run)\); full log: "
            + re.escape(str(died / "train.log")), jobs[4][2]), jobs[4]
        assert jobs[5] == ("optimizer.density=0.6", "stalled",
                           "step 10/100, no progress for 2.0 h (its process on another-node cannot be seen from "
                           f"here); log: {stalled / 'train.log'}")
        assert jobs[6] == ("optimizer.density=0.7", "stopped", "stopped by SIGUSR2 at step 20 (of 100); continues "
                           "when its job is requeued or the sweep reruns")
        assert jobs[7] == ("optimizer.density=0.8", "queued", "no run output yet")
        assert jobs[8] == ("optimizer.density=0.9", "failed",
                           f"step 5/100: RuntimeError: boom; full log: {folder / '4242_0_log.err'}")
        assert [jobs[n][1] for n in (0, 1)] == ["done", "done"]
        assert lines[-1] == f"{sweep}: 9 jobs: 2 done, 1 running, 1 stopped, 1 queued, 1 stalled, 3 failed"

        # A live process with no progress for longer than --stale-after is a hang: stalled too.
        code, lines = status(capsys, sweep, "--stale-after", "0")
        state, text = parsed(lines)[2][1:]
        assert code == 3 and state == "stalled" and re.fullmatch(
            rf"step 40/100, no progress for \d+ s \(its process {os.getpid()} is alive\); log: "
            + re.escape(str(running / "train.log")), text), lines

        # Without the failed and stalled ones (their run dirs gone: queued again) the sweep is unfinished: 1.
        for run in (failed, died, stalled, crashed):
            shutil.rmtree(run)
        code, lines = status(capsys, sweep)
        assert code == 1 and lines[-1] == f"{sweep}: 9 jobs: 2 done, 1 running, 1 stopped, 5 queued", lines
        assert parsed(lines)[3] == ("optimizer.density=0.4", "queued", "no run output yet")
    finally:
        lock.release()


@pytest.mark.slow
def test_a_basic_sweeps_queued_jobs_without_its_process(toy_sweep, tmp_path, capsys):
    """Hydra's basic launcher runs the jobs in the sweep's own process: with that process gone (the
    pid in the last job's lock), the jobs still queued never start, and the report says how to go on."""
    sweep = copy_sweep(toy_sweep, tmp_path / "sweep", "0.125,0.25,0.5")
    code, lines = status(capsys, sweep)
    assert code == 1 and parsed(lines)[2] == ("optimizer.density=0.5", "queued", "no run output yet")
    assert lines[-2] == f"{sweep}: 3 jobs: 2 done, 1 queued"
    assert lines[-1].startswith("note: the sweep's process (pid ") and lines[-1].endswith(
        f"is gone, so its queued jobs will not start: rerun the same -m command with hydra.sweep.dir="
        f"{sweep.resolve()} (finished jobs end at once)")


@pytest.mark.slow
def test_not_a_sweep_is_one_line_and_exit_2(toy_sweep, tmp_path, capsys):
    for path, says in ((tmp_path / "missing", "no such directory"),
                       (toy_sweep / "0", "is a single run's directory, not a sweep (no multirun.yaml)"),
                       (toy_sweep.parent, f"no multirun.yaml (Hydra writes it in hydra.sweep.dir when a -m run "
                                          f"starts); it holds 1 sweep dir, the newest {toy_sweep}")):
        assert sweep_status.main([str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"error: {path}") and says in err, err
