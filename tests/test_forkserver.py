"""tests/_forkserver.py: a `python script.py` or `python -m scripts.name` command forked from a warm server
gives what `subprocess.run` gives for the same command in a fresh interpreter (exit code, stdout, stderr, argv,
cwd, environment, sys.path[0], atexit, signals, timeouts), and it does start from the server's imports; a plain
`torchrun --standalone --nproc_per_node=2` launch forked gives what torchrun gives (exit status, the ranks' output
and environment, its failure summary; a DDP run bitwise)."""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import _forkserver

SCRIPT = textwrap.dedent("""
    import atexit, faulthandler, json, os, sys
    warm = "fractions" in sys.modules  # preloaded by the test's server, not imported by a fresh interpreter
    atexit.register(lambda: print("atexit ran", file=sys.stderr))
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "warm": warm,
                      "marker": os.environ.get("FORK_TEST_MARKER"), "gone": os.environ.get("FORK_TEST_GONE"),
                      "stdin": sys.stdin.read(), "faulthandler": faulthandler.is_enabled()}))
    print("to stderr", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    what = sys.argv[1]
    if what == "raise":
        raise ValueError("from the script")
    if what == "signal":
        sys.stdout.flush()
        os.kill(os.getpid(), 15)
    if what == "hang":
        import signal
        signal.pause()
    sys.exit({"ok": 0, "code": 3, "text": "a message"}.get(what, 0))
""")


@pytest.fixture(scope="module")
def light_cache():
    """The light servers' cache, shared by this module's tests (a server per environment, as in the real one)."""
    cache = {}
    yield cache
    for server in cache.values():
        server.close()


@pytest.fixture
def light_server(light_cache, monkeypatch, tmp_path):
    """A server that preloads small modules (no torch), in the cache above."""
    monkeypatch.setattr(_forkserver, "PRELOAD", ("json", "fractions"))
    monkeypatch.setattr(_forkserver, "_SERVERS", light_cache)
    script = tmp_path / "bin" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    return script


def _both(script, what, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("FORK_TEST_GONE", "PYTHONFAULTHANDLER")}
    env["FORK_TEST_MARKER"] = "set for this command"
    if what in ("code", "raise"):  # one server for both: the child applies it as a fresh interpreter does
        env["PYTHONFAULTHANDLER"] = "1"
    os.environ["FORK_TEST_GONE"] = "only in the test process"
    try:
        argv = [sys.executable, str(script), what, "second arg"]
        forked = _forkserver.run_python(argv, cwd=cwd, env=env)
        fresh = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    finally:
        del os.environ["FORK_TEST_GONE"]
    return forked, fresh


@pytest.mark.parametrize("what, code", [("ok", 0), ("code", 3), ("text", 1), ("raise", 1), ("signal", -signal.SIGTERM)])
def test_a_forked_command_ends_as_a_fresh_process_does(light_server, tmp_path, what, code):
    forked, fresh = _both(light_server, what, tmp_path)
    assert forked.returncode == fresh.returncode == code, (forked, fresh)
    seen_forked, seen_fresh = (json.loads(p.stdout.splitlines()[0]) for p in (forked, fresh))
    assert seen_forked.pop("warm") and not seen_fresh.pop("warm")  # the fork did start from the server's imports
    assert seen_forked == seen_fresh == {"argv": [what, "second arg"], "cwd": str(tmp_path / "cwd"),
                                         "path0": str(light_server.parent), "marker": "set for this command",
                                         "gone": None, "stdin": "", "faulthandler": what in ("code", "raise")}
    assert forked.stdout.split("\n", 1)[1] == fresh.stdout.split("\n", 1)[1] == "no newline at the end"
    if what == "raise":
        assert forked.stderr.splitlines()[-2:] == fresh.stderr.splitlines()[-2:] == ["ValueError: from the script",
                                                                                    "atexit ran"]
        assert "Traceback (most recent call last)" in forked.stderr
    else:
        assert forked.stderr == fresh.stderr
    assert ("atexit ran" in forked.stderr) == ("atexit ran" in fresh.stderr) == (code != -15)


