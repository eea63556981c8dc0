"""tests/_forkserver.py: a `python script.py` or `python -m scripts.name` command forked from a warm server
gives what `subprocess.run` gives for the same command in a fresh interpreter (exit code, stdout, stderr, argv,
cwd, environment, sys.path[0], atexit, signals, timeouts), and it does start from the server's imports."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

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
