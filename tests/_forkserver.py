"""Run `python script.py args` and `python -m scripts.x args` from the tests without paying Python's start-up
each time.

Most of a toy `python train.py ...` run is importing: torch, transformers' LLaMA (whose lazy-import index
reads every model file), Hydra and this repository take ~4.5 CPU-s, the two training steps a fraction of
that. The suite starts some 80 such commands (the README's and docs' command blocks, the CLI tests).
`run_python` starts them as children forked from a server that imported those modules once, so each
child begins where a fresh interpreter would be after its imports, then runs the script as `__main__`
(runpy.run_path), or the repository's module (`python -m` of scripts.*, ops.*, bench.*: runpy.run_module, with
sys.path[0] the working directory as `python -m` sets it), with its own argv (argv[0] is the script's absolute
path, or the module's file as `python -m` sets it), working directory, environment, stdin
(/dev/null), stdout and stderr (files the client reads back), and reports its exit status the way
`subprocess.run` does (the code of `sys.exit`, 1 for an uncaught exception with its traceback on stderr,
-N for signal N).

Launches of ranks. The plain torchrun form `[python, -m, torch.distributed.run, --standalone,
--nproc_per_node=N (or --nproc_per_node N), script.py or -m scripts.name, args...]` is forked too (launch_of):
a launcher child of the server forks the N ranks, each a separate process with the environment torchrun
gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_*, ROLE_*, MASTER_ADDR=localhost,
MASTER_PORT a free port, TORCHELASTIC_RUN_ID a uuid shared by the launch's ranks, TORCHELASTIC_RESTART_COUNT,
_MAX_RESTARTS, _ERROR_FILE, _SIGNALS_TO_HANDLE, TORCH_NCCL_ASYNC_ERROR_HANDLING, OMP_NUM_THREADS=1 when
unset, with torchrun's notice) and its streams unbuffered (`python -u`) on the launch's stdout and stderr,
unprefixed, as torchrun leaves them. One difference: TORCHELASTIC_USE_AGENT_STORE is False (rank 0 hosts
the store; torchrun's agent hosts it itself). The launch ends as torchrun does: 0 when every rank exits
0; at a rank's failure the others get SIGTERM, then SIGKILL after torchrun's 30 s, and stderr ends with
torchrun's log lines and its ChildFailedError summary (torch's own class: each rank's exit code or
signal, and its error file's message, which train.py writes for its one-line errors), exit status 1. A
timeout kills the launch's process group (launcher and ranks); an interrupt kills them and the server.

Nested runs (opt-in, `run_python(..., nested=True)`): a forked program that itself runs `python script.py`
or `python -m scripts.name` with `subprocess.run` (scripts.mini_repro's and bench.train_step's train.py runs)
gets those forked too, from a copy of itself taken before it started (a "zygote", as the server's own
children are, imports done and nothing else): the same exit code, captured output and files as the fresh
process. Only `subprocess.run(argv, cwd=, env=, capture_output=True, text=, timeout=, check=)` of such an
argv (any other option None) is forked, and only when its environment differs from the program's own in
variables read at run time (RUNTIME_ENV), not at import; any other call (Popen, a preexec_fn, a torchrun,
another program) is the real one.

What it is not for: the process boundary itself. Signals, crashes, kills and Slurm's jobs stay real
processes (`subprocess`), as do `python -c`, `python -m` of any other module (pytest), and any torchrun
command with another option (--nnodes, --max-restarts, ...): `run_python` runs those through
`subprocess.run` unchanged, as it does everything when `FRUGAL_TESTS_FORK=0`. The tests that need
torchrun's own process tree (a rank frozen or signalled by pid: test_faults' frozen rank, test_ddp's
signal to one rank) start it with `subprocess.Popen` and stay fresh. test_faults' multirun refusal is
forked: it is train.py's own check of the rank variables above.

One server per pytest process and environment (the environment a library reads at import, such as
OMP_NUM_THREADS or HF_HUB_OFFLINE, is the server's, so a request with another environment gets a server
of its own). The server imports nothing that starts a thread (forking a process with threads can leave
a lock held in the child: `datasets` starts one, so it is imported by the children that need it); it
checks that it has one thread after its imports, and the client falls back to `subprocess.run`
otherwise.

Protocol (the server's stdin and stdout, one JSON object per line): the client sends {"argv", "cwd",
"env", "stdout", "stderr"} (argv[0] is the script, or "-m" and argv[1] the module; the rest its arguments;
stdout and stderr are file paths; for a launch also "nproc", "name" (torchrun's name for it in the
summary) and "omp_banner"); the server answers {"pid"} once the child (a launch's launcher) is forked and
{"returncode"} once it has ended.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What a train.py, eval.py, scripts/, ops/ or bench/ process imports before it does anything of its own.
PRELOAD = ("torch", "hydra", "omegaconf", "train", "eval", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.t5.tokenization_t5", "matplotlib.pyplot",
           "wandb")
REPO_MODULES = {"train", "eval"}
# The packages whose `python -m package.module` commands are forked (the repository's programs).
REPO_PACKAGES = ("scripts", "ops", "bench")
# Variables a child applies itself (pytest sets the first per test): requests that differ only in them share
# a server.
PER_CHILD = {"PYTEST_CURRENT_TEST", "PYTHONFAULTHANDLER"}
# Variables read when a program runs, not when the server imports: a nested run (see the module docstring) that
# sets them otherwise than its parent is still forked.
RUNTIME_ENV = PER_CHILD | {"WANDB_MODE", "TOKENIZERS_PARALLELISM"}


# ------------------------------------------------------------------------------------------ the server
def _redirect(request: dict) -> None:
    """stdin from /dev/null, stdout and stderr into the request's files."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = sys.__stdout__  # the server pointed it at stderr


