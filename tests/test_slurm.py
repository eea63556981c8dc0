"""The real SLURM launch path: a one-node cluster on this machine, a 2-task job through Hydra's submitit
launcher (`hydra/launcher=slurm`), both DDP ranks training llama_tiny on CPU. Also without a cluster: the
local launcher's own example (2 processes), its one-line report of a job's error, the lines it prints
on the sweep's console (each job's run dir, then its result as it ends), and the node size
ops/slurm_localhost.sh writes.

Needs root and Slurm's daemons, installed beforehand (`sudo ops/slurm_localhost.sh install`: `.ci/run`
does it in its own step; a test never installs anything): ops/slurm_localhost.sh brings the cluster
up in a temporary directory on free ports and tears it down afterwards. With CI=true the test must run,
and fails loudly when it cannot; elsewhere it is skipped with the reason (and the install command).
Takes ~20-60 s (two train.py processes start inside the job).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _forkserver import run_python
from _train_helpers import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ops" / "slurm_localhost.sh"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
LOCAL_LAUNCHER = ROOT / "configs" / "hydra" / "launcher" / "local.yaml"
TOY = ["model=llama_tiny", "data=synthetic", "train.steps=2", "train.eval_every=0", "train.eval_tokens=256",
       "data.seq_len=32", "checkpoint.every=0", "train.plot=false", "train.progress_bar=false", "wandb.mode=disabled",
       "train.precision=fp32"]  # fp32: what these tests check is not the precision


def _env() -> dict:
    env = dict(subprocess_env(), WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_node_gets_the_real_cpu_count_whatever_omp_num_threads(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "conf", str(tmp_path)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cpus = int(re.search(r"CPUs=(\d+)", (tmp_path / "slurm.conf").read_text()).group(1))
    assert cpus == len(os.sched_getaffinity(0))


def _local_example() -> list[str]:
    """The command in configs/hydra/launcher/local.yaml's comment."""
    (line,) = [ln.lstrip("# ").strip() for ln in LOCAL_LAUNCHER.read_text().splitlines() if "python train.py" in ln]
    return line.split()[2:]  # after `python train.py`