def test_a_forked_command_past_its_timeout_is_killed_and_raises(light_server, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        _forkserver.run_python([sys.executable, str(light_server), "hang"], cwd=tmp_path, timeout=0.5)
    server = _forkserver._SERVERS[_forkserver.server_key(dict(os.environ))]
    again = _forkserver.run_python([sys.executable, str(light_server), "ok"], cwd=tmp_path, timeout=60)
    assert again.returncode == 0 and server.proc.poll() is None  # the server lives on, and served it
    assert _forkserver._SERVERS[_forkserver.server_key(dict(os.environ))] is server


def test_an_interrupted_wait_kills_the_child_and_the_next_command_gets_a_fresh_server(light_server, tmp_path,
                                                                                      monkeypatch):
    """An interrupt (Ctrl-C, a pytest timeout) while a child runs: the child and its server are killed, so the
    next command cannot read the interrupted one's answer."""
    import psutil

    argv = [sys.executable, str(light_server), "hang"]
    assert _forkserver.run_python([*argv[:2], "ok"], cwd=tmp_path).returncode == 0  # the server exists
    server = _forkserver._SERVERS[_forkserver.server_key(dict(os.environ))]
    real, answers = _forkserver._Server._read, []

    def interrupted(self, timeout):
        answers.append(None)
        if len(answers) == 2:
            raise KeyboardInterrupt  # while the child hangs
        answers[-1] = real(self, timeout)
        return answers[-1]

    monkeypatch.setattr(_forkserver._Server, "_read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _forkserver.run_python(argv, cwd=tmp_path)
    monkeypatch.setattr(_forkserver._Server, "_read", real)
    assert answers[2] == {"returncode": -signal.SIGKILL}  # the server reaped the killed child, then was ended
    assert server.proc.poll() is not None and not psutil.pid_exists(answers[0]["pid"])
    again = _forkserver.run_python([*argv[:2], "code"], cwd=tmp_path)
    assert again.returncode == 3 and json.loads(again.stdout.splitlines()[0])["warm"] is True


def test_a_server_with_a_thread_after_its_imports_is_not_used(light_server, tmp_path, monkeypatch):
    """Forking a process with threads can leave a lock held in the child: such a server is refused, and the
    command runs as a fresh process."""
    (light_server.parent / "starts_a_thread.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n")
    monkeypatch.setattr(_forkserver, "PRELOAD", ("fractions", "starts_a_thread"))
    env = dict(os.environ, PYTHONPATH=str(light_server.parent))
    proc = _forkserver.run_python([sys.executable, str(light_server), "ok"], cwd=tmp_path, env=env)
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[0])["warm"] is False
    assert not _forkserver._SERVERS[_forkserver.server_key(env)].usable


MODULE = textwrap.dedent("""
    import json, os, sys
    warm = "fractions" in sys.modules
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                      "spec": __spec__.name, "warm": warm}))
    sys.exit(int(sys.argv[1]))
""")


def test_a_forked_module_runs_as_python_m_runs_it(light_server, tmp_path, monkeypatch):
    """`python -m package.module` of the repository's packages (scripts, ops, bench; here a stand-in) is forked
    too, with what `python -m` sets: argv[0] the module's file, the working directory first on sys.path."""
    cwd = tmp_path / "cwd"
    (cwd / "forkpkg").mkdir(parents=True)
    (cwd / "forkpkg" / "__init__.py").write_text("")
    (cwd / "forkpkg" / "tool.py").write_text(MODULE)
    monkeypatch.setattr(_forkserver, "REPO_PACKAGES", ("forkpkg",))
    argv = [sys.executable, "-m", "forkpkg.tool", "3", "second arg"]
    forked = _forkserver.run_python(argv, cwd=cwd)
    fresh = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    assert forked.returncode == fresh.returncode == 3, (forked, fresh)
    seen_forked, seen_fresh = (json.loads(p.stdout) for p in (forked, fresh))
    assert seen_forked.pop("warm") and not seen_fresh.pop("warm")  # the fork did start from the server's imports
    assert seen_forked == seen_fresh == {"argv": [str(cwd / "forkpkg" / "tool.py"), "3", "second arg"],
                                         "cwd": str(cwd), "path0": str(cwd), "name": "__main__", "spec": "forkpkg.tool"}


def test_other_commands_and_the_switch_run_fresh_processes(light_server, tmp_path, monkeypatch):
    assert _forkserver.forkable([sys.executable, "-m", "scripts.make_tables", "runs"])
    for other in (["-m", "torch.distributed.run", "train.py"], ["-m", "pytest"], ["-m", "scripts"], ["-c", "0"]):
        assert not _forkserver.forkable([sys.executable, *other]), other
    code = "import sys; print('fractions' in sys.modules)"
    assert _forkserver.run_python([sys.executable, "-c", code], cwd=tmp_path).stdout == "False\n"
    monkeypatch.setenv("FRUGAL_TESTS_FORK", "0")
    proc = _forkserver.run_python([sys.executable, str(light_server), "ok"], cwd=tmp_path)
    assert json.loads(proc.stdout.splitlines()[0])["warm"] is False


NESTED_PARENT = textwrap.dedent("""
    import json, os, subprocess, sys
    script = sys.argv[1]

    def run(what, **kw):
        try:
            p = subprocess.run([sys.executable, script, what, "second arg"], capture_output=True, **kw)
        except subprocess.TimeoutExpired as e:
            return ["timeout", type(e.stdout).__name__]
        except subprocess.CalledProcessError as e:
            return ["check", e.returncode]
        out, err = (s if isinstance(s, str) else "bytes: " + s.decode() for s in (p.stdout, p.stderr))
        first, rest = out.split("\\n", 1)
        return [p.returncode, json.loads(first.removeprefix("bytes: ")), rest, err]

    print(json.dumps({"ok": run("ok", text=True, cwd=os.path.dirname(script)), "code": run("code", text=True),
                      "bytes": run("text"), "runtime env": run("ok", text=True, env=dict(os.environ, WANDB_MODE="x")),
                      "other env": run("ok", text=True, env=dict(os.environ, FORK_TEST_MARKER="changed")),
                      "check": run("code", text=True, check=True), "timeout": run("hang", text=True, timeout=0.5)}))
""")


def test_nested_runs_of_a_forked_command_end_as_fresh_processes_do(light_server, tmp_path):
    """run_python(nested=True): the program's own subprocess.run of a python script is forked too (from the
    server's imports) and gives what the fresh process gives (exit code, output as text or bytes, check,
    timeout); one whose environment changes a variable read at import runs fresh."""
    parent = tmp_path / "parent.py"
    parent.write_text(NESTED_PARENT)
    argv = [sys.executable, str(parent), str(light_server)]
    forked = _forkserver.run_python(argv, cwd=tmp_path, nested=True)
    fresh = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert forked.returncode == fresh.returncode == 0, (forked, fresh)
    seen_forked, seen_fresh = json.loads(forked.stdout), json.loads(fresh.stdout)
    warm = {case: r[1].pop("warm") for case, r in seen_forked.items() if isinstance(r[1], dict)}
    assert warm == {"ok": True, "code": True, "bytes": True, "runtime env": True, "other env": False}
    assert not any(r[1].pop("warm") for r in seen_fresh.values() if isinstance(r[1], dict))
    assert seen_forked == seen_fresh
    assert seen_fresh["bytes"][3] == "bytes: to stderr\na message\natexit ran\n" and seen_fresh["check"] == ["check", 3]
    assert seen_fresh["timeout"] == ["timeout", "bytes"] and seen_fresh["ok"][1]["cwd"] == str(light_server.parent)


@pytest.mark.slow
def test_train_py_forked_trains_bitwise_as_a_fresh_process(tmp_path):
    """The real preload (torch, transformers, Hydra, train): the same toy run's losses and weights, forked
    and fresh."""
    from _train_helpers import REPO, assert_same_weights, losses, subprocess_env, train_cmd, weights
    from train_utils import checkpoint as ckpt

    def cmd(how):
        return train_cmd(tmp_path / how, "train.steps=3", "checkpoint.every=3")

    forked = _forkserver.run_python(cmd("forked"), cwd=REPO, env=subprocess_env(), timeout=300)
    fresh = subprocess.run(cmd("fresh"), cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    for proc in (forked, fresh):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "forked") == losses(tmp_path / "fresh") and len(losses(tmp_path / "fresh")) == 3
    assert_same_weights(*(weights(ckpt.latest(str(tmp_path / how / "checkpoints"))) for how in ("forked", "fresh")))


# ------------------------------------------------------------------------------------------ torchrun launches
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                  "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                  "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                  "OMP_NUM_THREADS", "FORK_TEST_MARKER")
RANK_SCRIPT = textwrap.dedent("""
    import json, os, re, signal, sys, time
    rank, what, where = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
    seen = {k: os.environ.get(k) for k in %r}
    # the values that differ between launches, as their form
    seen["MASTER_PORT"] = seen["MASTER_PORT"].isdigit() and 0 < int(seen["MASTER_PORT"]) < 65536
    run_id = seen["TORCHELASTIC_RUN_ID"]
    seen["TORCHELASTIC_RUN_ID"] = bool(re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", run_id))
    seen["TORCHELASTIC_ERROR_FILE"] = seen["TORCHELASTIC_ERROR_FILE"].split(os.sep)[-2:]
    # one write a line: the ranks' streams are unbuffered (`python -u`), and print() writes the end apart
    sys.stdout.write(json.dumps({"rank": rank, "argv": sys.argv[1:], "cwd": os.getcwd(), "env": seen,
                                 "warm": "fractions" in sys.modules}) + "\\n")
    sys.stderr.write(f"rank {rank} to stderr\\n")
    # printed; the pid for the kill tests, whole when it appears (written beside `where`, then renamed)
    part = os.path.join(os.path.dirname(where), f".{run_id}-{rank}")
    with open(part, "w") as f:
        f.write(str(os.getpid()))
    os.replace(part, os.path.join(where, f"{run_id}-{rank}"))
    if what == "hang" or (what != "ok" and rank == 0):
        signal.pause()  # until the launch terminates it
    if what != "ok":  # rank 1 fails once rank 0 has printed, so that both launches print the same
        while not os.path.exists(os.path.join(where, f"{run_id}-0")):
            time.sleep(0.01)
    if what == "code":
        sys.exit(3)
    if what == "raise":
        raise ValueError(f"from rank {rank}")
""") % (RANK_VARIABLES,)


