"""ops/preflight.py on CPU with its fast options: the table, the checks a CPU can run passing
(2-process gloo DDP and FSDP2 training, a bitwise resume in each, activation checkpointing measured
alone, under DDP and under FSDP2), the
GPU-only ones skipped with their reason, and the exit code gating on failures."""
import os
import sys

import pytest

from _forkserver import run_python
from _train_helpers import REPO, subprocess_env


@pytest.mark.slow
def test_preflight_runs_on_cpu_and_skips_gpu_checks_with_the_reason(tmp_path):
    proc = run_python([sys.executable, "-m", "ops.preflight", "--fast", "--workdir", str(tmp_path)], cwd=REPO,
                      env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table = {line.split("|")[0].strip(): (line.split("|")[1].strip(), line.split("|")[2].strip())
             for line in proc.stdout.splitlines() if line.count("|") == 2}
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