@pytest.mark.slow
def test_local_launchers_own_example_runs(tmp_path):
    sweep = tmp_path / "multirun"
    cmd = [sys.executable, "train.py", *_local_example(), *TOY, f"hydra.sweep.dir={sweep}"]
    # the sweep's own process forked from a warm interpreter (tests/_forkserver.py); its job's 2 processes are
    # submitit's own fresh interpreters
    proc = run_python(cmd, cwd=ROOT, env=_env(), timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["world_size"] == 2 and rows[-1]["event"] == "end"
    # The sweep's console says its job was checked before it started (train_utils/sweep_check.py), where
    # the job runs and how to follow it, then how it ended.
    assert "Checked 1 job config before starting any (1 with the memory check)" in proc.stdout, proc.stdout[-3000:]
    assert f"#0 runs in {sweep / '0'}; follow it with: tail -F {sweep / '0' / 'train.log'}" in proc.stdout
    assert (f"#0 done: 2 steps, validation loss {rows[-1]['val_loss']:.4f} (perplexity {rows[-1]['val_ppl']:.3f})"
            in proc.stdout), proc.stdout[-3000:]


@pytest.mark.slow
def test_a_failing_jobs_own_error_is_the_last_line(tmp_path):
    """The example with a data path that does not exist: an error the job meets itself (the sweep's
    check before the first job reads no data; a bad value, such as a micro-batch that does not fit the
    processes, stops the sweep before any job: tests/test_sweep_check.py). The sweep ends with the
    job's one clear line, not submitit's traceback of the job runner."""
    nowhere = tmp_path / "nowhere"
    cmd = [sys.executable, "train.py", *_local_example(), *[o for o in TOY if o != "data=synthetic"], "data=local",
           f"data.path={nowhere}", f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    proc = run_python(cmd, cwd=ROOT, env=_env(), timeout=300)  # forked, as above
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    error = f"error: data.path={str(nowhere)!r} does not exist"
    # Hydra's own closing hint follows the job's line.
    assert lines[-1].startswith("Set the environment variable HYDRA_FULL_ERROR=1"), proc.stderr[-3000:]
    assert lines[-2].startswith(error), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"#0 failed: {error}" in proc.stdout, proc.stdout


def test_local_launcher_reports_each_job_once_as_it_ends(tmp_path):
    """The local launcher's watch on submitit's result files (what the two tests above see through a
    real sweep): a finished job's summary from its end row, a failed job's own error line, a job that
    died outside Hydra's runner by its traceback's last line; results already there before are not news."""
    import pickle

    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from hydra_plugins.frugal_local_launcher.launcher import JobWatch
    from train_utils.validation import JobError

    folder = tmp_path / ".submitit" / "%j"

    def result(job_id: str, value, outcome="success"):  # written whole and renamed, as submitit does
        path = tmp_path / ".submitit" / job_id / f"{job_id}_0_result.pkl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".save_tmp").write_bytes(pickle.dumps((outcome, value)))
        path.with_suffix(".save_tmp").rename(path)

    def job(num: int, status, value=None):
        return JobReturn(status=status, _return_value=value, working_dir=str(tmp_path / str(num)),
                         hydra_cfg=OmegaConf.create({"hydra": {"job": {"num": num}}}))

    result("100", job(0, JobStatus.COMPLETED))  # a previous launch's, in the same sweep dir
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "metrics.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n" + json.dumps(
        {"event": "end", "step": 300, "val_loss": 4.56789, "val_ppl": 96.3, "seconds": 61.2}) + "\n")
    (tmp_path / "2" / ".hydra").mkdir(parents=True)  # job 2's config names its submitit job id
    (tmp_path / "2" / ".hydra" / "hydra.yaml").write_text("hydra:\n  job:\n    id: '203'\n    num: 2\n")
    said = []
    run_dirs = {n: str(tmp_path / str(n)) for n in range(5)}
    with JobWatch(str(folder), run_dirs, said.append) as watch:
        result("201", job(0, JobStatus.COMPLETED))
        result("202", job(1, JobStatus.FAILED, JobError("error: train.steps=0 is invalid\nmore")))
        result("203", "Traceback (most recent call last):\n  ...\nMemoryError: out of memory", outcome="error")
        result("204", "Traceback (most recent call last):\n  ...\nRuntimeError: boom", outcome="error")
    err = tmp_path / ".submitit"
    assert said == [
        f"#0 done: 300 steps, validation loss 4.5679 (perplexity 96.300), 61 s of training; run dir {tmp_path / '0'}",
        f"#1 failed: error: train.steps=0 is invalid; its full output: {err / '202' / '202_0_log.err'}",
        f"#2 failed: MemoryError: out of memory; its full output: {err / '203' / '203_0_log.err'}",
        f"job 204 failed: RuntimeError: boom; its full output: {err / '204' / '204_0_log.err'}",
        f"#3: no result (stopped, killed or still running); its log: {tmp_path / '3' / 'train.log'}",
        f"#4: no result (stopped, killed or still running); its log: {tmp_path / '4' / 'train.log'}"]
    watch.poll()  # nothing new
    assert len(said) == 6


INSTALL = "sudo ops/slurm_localhost.sh install"


def _slurm_installed() -> bool:
    return all(shutil.which(d) or os.path.exists(f"/usr/sbin/{d}") for d in ("slurmctld", "slurmd", "munged"))


def _unavailable() -> str | None:
    """Why the one-node cluster cannot run here, or None. Never installs anything."""
    if not _slurm_installed():
        return f"Slurm is not installed (optional set-up for this test: {INSTALL})"
    if os.geteuid() != 0:
        return "needs root to start munged/slurmctld/slurmd"
    return None


def test_no_test_installs_slurm():
    """The test suite never changes the machine: the install is a separate, documented step."""
    for path in (ROOT / "tests").glob("test_*.py"):
        text = path.read_text()
        for needle in ('"install"' + "]", '"apt' + '-get"', "apt" + "-get install"):  # split: this file holds no needle
            assert needle not in text, (path, needle)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "slurm_localhost.sh install" in ci and INSTALL in (ROOT / "README.md").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm_cluster(tmp_path):
    reason = _unavailable()
    if reason:
        if IN_CI:
            pytest.fail(f"CI=true but the SLURM launch test cannot run: {reason}")
        pytest.skip(reason)
    state = tmp_path / "slurm"
    ports = {"SLURM_LOCAL_CTLD_PORT": str(_free_port()), "SLURM_LOCAL_SLURMD_PORT": str(_free_port())}
    env = {**os.environ, **ports}
    up = subprocess.run(["bash", str(SCRIPT), "up", str(state)], env=env, capture_output=True, text=True,
                        timeout=120)
    try:
        assert up.returncode == 0, f"cluster did not come up:\n{up.stdout}\n{up.stderr}"
        env["SLURM_CONF"] = str(state / "slurm.conf")
        env["PATH"] = f"{state / 'bin'}:{env['PATH']}"  # the sacct stand-in (no accounting database)
        yield env
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(state)], env=env, capture_output=True, timeout=60)