def _launch_argv(script, *args, nproc="--nproc_per_node=2"):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", *nproc.split(), str(script), *args]


def _summary(stderr: str) -> list[str]:
    """torchrun's log lines and failure summary with the pids, times and log paths taken out."""
    keep = [ln for ln in stderr.splitlines() if re.search(r"closing signal|failed \(exitcode|^\s*(rank|exitcode|"
                                                          r"error_file|traceback)\s*:|FAILED|^\[\d\]|Root Cause", ln)]
    keep = [re.sub(r"(pid:? |PID |process )\d+", r"\1N", ln).strip() for ln in keep]
    return [re.sub(r"^[WE]\d{4} [\d:.]+ \d+ \S+\] ", "", ln) for ln in keep]


@pytest.mark.slow
@pytest.mark.parametrize("what, code", [("ok", 0), ("code", 1), ("raise", 1)])
def test_a_forked_launch_ends_as_torchrun_does(light_server, tmp_path, what, code):
    """Two ranks forked from the server and the same `torchrun --standalone` command: the exit status, the ranks'
    output (in the launch's stdout and stderr, unprefixed), their environment (torchrun's variables; only the
    store differs: a forked launch's rank 0 hosts it) and, when a rank fails, torchrun's summary naming it."""
    script = light_server.parent / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torchrun sets it, and says so
    env["FORK_TEST_MARKER"] = "set for this launch"
    runs = {}
    for how in ("forked", "fresh"):
        (tmp_path / how).mkdir()
        argv = _launch_argv(script, what, str(tmp_path / how))
        runs[how] = (_forkserver.run_python(argv, cwd=tmp_path, env=env, timeout=120) if how == "forked" else
                     subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120))
    forked, fresh = runs["forked"], runs["fresh"]
    assert forked.returncode == fresh.returncode == code, (forked, fresh)
    seen = {how: sorted((json.loads(ln) for ln in p.stdout.splitlines()), key=lambda r: r["rank"])
            for how, p in runs.items()}
    assert [r.pop("warm") for r in seen["forked"]] == [True, True] and [r.pop("warm") for r in seen["fresh"]] == [
        False, False]  # the ranks did start from the server's imports
    assert [r["env"].pop("TORCHELASTIC_USE_AGENT_STORE") for r in seen["forked"]] == ["False", "False"]
    assert [r["env"].pop("TORCHELASTIC_USE_AGENT_STORE") for r in seen["fresh"]] == ["True", "True"]
    assert seen["forked"] == [{"rank": r, "argv": [what, str(tmp_path / "forked")], "cwd": str(tmp_path), "env": {
        "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(r), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
        "MASTER_ADDR": "localhost", "MASTER_PORT": True, "TORCHELASTIC_RUN_ID": True, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_ERROR_FILE": [str(r), "error.json"],
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1", "FORK_TEST_MARKER": "set for this launch"}} for r in (0, 1)]
    for r in seen["fresh"]:
        r["argv"][1] = str(tmp_path / "forked")
    assert seen["forked"] == seen["fresh"]
    for how in ("forked", "fresh"):  # one launch id for both ranks, another for the other launch
        assert len({name.rsplit("-", 1)[0] for name in os.listdir(tmp_path / how)}) == 1
    for p in (forked, fresh):
        assert p.stderr.startswith("\n" + "*" * 41 + "\nSetting OMP_NUM_THREADS environment variable"), p.stderr
        assert "rank 0 to stderr\n" in p.stderr and "rank 1 to stderr\n" in p.stderr, p.stderr
        assert ("ValueError: from rank 1" in p.stderr) == (what == "raise"), p.stderr
    assert _summary(forked.stderr) == _summary(fresh.stderr), (forked.stderr, fresh.stderr)
    lines = _summary(forked.stderr)
    if what != "ok":
        failed = f"failed (exitcode: {3 if what == 'code' else 1}) local_rank: 1 (pid: N) of binary: {sys.executable}"
        assert lines[:2] == ["Sending process N closing signal SIGTERM", failed], lines
        assert "rank      : 1 (local_rank: 1)" in forked.stderr.split("Root Cause")[1]
        assert "exitcode  : -15 (pid: N)  (SIGTERM)" in lines
    else:
        assert lines == []


def test_which_launches_are_forked(monkeypatch):
    """The plain form only: --standalone and --nproc_per_node, then a script or a repository module."""
    monkeypatch.delenv("FRUGAL_TESTS_FORK", raising=False)
    py, run = sys.executable, ["-m", "torch.distributed.run"]
    plain = [py, *run, "--standalone", "--nproc_per_node=3", "train.py", "a=1"]
    assert _forkserver.launch_of(plain) == (3, ["train.py", "a=1"])
    assert _forkserver.launch_of([py, *run, "--standalone", "--nproc_per_node", "2", "-m", "scripts.x", "-m"]) == (
        2, ["-m", "scripts.x", "-m"])
    for other in (["--nproc_per_node=2", "train.py"], ["--standalone", "--nnodes=1", "--nproc_per_node=2", "train.py"],
                  ["--standalone", "--nproc_per_node=2", "--max-restarts=1", "train.py"],
                  ["--standalone", "--nproc_per_node=gpu", "train.py"], ["--standalone", "--nproc_per_node=2", "-m",
                                                                         "pytest"],
                  ["--standalone", "--nproc_per_node=2", "--no-python", "train.py"]):
        assert _forkserver.launch_of([py, *run, *other]) is None, other
        assert not _forkserver.forkable([py, *run, *other])
    monkeypatch.setenv("FRUGAL_TESTS_FORK", "0")
    assert _forkserver.launch_of([py, *run, "--standalone", "--nproc_per_node=2", "train.py"]) is None


LAUNCH_ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _kill_while_running(light_server, tmp_path, monkeypatch, cause):
    """A hanging two-rank launch whose wait ends with `cause` once both ranks run: their pids."""
    monkeypatch.delenv("FRUGAL_TESTS_FORK", raising=False)  # (fresh, a timeout would leave torchrun's ranks hanging)
    script = light_server.parent / "ranks.py"
    script.write_text(RANK_SCRIPT)
    real = _forkserver._Server._read

    def read(self, timeout):
        if timeout == 123:  # the wait for the launch's end: once both ranks are there, the timeout or interrupt
            deadline = time.monotonic() + 120  # (a guard: the ranks write their files at once)
            while len(os.listdir(tmp_path / "pids")) < 2:
                assert self.proc.poll() is None and time.monotonic() < deadline, os.listdir(tmp_path / "pids")
                select.select([], [], [], 0.01)
            if cause is KeyboardInterrupt:
                raise KeyboardInterrupt
            return None
        return real(self, timeout)

    (tmp_path / "pids").mkdir()
    monkeypatch.setattr(_forkserver._Server, "_read", read)
    with pytest.raises(cause):
        _forkserver.run_python(_launch_argv(script, "hang", str(tmp_path / "pids")), cwd=tmp_path, env=LAUNCH_ENV,
                                 timeout=123)
    monkeypatch.setattr(_forkserver._Server, "_read", real)
    return [int((tmp_path / "pids" / name).read_text()) for name in os.listdir(tmp_path / "pids")]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("cause", [subprocess.TimeoutExpired, KeyboardInterrupt])
def test_a_launch_past_its_timeout_or_interrupted_kills_every_rank(light_server, tmp_path, monkeypatch, cause):
    """A timeout kills the launch and its ranks and the server serves on; an interrupt ends the server too."""
    server = _forkserver._SERVERS.get(_forkserver.server_key(LAUNCH_ENV))
    pids = _kill_while_running(light_server, tmp_path, monkeypatch, cause)
    for pid in pids:  # SIGKILL to the launch's process group: each rank is gone (or a zombie) at once, or about to be
        deadline = time.monotonic() + 60
        while not _gone(pid) and time.monotonic() < deadline:
            select.select([], [], [], 0.01)
        assert _gone(pid), pid
    after = _forkserver._SERVERS[_forkserver.server_key(LAUNCH_ENV)]
    assert (after.proc.poll() is None) == (cause is subprocess.TimeoutExpired)
    if server is not None and cause is subprocess.TimeoutExpired:
        assert after is server
    script = light_server.parent / "ranks.py"
    (tmp_path / "again").mkdir()
    again = _forkserver.run_python(_launch_argv(script, "ok", str(tmp_path / "again")), cwd=tmp_path, env=LAUNCH_ENV,
                                   timeout=120)
    assert again.returncode == 0 and all(json.loads(ln)["warm"] for ln in again.stdout.splitlines()), again


@pytest.mark.slow
def test_a_ddp_launch_forked_trains_bitwise_as_torchrun(tmp_path):
    """The real preload: the same toy two-rank DDP run's losses and weights, forked and through torchrun."""
    from _train_helpers import REPO, assert_same_weights, failure, losses, subprocess_env, torchrun_cmd, weights
    from train_utils import checkpoint as ckpt

    def cmd(how):
        return torchrun_cmd(tmp_path / how, "train.micro_batch_size=2", "train.steps=3", "checkpoint.every=3")

    forked = _forkserver.run_python(cmd("forked"), cwd=REPO, env=subprocess_env(), timeout=300)
    fresh = subprocess.run(cmd("fresh"), cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    for proc in (forked, fresh):
        assert proc.returncode == 0, failure(proc)
    assert losses(tmp_path / "forked") == losses(tmp_path / "fresh") and len(losses(tmp_path / "fresh")) == 3
    assert_same_weights(*(weights(ckpt.latest(str(tmp_path / how / "checkpoints"))) for how in ("forked", "fresh")))
