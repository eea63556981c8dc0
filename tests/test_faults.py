"""Failures of whole processes, end to end through the command line: stop signals (during start-up,
to a process group with DataLoader workers), a file-size limit while writing a checkpoint, a frozen
rank, and a torchrun multirun. Each ends with one clear line and the documented exit code."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from _forkserver import run_python
from _train_helpers import (REPO, TINY, assert_same_weights, failure, losses, rows, run_cli,  # noqa: F401
                            run_inprocess, subprocess_env, torchrun_cmd, train_cmd, weights)
from test_slurm import slurm_cluster  # noqa: F401 (the fixture local_slurm asks for)
from ops.fault_inject import catches_signal
from train_utils import checkpoint as ckpt

pytestmark = pytest.mark.slow

# `python tests/_fsize_limit.py BYTES train.py ...`: train.py under a file-size limit, as
# subprocess.run(preexec_fn=<setrlimit>) runs it, but forked from the warm interpreter (run_cli).
FSIZE_LIMIT = os.path.join(REPO, "tests", "_fsize_limit.py")


def limited(limit_bytes: int, cmd: list[str]) -> list[str]:
    """`cmd` (`python script.py args`) under RLIMIT_FSIZE=limit_bytes (Python ignores SIGXFSZ: writes fail)."""
    return [cmd[0], FSIZE_LIMIT, str(limit_bytes), *cmd[1:]]


def _wait_for(predicate, proc, timeout=180.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process ended (code {proc.returncode}) before {what}:\n{err[-3000:]}")
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _steps_logged(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return sum('"loss"' in line for line in open(path).read().splitlines()[:-1])  # the last may be half-written


def test_signal_during_startup_exits_cleanly(tmp_path):
    """SIGTERM while train.py is still importing its libraries: no traceback, no death by signal,
    exit 75 with a message, nothing trained or written (no checkpoint, no metrics)."""
    proc = subprocess.Popen(train_cmd(tmp_path, "train.steps=5"), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: catches_signal(proc.pid, signal.SIGTERM), proc, what="the early signal handler")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped by SIGTERM during start-up, before step 1; nothing new to save" in out
    assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "metrics.jsonl") and not ckpt.list_checkpoints(str(tmp_path / "checkpoints"))


def test_sigterm_to_the_process_group_with_workers(tmp_path):
    """scancel/preemption signal every process of the job, DataLoader workers included: the workers
    keep serving, the main process checkpoints and exits 75, and the resumed run is exact."""
    # the stop lands after step 3, the resume crosses a restart (8); fp32: the precision is not what this is about
    steps, workers = 12, ["data.num_workers=2", "train.precision=fp32"]
    reference = tmp_path / "reference"
    assert run_inprocess(reference, f"train.steps={steps}", *workers) == 0
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(train_cmd(run_dir, f"train.steps={steps}", *workers), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for(lambda: _steps_logged(run_dir) >= 3, proc, what="3 steps")
    os.killpg(proc.pid, signal.SIGTERM)  # the whole process group, as SLURM does
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    stopped = [r for r in rows(run_dir) if r.get("event") == "preempted"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGTERM"
    assert run_inprocess(run_dir, f"train.steps={steps}", *workers) == 0
    assert losses(run_dir) == losses(reference)
    assert_same_weights(weights(ckpt.latest(str(run_dir / "checkpoints"))),
                        weights(ckpt.latest(str(reference / "checkpoints"))))


def test_file_size_limit_while_writing_a_checkpoint(tmp_path):
    """A write that fails mid-checkpoint (here the process's file-size limit, 1 MB, below the size of
    model.pt): one line naming the file, exit 1, no traceback, no half-written checkpoint."""

    proc = run_cli(limited(1 << 20, train_cmd(tmp_path, "train.steps=2")))
    assert proc.returncode == 1, proc.stderr[-3000:]
    failed = tmp_path / "checkpoints" / ckpt.step_dir_name(2) / "model.pt"
    assert proc.stderr.strip().splitlines()[-1] == (f"error: file too large (the file-size limit was reached) while "
                                                    f"writing {failed}; no earlier checkpoint exists")
    assert "Traceback" not in proc.stderr
    assert os.listdir(tmp_path / "checkpoints") == []


def test_frozen_rank_is_named(tmp_path):
    """Rank 1 stops answering (SIGSTOP: alive, frozen) after a few steps: rank 0 gives up after
    train.collective_timeout_s instead of torch's 30 minutes, and says which rank it was."""
    # fp32: not about precision (auto is bf16-mixed where the CPU has it, slower per step here)
    cmd = torchrun_cmd(tmp_path, "train.micro_batch_size=2", "train.steps=500", "train.collective_timeout_s=5",
                       "train.precision=fp32")
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    frozen = None
    try:
        _wait_for(lambda: _steps_logged(tmp_path) >= 3, proc, what="3 steps")
        workers = {int(c.environ().get("RANK", -1)): c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "train.py" in " ".join(c.cmdline())}
        assert sorted(workers) == [0, 1], workers
        frozen = workers[1]
        frozen.send_signal(signal.SIGSTOP)
        workers[0].wait(timeout=180)  # rank 0 must give up by itself
    finally:
        if frozen is not None:
            frozen.kill()  # a stopped process only goes away with SIGKILL
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "[rank 0] a collective operation waited longer than train.collective_timeout_s=5 s" in err, err[-3000:]
    assert "rank 1 did not answer a check" in err, err[-3000:]