def _child(request: dict, rank: bool = False) -> None:
    """In the forked child: become `python script args` (a rank: `python -u script args` on the launch's
    streams, as torchrun starts it) and never return."""
    code = 1
    try:
        if request.get("nested") and not rank:  # a copy of this process before it starts: see _nested_runs
            _nested_runs(request)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if rank:  # unbuffered, as `python -u`: the ranks' lines reach the shared files as they are written
            import io

            for name in ("stdout", "stderr"):
                old = getattr(sys, f"__{name}__")
                setattr(sys, name, io.TextIOWrapper(io.FileIO(old.fileno(), "w", closefd=False), encoding=old.encoding,
                                                    errors=old.errors, write_through=True))
        else:
            _redirect(request)
        import faulthandler

        if os.environ.get("PYTHONFAULTHANDLER"):  # what a fresh interpreter does with it at start-up
            faulthandler.enable()
        else:
            faulthandler.disable()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        script, *args = request["argv"]
        module = args.pop(0) if script == "-m" else None
        sys.argv = [module or script, *args]
        # as `python -m module` (the working directory) and `python script` (the script's directory) set it
        sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(script))
        code = run_as_main(script, module)
    except BaseException:
        traceback.print_exc()
    finally:
        _flush_and_exit(code & 0xFF)


def run_as_main(script: str, module: str | None = None) -> int:
    """Run `script` (or `module`, as `python -m` does) as `__main__` in this process and return the exit
    code a fresh interpreter would end with; the atexit functions run (os._exit, which ends a forked
    child, would skip them)."""
    import runpy

    try:
        if module:  # sets argv[0] to the module's file, as `python -m` does
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter prints for an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    return code


