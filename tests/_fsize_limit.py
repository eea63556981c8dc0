"""`python tests/_fsize_limit.py BYTES script.py args...`: `python script.py args...` under a file-size limit
(RLIMIT_FSIZE) of BYTES, as `subprocess.run(..., preexec_fn=<setrlimit>)` runs it, but as a `python script.py`
command that tests/_forkserver.py can fork from its warm interpreter.

The limit applies to every file the process writes, and a forked command's stdout and stderr are files
(the fork server's), where `subprocess.run` gives pipes. So this process forks: the child takes the limit
and runs the script as `__main__` with its stdout and stderr on pipes; this process, without the limit,
copies the pipes to its own stdout and stderr until the child has exited, then exits as it did (its code,
or its signal). Python ignores SIGXFSZ, so a write past the limit fails with EFBIG in the child.
"""
import os
import resource
import select
import signal
import sys

from _forkserver import run_as_main  # this file's directory is sys.path[0]


def main() -> None:
    limit, script, args = int(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the command
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with us
        except Exception:
            pass
        os.close(out_r)
        os.close(err_r)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(script)  # as `python script.py` sets it
        code = run_as_main(script)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)
    os.close(out_w)
    os.close(err_w)
    targets = {out_r: 1, err_r: 2}
    while targets:  # until both pipes are closed: the child and anything it started have exited
        ready, _, _ = select.select(list(targets), [], [])
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(targets[fd], view):]
            else:
                os.close(fd)
                del targets[fd]
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):  # end as it did
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