def test_torchrun_multirun_is_refused_up_front(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", "-m",
           *TINY, "train.steps=2", "train.seed=0,1", f"hydra.sweep.dir={tmp_path}"]
    proc = run_cli(cmd)
    assert proc.returncode != 0
    assert "would run only its first job" in proc.stderr and "hydra/launcher=local" in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_a_refused_checkpoint_is_one_line_on_the_command_line(tmp_path):
    """A sharded checkpoint whose `.metadata` pickle would create a file: train.py (exit 1) and
    eval.py (exit 2) each end with one line naming the file, no traceback, and the payload never runs."""
    from test_reliability import forge

    run_dir, marker = tmp_path / "run", tmp_path / "PAYLOAD_RAN"
    assert run_inprocess(run_dir, "train.steps=2", "train.parallelism=fsdp") == 0
    carrier = forge(run_dir, "dcp metadata", marker)
    resumed = run_cli(train_cmd(run_dir, "train.steps=3", "train.resume_changes=[train.steps]",
                                "train.parallelism=fsdp"))
    evaluated = run_cli([sys.executable, "eval.py", f"checkpoint={run_dir}"])
    assert not marker.exists(), "the checkpoint's payload ran"
    for proc, code in ((resumed, 1), (evaluated, 2)):
        assert proc.returncode == code, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(f"error: refused to load {carrier}")