def _flush_and_exit(code: int) -> None:
    """Flush the child's streams and end it at once (no interpreter shutdown in a forked child)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _nested_runs(request: dict) -> None:
    """In a forked child, before it starts: fork a zygote (a copy of the child as the server forked it) that forks
    the child's nested runs, and route the child's `subprocess.run` of a forkable argv to it (the module
    docstring's "Nested runs"). The zygote ends with the child."""
    import atexit
    import socket
    import threading

    base_env, parent = dict(request["env"]), os.getpid()
    ours, theirs = socket.socketpair()
    zygote = os.fork()
    if zygote == 0:
        ours.close()
        _zygote(theirs, parent)
    theirs.close()
    original, lines, ended, busy = subprocess.run, [b""], [False], threading.Lock()

    def reply(timeout: float | None = None) -> dict | None:
        while b"\n" not in lines[0]:
            ready, _, _ = select.select([ours], [], [], timeout)
            chunk = ours.recv(65536) if ready else b""
            if not chunk:
                return None
            lines[0] += chunk
        line, lines[0] = lines[0].split(b"\n", 1)
        return json.loads(line)

    def run(args, *popenargs, **kwargs):
        argv = list(args) if isinstance(args, (list, tuple)) and all(isinstance(a, str) for a in args) else None
        env = kwargs.get("env")
        env = dict(os.environ if env is None else env)
        changed = {k for k in set(env) | set(base_env) if env.get(k) != base_env.get(k)}
        given = {k for k, v in kwargs.items() if v is not None}
        if (popenargs or argv is None or not forkable(argv) or not kwargs.get("capture_output")
                or given - {"cwd", "env", "capture_output", "text", "timeout", "check"}
                or changed - RUNTIME_ENV or ended[0] or not busy.acquire(blocking=False)):
            return original(args, *popenargs, **kwargs)  # (one nested run at a time: another thread's is real)
        try:
            proc = nested(args, argv, env, kwargs)
        except subprocess.TimeoutExpired:
            raise
        except BaseException:  # an interrupt or a dead zygote: the next replies would answer the wrong run
            ended[0] = True
            raise
        finally:
            busy.release()
        if kwargs.get("check"):
            proc.check_returncode()
        return proc

    def nested(args, argv: list[str], env: dict, kwargs: dict) -> subprocess.CompletedProcess:
        cwd = os.fspath(kwargs.get("cwd") or os.getcwd())
        if argv[1] != "-m" and not os.path.isabs(argv[1]):
            argv[1] = os.path.join(cwd, argv[1])
        timeout = kwargs.get("timeout")
        with tempfile.TemporaryDirectory(prefix="nested-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            ours.sendall((json.dumps({"argv": argv[1:], "cwd": cwd, "env": env, "stdout": out, "stderr": err,
                                      "nested": True}) + "\n").encode())
            forked = reply()
            if forked is None:
                raise RuntimeError(f"the zygote (pid {zygote}) did not start {argv}")
            done = None
            try:
                done = reply(timeout)
            finally:
                if done is None:  # a timeout (as subprocess.run: kill the child, then raise) or an interrupt
                    os.kill(forked["pid"], signal.SIGKILL)
            if done is None:
                if reply() is None:
                    raise RuntimeError(f"the zygote (pid {zygote}) did not reap {forked['pid']}")
                raise subprocess.TimeoutExpired(args, timeout, _read(out, {}), _read(err, {}))  # bytes, as its own
            return subprocess.CompletedProcess(args, done["returncode"], _read(out, kwargs), _read(err, kwargs))

    def end_zygote() -> None:
        ended[0] = True
        ours.close()
        try:
            os.waitpid(zygote, 0)
        except ChildProcessError:
            pass

    subprocess.run = run
    atexit.register(end_zygote)


def _read(path: str, kwargs: dict):
    """A nested run's captured stream, as subprocess.run returns it (text or bytes)."""
    if kwargs.get("text") or kwargs.get("universal_newlines"):
        return _text(path)
    with open(path, "rb") as f:
        return f.read()