@pytest.mark.slow  # a real Slurm job (seconds of scheduling): the full suite's
def test_a_bad_sweep_submits_nothing(slurm_cluster, tmp_path):
    """A bad value in the sweep's second job: the sweep stops before submitting anything (no sweep dir,
    so no `.submitit` job dirs; the cluster has no job), with that job's one line and exit code 2."""
    env = dict(slurm_cluster, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    sweep = tmp_path / "multirun"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
           "hydra.launcher.gpus_per_node=null", "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1",
           "hydra.launcher.timeout_min=5", *TOY, "optimizer.density=0.25,1.5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sweep not started: job #1 (model=llama_tiny ") and last.endswith(
        "optimizer.density=1.5): Invalid density: 1.5 (expected a number in [0, 1])"), proc.stderr[-3000:]
    assert not sweep.exists() and "Submitit" not in proc.stdout, proc.stdout[-3000:]
    jobs = subprocess.run(["scontrol", "show", "jobs"], env=env, capture_output=True, text=True, timeout=30)
    assert "No jobs in the system" in jobs.stdout + jobs.stderr, jobs.stdout + jobs.stderr


@pytest.mark.slow  # a real Slurm job (seconds of scheduling): the full suite's
def test_two_task_job_through_submitit_launcher(slurm_cluster, tmp_path):
    env = dict(slurm_cluster)
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    sweep = tmp_path / "multirun"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
           "hydra.launcher.gpus_per_node=null", "hydra.launcher.tasks_per_node=2",
           "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=5",
           # the time-limit warning (default 300 s before the end) must not fall inside a 5-minute limit
           "hydra.launcher.signal_delay_s=60",
           "model=llama_tiny", "data=synthetic", "optimizer=frugal", "train.precision=fp32", "train.steps=3",
           "train.batch_size=4", "train.micro_batch_size=2", "train.eval_every=0", "train.eval_tokens=256",
           "data.seq_len=32", "checkpoint.every=0", "train.plot=false", "train.progress_bar=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    logs = "".join(Path(p).read_text(errors="replace")[-3000:] + f"\n[{p}]\n"
                   for p in sorted(glob.glob(str(sweep / ".submitit" / "*" / "*_log.*"))))
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"

    # both ranks ran: submitit writes one log per task (<job>_<array idx>_<task>_log.out)
    task_logs = sorted(glob.glob(str(sweep / ".submitit" / "*" / "*_log.out")))
    assert {Path(p).name.rsplit("_", 2)[-2] for p in task_logs} == {"0", "1"}, task_logs
    assert glob.glob(str(sweep / ".submitit" / "*" / "*_0_result.pkl")), "task 0 wrote no result"

    # the job finished (the scheduler says so) and training wrote its metrics as one 2-rank DDP run
    job_ids = {Path(p).parent.name for p in task_logs}
    for job in job_ids:
        # the launcher returns as soon as task 0's result exists; the job ends a moment later
        for _ in range(60):
            info = subprocess.run(["scontrol", "show", "job", "-o", job.split("_")[0]], env=env,
                                  capture_output=True, text=True).stdout
            if "JobState=RUNNING" not in info and "JobState=COMPLETING" not in info:
                break
            time.sleep(0.5)
        assert "JobState=COMPLETED" in info, info
    rows = [json.loads(line) for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    start, end = rows[0], rows[-1]
    assert start["event"] == "start", start
    assert start["world_size"] == 2, (
        f"the 2 SLURM tasks trained as separate single-process runs ({start}): train.py must call "
        "train_utils.slurm.export_distributed_env() before creating the Accelerator")
    assert end["event"] == "end" and end["step"] == 3, end
    print(f"SLURM job(s) {sorted(job_ids)}: 2 tasks, world_size={start['world_size']}, "
          f"val_ppl={end['val_ppl']:.2f}, tasks logs={len(task_logs)}")