def test_one_run_per_run_dir(tmp_path):
    """Two train.py processes on one run dir: the second is refused with one line naming the holder
    (exit 2), before it reads or writes anything there (the holder's .hydra/ files stay byte for
    byte; Hydra used to rewrite them with the second's settings before it was refused); once the
    holder is dead (SIGKILL: its lock dies with it) the same command continues the run, and
    metrics.jsonl holds every step once."""
    import json

    lock_file = tmp_path / "run.lock"
    first = subprocess.Popen(train_cmd(tmp_path, "train.steps=6", "checkpoint.every=1"), cwd=REPO, env=subprocess_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def holds_lock():
        try:
            return json.loads(lock_file.read_text())["pid"] == first.pid and _steps_logged(tmp_path) >= 1
        except (OSError, ValueError, KeyError):
            return False

    _wait_for(holds_lock, first, what="the first run's lock and first step")
    os.killpg(first.pid, signal.SIGSTOP)  # frozen mid-run: it holds the lock for as long as the test needs
    before = {p.name: p.read_bytes() for p in (tmp_path / ".hydra").iterdir()}
    assert set(before) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    try:
        # other settings than the holder's: Hydra rewrote .hydra/ with them before the lock refused it
        second = run_cli(train_cmd(tmp_path, "train.steps=7", "checkpoint.every=1"))
        assert {p.name: p.read_bytes() for p in (tmp_path / ".hydra").iterdir()} == before
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: run dir {tmp_path} is in use by another run (pid {first.pid} on host "), line
        assert "started 20" in line and "use another hydra.run.dir" in line
        assert "is in use by another run" not in (tmp_path / "train.log").read_text()  # the holder's log
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    third = run_cli(train_cmd(tmp_path, "train.steps=6", "checkpoint.every=1"))
    assert third.returncode == 0, failure(third)
    steps = [r["step"] for r in rows(tmp_path) if "loss" in r]
    assert steps == list(range(1, 7))


def test_a_killed_runs_lock_is_free_at_once_though_its_forked_children_live_on(tmp_path):
    """The run's process forks a child (as DataLoader workers are forked) and is SIGKILLed: the
    child, alive, does not keep the run dir locked (it closed its copy of the lock at the fork; the
    code before this kept the lock until the child ended, ~5 s for a worker)."""
    from train_utils.run_lock import RunDirInUse, RunLock

    script = ("import os, sys, time\n"
              f"sys.path.insert(0, {REPO!r})\n"
              "from train_utils.run_lock import RunLock\n"
              "RunLock(sys.argv[1]).acquire()\n"
              "child = os.fork()\n"
              "if child == 0:\n"
              "    time.sleep(120); os._exit(0)\n"
              "print(child, flush=True)\n"
              "time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid} on host"):
            RunLock(str(tmp_path)).acquire()  # held while the run lives
        holder.kill()
        holder.wait()
        assert psutil.pid_exists(child)
        lock = RunLock(str(tmp_path))
        lock.acquire()  # free although the child lives on
        lock.release()
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)


def test_the_stop_handler_is_installed_before_torch_is_imported(tmp_path):
    """train.py's early handler comes before any heavy import: at the moment `torch` is first
    imported, SIGTERM already has a handler (it used to come after torch: 2-10 s of start-up in which
    a stop signal killed the run with -15 and no message). A probe on the import system looks, and
    ends the process there."""
    probe = ("import os, signal, sys, runpy\n"
             "class Probe:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'torch':\n"
             "            caught = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)\n"
             "            print('handler' if caught else 'default', flush=True)\n"
             "            os._exit(0)\n"
             "sys.meta_path.insert(0, Probe())\n"
             f"sys.argv = ['train.py', 'hydra.run.dir={tmp_path}']\n"
             "runpy.run_path('train.py', run_name='__main__')\n")
    proc = run_cli([sys.executable, "-c", probe])
    assert proc.stdout.strip() == "handler", proc.stdout + proc.stderr[-2000:]


def test_sigterm_during_the_interpreters_shutdown_keeps_exit_0(tmp_path):
    """A finished run whose process gets SIGTERM while the interpreter shuts down (after the summary:
    Python has reset its signal handlers to the default there, and tearing down torch takes ~1 s)
    still exits 0. The signal is sent from an object that the shutdown deletes, so it lands there."""
    wrapper = ("import os, signal, sys, time, runpy\n"
               "class Late:\n"
               "    def __del__(self):\n"
               "        os.kill(os.getpid(), signal.SIGTERM)\n"
               "        time.sleep(0.2)\n"
               "late = Late()\n"
               f"sys.argv = ['train.py', *{TINY!r}, 'train.steps=1', 'hydra.run.dir={tmp_path}']\n"
               "runpy.run_path('train.py', run_name='__main__')\n")
    proc = run_cli([sys.executable, "-c", wrapper])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert rows(tmp_path)[-1]["event"] == "end"


def test_full_disk_outside_a_checkpoint_write_is_one_line(tmp_path):
    """A file-size limit (standing in for a full disk) that metrics.jsonl reaches before any
    checkpoint is written, then a restart under the same limit: each ends with one line naming
    metrics.jsonl, exit 1, no traceback (it was a raw OSError traceback)."""

    for attempt in ("first run", "restart"):
        # 6000 bytes: above .hydra's files, below 30 steps of rows
        proc = run_cli(limited(6000, train_cmd(tmp_path, "train.steps=30")))
        assert proc.returncode == 1, (attempt, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (attempt, proc.stderr[-3000:])
        assert proc.stderr.strip().splitlines()[-1] == (
            f"error: file too large (the file-size limit was reached) while writing {tmp_path / 'metrics.jsonl'}; "
            f"no earlier checkpoint exists; free space, then run the same command again to continue"), attempt


def test_a_refused_pt_file_and_a_bad_metrics_line_are_one_line_each(tmp_path):
    """On the command line: a `.pt` file holding a pickled object (exit 1) and a line that is not JSON
    in the middle of metrics.jsonl (exit 1) each end with one line naming the file, no traceback."""
    from test_reliability import forge

    refused, damaged = tmp_path / "refused", tmp_path / "damaged"
    for run_dir in (refused, damaged):
        assert run_inprocess(run_dir, "train.steps=2", "checkpoint.every=1") == 0
    carrier = forge(refused, "plain model.pt", tmp_path / "PAYLOAD_RAN")
    path = damaged / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + ["{not json"] + lines[1:]) + "\n")
    for run_dir, expected in ((refused, f"error: refused to load {carrier}: it holds a reference to "),
                              (damaged, f"error: {path}, line 2 of {len(lines) + 1}: not a JSON row")):
        proc = run_cli(train_cmd(run_dir, "train.steps=3", "checkpoint.every=1", "train.resume_changes=[train.steps]"))
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(expected), proc.stderr[-1000:]
    assert not (tmp_path / "PAYLOAD_RAN").exists()