def _zygote(sock, parent: int) -> None:
    """The zygote: for each request on `sock`, fork a child that runs it (`_child`), answer {"pid"}, then
    {"returncode"} once it has ended; end when the program that uses it (`parent`) closes its end or dies."""
    try:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass
        if os.getppid() != parent:  # it died before the line above
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):  # not the server's protocol pipes
            os.dup2(null, fd)
        os.close(null)
        pending = b""
        while True:
            while b"\n" not in pending:
                chunk = sock.recv(65536)
                if not chunk:
                    os._exit(0)
                pending += chunk
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(json.loads(line))
            sock.sendall((json.dumps({"pid": pid}) + "\n").encode())
            _, status = os.waitpid(pid, 0)
            sock.sendall((json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    except BaseException:
        traceback.print_exc()
    os._exit(1)


OMP_BANNER = ("\n*****************************************\n"
              "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
              "being overloaded, please further tune the variable for optimal performance in your application as "
              "needed. \n*****************************************")
GRACE_S = 30  # torchrun's wait between its SIGTERM to the other ranks and SIGKILL


def _log(level: str, message: str) -> None:
    """A line as torchrun's logger writes it to stderr."""
    now = time.time()
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    print(f"{level}{stamp} {os.getpid()} torch/distributed/elastic/multiprocessing/api.py] {message}",
          file=sys.stderr, flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(request: dict) -> None:
    """In the forked child: become `torchrun --standalone --nproc_per_node=N script args` and never return:
    fork the N ranks with the environment torchrun gives them, wait for them, and end as torchrun does."""
    code = 1
    logs = None
    try:
        os.setpgid(0, 0)  # the launch and its ranks: one group, which a timeout kills at once
        _redirect(request)
        import shutil
        import uuid

        nproc, env = request["nproc"], dict(request["env"])
        if request.get("omp_banner"):
            print(OMP_BANNER, file=sys.stderr, flush=True)
        logs = tempfile.mkdtemp(prefix="torchelastic_")
        run_id, port = str(uuid.uuid4()), _free_port()
        ranks, error_files = {}, {}
        for rank in range(nproc):
            error_files[rank] = os.path.join(logs, str(rank), "error.json")
            os.mkdir(os.path.dirname(error_files[rank]))
            rank_env = dict(env, RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                            LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
                            ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="localhost", MASTER_PORT=str(port),
                            TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                            TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_USE_AGENT_STORE="False",
                            TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                            LOCAL_RANK=str(rank), TORCHELASTIC_ERROR_FILE=error_files[rank],
                            TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT")
            pid = os.fork()
            if pid == 0:
                _child(dict(request, env=rank_env), rank=True)
            ranks[pid] = rank
        code = _monitor(ranks, error_files, request["name"])
    except BaseException:
        traceback.print_exc()
    finally:
        if logs is not None:
            shutil.rmtree(logs, ignore_errors=True)
        _flush_and_exit(code)


def _monitor(ranks: dict[int, int], error_files: dict[int, str], name: str) -> int:
    """Wait for the ranks ({pid: rank}) as torchrun's agent does: 0 once all have exited 0; at the first
    failure, SIGTERM to the others, SIGKILL to those still there GRACE_S later, then torchrun's log line and
    failure summary (its ChildFailedError, with each rank's error file) on stderr, and 1."""
    running, failures = dict(ranks), {}

    def reap(block: bool) -> bool:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        rank = running.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if rank is not None and code != 0:
            from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

            failures[rank] = ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file=error_files[rank])
        return True

    while running and not failures:
        reap(block=True)
    while running and reap(block=False):  # the others that have ended by now, as torchrun's next poll sees them
        pass
    if not failures:
        return 0
    for pid in sorted(running, key=running.get):
        _log("W", f"Sending process {pid} closing signal SIGTERM")
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while running and time.monotonic() < deadline:
        if not reap(block=False):
            time.sleep(0.05)
    for pid in sorted(running, key=running.get):
        _log("W", f"Unable to shutdown process {pid} via Signals.SIGTERM, forcefully exiting via Signals.SIGKILL")
        os.kill(pid, signal.SIGKILL)
    while running:
        reap(block=True)
    first = min(failures.values(), key=lambda f: f.timestamp)
    _log("E", f"failed (exitcode: {first.exitcode}) local_rank: {first.local_rank} (pid: {first.pid}) of binary: "
              f"{sys.executable}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        raise ChildFailedError(name=name, failures=failures)
    except ChildFailedError:
        traceback.print_exc()
    return 1


def _serve(preload: list[str]) -> None:
    reply = sys.stdout
    sys.stdout = sys.stderr  # the modules' prints must not reach the protocol
    # sys.path as `python train.py` has it (the repository first), while importing; each child then sets
    # sys.path[0] to its script's directory. The repository's own modules are preloaded only when the
    # environment puts the repository on PYTHONPATH, as the tests' environments do: otherwise a child
    # could import what the same command in a fresh process could not.
    on_path = str(REPO) in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.path[0] = str(REPO)
    for name in preload:
        if on_path or name.split(".")[0] not in REPO_MODULES:
            __import__(name)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    print(json.dumps({"ready": True, "threads": threads}), file=reply, flush=True)
    _become_subreaper()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            (_launch if request.get("nproc") else _child)(request)
        if request.get("nproc"):
            try:
                os.setpgid(pid, pid)  # as the child does: whichever runs first
            except OSError:
                pass
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        _reap_orphans()
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


def _become_subreaper() -> None:
    """Ranks whose launch was killed (a timeout) become the server's children, which it reaps (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def _reap_orphans() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


# ------------------------------------------------------------------------------------------ the client
class _Server:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", *PRELOAD], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b""
        ready = self._read(timeout=300)
        self.usable = ready is not None and ready.get("threads") == 1

    def _read(self, timeout: float) -> dict | None:
        """The server's next line; None if it is not there within `timeout` seconds or the server died.
        (Unbuffered: a buffered reader could hold the next line where select() does not see it.)"""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def _send(self, request: dict) -> None:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def run(self, argv: list[str], cwd, env: dict, timeout: float, launch: dict | None = None,
            shown: list[str] | None = None, started=None, nested: bool = False) -> subprocess.CompletedProcess:
        """`argv` forked (`launch`: {"nproc", "name", "omp_banner"} for N ranks of it); `shown`: the command
        the result and a TimeoutExpired name; `started`: called with the child's pid (a launch's: its process
        group) once it is forked; `nested`: its own runs of python programs forked too (the module docstring)."""
        argv_shown = shown or argv
        with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": argv[1:], "cwd": str(cwd), "env": env, "stdout": out, "stderr": err, **(launch or {}),
                       **({"nested": True} if nested else {})}
            kill = os.killpg if launch else os.kill  # a launch: its ranks too
            forked = None
            try:
                self._send(request)
                forked = self._read(timeout=60)
                if forked is None:
                    raise RuntimeError(f"the fork server (pid {self.proc.pid}) did not start {argv_shown}: it exited "
                                       f"with {self.proc.poll()}")
                if started is not None:
                    started(forked["pid"])
                done = self._read(timeout=timeout)
                if done is None:  # as subprocess.run: kill the child, then raise
                    kill(forked["pid"], signal.SIGKILL)
                    if self._read(timeout=60) is None:
                        raise RuntimeError(f"the fork server (pid {self.proc.pid}) did not reap {forked['pid']}")
                    raise subprocess.TimeoutExpired(argv_shown, timeout, _text(out), _text(err))
            except subprocess.TimeoutExpired:
                raise
            except BaseException:  # an interrupt or a dead server: its next lines would answer the wrong request
                if forked is not None:  # kill the child and let the server reap it, then end the server
                    try:
                        kill(forked["pid"], signal.SIGKILL)
                        self._read(timeout=30)
                    except BaseException:
                        pass
                self.proc.kill()
                self.proc.wait()
                raise
            return subprocess.CompletedProcess(argv_shown, done["returncode"], _text(out), _text(err))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


_SERVERS: dict[tuple, _Server] = {}


def _close_all() -> None:
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


atexit.register(_close_all)


def _forked_module(argv: list[str]) -> bool:
    """`-m package.module` of the repository's REPO_PACKAGES."""
    return argv[0] == "-m" and len(argv) >= 2 and argv[1].split(".")[0] in REPO_PACKAGES and "." in argv[1]


def launch_of(argv: list[str]) -> tuple[int, list[str]] | None:
    """For the plain torchrun form `[sys.executable, "-m", "torch.distributed.run", "--standalone",
    "--nproc_per_node=N" (or "--nproc_per_node", "N"), script.py or -m scripts.name, args...]`: (N, the
    command each rank runs without its python); None for anything else (any other torchrun option) and when
    FRUGAL_TESTS_FORK=0."""
    if argv[:4] != [sys.executable, "-m", "torch.distributed.run", "--standalone"] or len(argv) < 6 \
            or os.environ.get("FRUGAL_TESTS_FORK", "1") == "0":
        return None
    nproc, rest = argv[4], argv[5:]
    if nproc == "--nproc_per_node":
        nproc, rest = argv[5], argv[6:]
    elif nproc.startswith("--nproc_per_node="):
        nproc = nproc.split("=", 1)[1]
    else:
        return None
    if not nproc.isdigit() or int(nproc) < 1 or not rest:
        return None
    if rest[0].endswith(".py") or _forked_module(rest):
        return int(nproc), rest
    return None


def forkable(argv: list[str]) -> bool:
    """`[sys.executable, "some/script.py", ...]`: a script run as `__main__` (not -c), or
    `[sys.executable, "-m", "scripts.name", ...]`: a program of the repository's REPO_PACKAGES (not -m torch's or
    pytest's)."""
    if len(argv) < 2 or argv[0] != sys.executable or os.environ.get("FRUGAL_TESTS_FORK", "1") == "0":
        return False
    return argv[1].endswith(".py") or _forked_module(argv[1:])


def server_key(env: dict) -> tuple:
    """The environment a server is started with, as its cache key: all of it but PER_CHILD."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_CHILD))


def run_python(argv: list[str], cwd, env: dict | None = None, timeout: float = 300,
               started=None, nested: bool = False) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`, with a
    `python script.py ...` or `python -m scripts.name ...` command, or the ranks of a plain torchrun launch,
    forked from a warm server (see the module docstring). `started` (optional): called with the forked
    child's pid, a launch's process group; not called where the command runs through subprocess.run. `nested`:
    the program's own `subprocess.run` of python programs forked too ("Nested runs" in the module docstring;
    not a launch's ranks)."""
    env = dict(os.environ if env is None else env)
    launch = launch_of(argv)
    if not forkable(argv) and launch is None:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    fresh_env = env
    if launch is not None:
        nproc, command = launch
        banner = "OMP_NUM_THREADS" not in env and nproc > 1
        if banner:  # torchrun sets it for its ranks; their imports (the server's) then see it too
            env = dict(env, OMP_NUM_THREADS="1")
    key = server_key(env)
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        while len(_SERVERS) >= 3:  # a few environments at a time; the oldest goes
            _SERVERS.pop(next(iter(_SERVERS))).close()
        server = _SERVERS[key] = _Server(env)
    if not server.usable:
        return subprocess.run(argv, cwd=cwd, env=fresh_env, capture_output=True, text=True, timeout=timeout)
    if launch is not None:
        name = next((a for a in command if not a.startswith("-")), "")  # torchrun's name for the failure summary
        if command[0] != "-m":
            command = [os.path.join(str(cwd), command[0]), *command[1:]]
        return server.run([argv[0], *command], cwd, env, timeout, shown=argv,
                          launch={"nproc": nproc, "name": name, "omp_banner": banner}, started=started)
    if argv[1] == "-m":
        return server.run(argv, cwd, env, timeout, started=started, nested=nested)
    script = argv[1] if os.path.isabs(argv[1]) else os.path.join(str(cwd), argv[1])
    return server.run([argv[0], script, *argv[2:]], cwd, env, timeout, started=started, nested=nested)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(sys.argv[2:])
