"""ops/preflight.py on CPU with its fast options: the table, the checks a CPU can run passing
(2-process gloo DDP and FSDP2 training, a bitwise resume in each, activation checkpointing measured
alone, under DDP and under FSDP2), the
GPU-only ones skipped with their reason, and the exit code gating on failures."""
import os
import subprocess
import threading
import types

import pytest

from _forkserver import run_python


class ForkedPopen:
    """subprocess.Popen as ops/preflight.py's run_train uses it (poll, wait with a timeout, the pid its
    os.killpg stops a hung run by, returncode; stderr into its file), the command run by the fork server
    (tests/_forkserver.py): the ranks of each torchrun launch forked from the warm interpreter instead of
    a fresh torchrun and two fresh ranks (~10 CPU-s of imports per launch, four launches)."""

    def __init__(self, args, cwd=None, env=None, stdout=None, stderr=None, start_new_session=False):
        self.args, self.pid, self.returncode, self._code = args, None, None, None
        self._forked, self._done = threading.Event(), threading.Event()

        def started(pid):
            self.pid = pid
            self._forked.set()

        def run():
            try:
                proc = run_python(args, cwd=cwd, env=env, timeout=3600, started=started)
                self._code, text = proc.returncode, proc.stderr
            except BaseException as err:  # noqa: BLE001 (the run's failure, as its stderr)
                self._code, text = 1, f"{type(err).__name__}: {err}"
            if stderr is not None and stderr is not subprocess.DEVNULL:
                stderr.write(text)
                stderr.flush()
            self._forked.set()
            self._done.set()

        threading.Thread(target=run, daemon=True).start()
        self._forked.wait(120)

    def poll(self):
        if self._done.is_set():
            self.returncode = self._code
        return self.returncode

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()


@pytest.mark.slow
def test_preflight_runs_on_cpu_and_skips_gpu_checks_with_the_reason(tmp_path, monkeypatch, capsys):
    """`python -m ops.preflight --fast` (its main, in this process), its train.py launches forked (ForkedPopen)."""
    from ops import preflight

    monkeypatch.setattr(preflight, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "Popen": ForkedPopen}))
    code = preflight.main(["--fast", "--workdir", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err[-3000:]
    table = {line.split("|")[0].strip(): (line.split("|")[1].strip(), line.split("|")[2].strip())
             for line in out.out.splitlines() if line.count("|") == 2}
    for check in ("train llama_tiny ddp eager x2", "train llama_tiny fsdp eager x2", "checkpoint + resume (ddp)",
                  "checkpoint + resume (fsdp)", "checkpointing llama_tiny, eager, none",
                  "checkpointing llama_tiny, eager, ddp", "checkpointing llama_tiny, eager, fsdp"):
        assert table[check][0] == "pass", (check, table[check])
    assert table["NCCL all-reduce"] == ("skip", "no GPU on this machine")
    assert table["driver / CUDA / NCCL"] == ("skip", "no GPU on this machine")
    assert table["llama_7b on one 24 GB GPU (step in backward)"] == ("skip", "--fast")
    for parallelism in ("ddp", "fsdp"):
        assert "bitwise equal" in table[f"checkpoint + resume ({parallelism})"][1]
        assert os.path.exists(tmp_path / f"resume_resumed_{parallelism}" / "metrics.jsonl")
    # the FSDP2 run resumed from a sharded checkpoint (torch.distributed.checkpoint's directory)
    assert os.path.isdir(tmp_path / "llama_tiny_fsdp_eager_x2" / "checkpoints" / "step_00000002" / "dcp")


def test_preflight_exits_nonzero_on_a_failed_check(monkeypatch, capsys):
    """A check that fails (here: every training run, as if train.py crashed) makes the exit code 1."""
    from ops import preflight

    monkeypatch.setattr(preflight, "run_train", lambda *args, **kwargs: (1, [], "RuntimeError: NCCL error"))
    monkeypatch.setattr(preflight, "check_activation_checkpointing", lambda table, *a, **k: None)
    assert preflight.main(["--fast"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "exit 1: RuntimeError: NCCL error" in out


def test_the_7b_single_gpu_check_needs_a_gpu_and_names_the_cpu_proof():
    from ops import preflight

    table = preflight.Table()
    preflight.check_7b_single_gpu(table, 0, 60)
    assert table.rows == [("llama_7b on one 24 GB GPU (step in backward)",
                           "needs a GPU (the CPU proof: python -m bench.llama7b)", "skip")]