def forked_fault_run(run_dir: str, *extra: str, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    """ops/fault_inject.py's `run` (the same command, environment, file-size limit and timeout), forked from
    the warm interpreter instead of a fresh one. Its `start` (a run it signals by pid) stays a fresh process."""
    from ops import fault_inject

    cmd = fault_inject.command(run_dir, *extra)
    return run_python(limited(limit_bytes, cmd) if limit_bytes else cmd, cwd=fault_inject.REPO,
                      env=fault_inject.environment(), timeout=600)


@pytest.fixture(scope="module")
def fault_reference(tmp_path_factory):
    """ops/fault_inject.py's uninterrupted reference run."""
    from ops import fault_inject

    reference = str(tmp_path_factory.mktemp("fault_inject") / "reference")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fault_inject, "run", forked_fault_run)
        done = fault_inject.run(reference)
    assert done.returncode == 0, failure(done)
    return reference


@pytest.mark.parametrize("kind", ["dcp", "diverge", "late", "garbage", "badline", "stale", "fullmeta"])
def test_fault_inject_category(fault_reference, tmp_path, kind, monkeypatch):
    """One trial of each of ops/fault_inject.py's categories that have no end-to-end test of their
    own here: a forged sharded `.metadata`, a divergence whose printed remedy is followed, SIGTERM after
    the end row, binary bytes in a text data file, a bad metrics.jsonl line, a stale `latest`, and a
    full disk reached by metrics.jsonl. Each checks the promised end (see the script's docstring)."""
    import random

    from ops import fault_inject

    monkeypatch.setattr(fault_inject, "run", forked_fault_run)
    trial = fault_inject.TRIALS[kind](fault_reference, str(tmp_path / "run"), random.Random(0), None)
    assert trial["ok"], trial


@pytest.fixture
def local_slurm(request):
    """The one-node cluster of test_slurm.py: skipped where Slurm is not installed (never installed
    here), a failure in CI (CI=true), where .ci/run installs it first."""
    return request.getfixturevalue("slurm_cluster")


def test_slurm_requeue_through_submitit_resumes_the_run(local_slurm, tmp_path):
    """A submitit job on the local Slurm gets submitit's preemption signal (SIGUSR2) mid-run: it
    writes a checkpoint, submitit requeues the job, the requeued job resumes from that checkpoint in
    the same run dir, and the sweep ends with every step logged once and the end row."""
    import glob
    import json

    env = dict(local_slurm, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # 15 steps: the stop lands 2 steps after scancel here (step 5), far from the end; fp32: not about precision
    sweep, steps = tmp_path / "multirun", 15
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}",
           "hydra.launcher.gpus_per_node=null", "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1",
           "hydra.launcher.timeout_min=10", "hydra.launcher.signal_delay_s=60", *TINY, f"train.steps={steps}",
           "checkpoint.every=1", "train.precision=fp32"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = sweep / "0"
    _wait_for(lambda: _steps_logged(run_dir) >= 3, launcher, timeout=300, what="3 steps inside the Slurm job")
    (job,) = {os.path.basename(p).split("_")[0] for p in glob.glob(str(sweep / ".submitit" / "*"))
              if os.path.basename(p)[0].isdigit()}
    subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True, timeout=30)
    out, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stopped = [r for r in log if r.get("event") == "preempted"]
    starts = [r for r in log if r.get("event") == "start"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGUSR2", stopped
    assert len(starts) == 2 and starts[1]["resumed_from"].endswith(ckpt.step_dir_name(stopped[0]["step"]))
    assert [r["step"] for r in log if "loss" in r] == list(range(1, steps + 1))
    assert log[-1]["event"] == "end" and log[-1]["step"] == steps
