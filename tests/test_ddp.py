"""Two-process data parallelism on CPU (gloo) through torchrun: ranks stay identical, the loss
trajectory equals a single process with the same global batch, and resume is exact under DDP."""
import pytest

from _train_helpers import (TINY, assert_same_weights, failure, losses, rows, run_cli, run_inprocess,  # noqa: F401
                            torchrun_cmd, weights)
from train_utils import checkpoint as ckpt

N = 3
# Global batch 8 = 2 sequences per micro-batch x 2 accumulation steps x 2 ranks (no_sync exercised);
# the single-process reference gets 8 = 2 x 4 x 1: the same micro-batches (the data stream's order
# depends on the micro-batch size, not on the number of processes), so the same sequences per step.
# The gradient norm (logged every step) is what shows a wrong loss scaling across ranks: FRUGAL's
# AdamW and signSGD ignore the gradient's scale.
# fp32: what these tests check is data parallelism, not bf16 (auto would pick bf16-mixed where the CPU has
# it, several times slower on some CPUs).
DDP = ["train.micro_batch_size=2", "train.eval_every=3", "train.precision=fp32"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp")
    proc = run_cli(torchrun_cmd(run_dir, *DDP, f"train.steps={2 * N}"))
    assert proc.returncode == 0, failure(proc)
    return run_dir


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    """The first N steps of ddp_run's command on 2 processes, with their checkpoint: continued on 2
    processes (exact resume) and on 1 (another process count). Each test continues a copy."""
    run_dir = tmp_path_factory.mktemp("ddp_first_half")
    proc = run_cli(torchrun_cmd(run_dir, *DDP, f"train.steps={N}"))
    assert proc.returncode == 0, failure(proc)
    return run_dir


def copy_of(run_dir, tmp_path):
    import shutil

    return shutil.copytree(run_dir, tmp_path / "run")


def test_ranks_identical_and_match_single_process(ddp_run, tmp_path):
    log = rows(ddp_run)
    assert log[0]["world_size"] == 2 and log[0]["accumulation"] == 2
    end = log[-1]
    assert end["event"] == "end" and end["ranks_in_sync"] is True  # every rank's weights identical
    # The same micro-batch size (the data stream's order depends on it), 4 accumulation steps instead of 2.
    assert run_inprocess(tmp_path, *DDP, f"train.steps={2 * N}") == 0
    single, ddp = losses(tmp_path), losses(ddp_run)
    assert single.keys() == ddp.keys()
    # Same data (the ranks' rows interleave into the single process's rows), same token weighting;
    # only the order of float additions differs.
    assert ddp == pytest.approx(single, abs=2e-3)
    def norms(run):
        return [r["grad_norm"] for r in rows(run) if "loss" in r]
    assert len(norms(ddp_run)) == 2 * N and norms(ddp_run) == pytest.approx(norms(tmp_path), rel=1e-2)
    val = {r["step"]: r["val_loss"] for r in rows(tmp_path) if "val_loss" in r and "event" not in r}
    val_ddp = {r["step"]: r["val_loss"] for r in log if "val_loss" in r and "event" not in r}
    assert val_ddp == pytest.approx(val, abs=2e-3)
    assert [r["val_tokens"] for r in log if "val_tokens" in r] == [r["val_tokens"] for r in rows(tmp_path)
                                                                   if "val_tokens" in r]


def test_ddp_resume_is_exact(ddp_run, first_half, tmp_path):
    run_dir = copy_of(first_half, tmp_path)
    trainer = ckpt.load(ckpt.latest(str(run_dir / "checkpoints")), "trainer")
    assert trainer["world_size"] == 2 and len(trainer["rng"]) == 2  # one RNG state per rank
    second = run_cli(torchrun_cmd(run_dir, *DDP, f"train.steps={2 * N}", "train.resume_changes=[train.steps]"))
    assert second.returncode == 0, failure(second)
    assert losses(run_dir) == losses(ddp_run)
    assert_same_weights(weights(ckpt.latest(str(run_dir / "checkpoints"))),
                        weights(ckpt.latest(str(ddp_run / "checkpoints"))))


def test_signal_to_one_rank_stops_all_ranks_at_one_step_and_resume_matches(tmp_path):
    """SLURM may deliver its pre-timeout signal to one task first: every rank must stop after the
    same step, with one checkpoint holding both ranks' positions, and the resumed run must end exactly
    as an uninterrupted one."""
    import json
    import signal
    import subprocess
    import time

    import psutil

    from _train_helpers import REPO, subprocess_env

    steps = 30  # 27 steps after the third (fp32, ~0.2 s each) for the signal to arrive in, also under load
    reference = tmp_path / "reference"
    done = run_cli(torchrun_cmd(reference, *DDP, f"train.steps={steps}"))
    assert done.returncode == 0, failure(done)

    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(torchrun_cmd(run_dir, *DDP, f"train.steps={steps}"), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists():
            lines = metrics.read_text().splitlines()[:-1]  # the last line may be half-written
            if any('"loss"' in line and json.loads(line)["step"] >= 3 for line in lines):
                break
        time.sleep(0.02)
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(c.cmdline())]
    assert len(workers) == 2, [c.cmdline() for c in workers]
    workers[-1].send_signal(signal.SIGUSR1)  # one rank only
    out, err = proc.communicate(timeout=180)
    stopped = [r for r in rows(run_dir) if r.get("event") == "preempted"]
    assert len(stopped) == 1, err[-4000:]
    k = stopped[0]["step"]
    assert 3 <= k < steps
    trainer = ckpt.load(ckpt.latest(str(run_dir / "checkpoints")), "trainer")
    assert trainer["step"] == k and len(trainer["rng"]) == 2

    resumed = run_cli(torchrun_cmd(run_dir, *DDP, f"train.steps={steps}"))
    assert resumed.returncode == 0, failure(resumed)
    assert losses(run_dir) == losses(reference)
    assert_same_weights(weights(ckpt.latest(str(run_dir / "checkpoints"))),
                        weights(ckpt.latest(str(reference / "checkpoints"))))


def test_ddp_keeps_gradients_as_bucket_views(ddp_run):
    start = rows(ddp_run)[0]
    assert start["ddp_gradient_as_bucket_view"] is True  # read from the DDP wrapper itself
    # ...and zeroes them in place: set_to_none=True would make every no_sync micro-batch allocate
    # gradients beside the buckets (docs/memory_plan.md measures the second copy)
    assert start["zero_grad_set_to_none"] is False


# A GPT-2 small enough for a test, with dropout on (the preset pre-trains without it).
GPT2 = [o for o in TINY if not o.startswith("model=")] + [
    "model=gpt2_124m", "model.hidden_size=64", "model.num_hidden_layers=4", "model.num_attention_heads=2",
    "model.dropout=0.1"]


def test_each_rank_draws_its_own_dropout_masks_and_resume_stays_bitwise(tmp_path):
    """Identical initial weights on both ranks, but each rank its own dropout stream (one seed
    everywhere drew the same masks on every rank); the streams are per-rank state of the
    checkpoint, so N + N steps under DDP equal 2N bitwise."""
    import torch

    straight = tmp_path / "straight"
    done = run_cli(torchrun_cmd(straight, *DDP, f"train.steps={2 * N}", base=GPT2))
    assert done.returncode == 0, failure(done)
    assert rows(straight)[-1]["ranks_in_sync"] is True
    rng = ckpt.load(ckpt.latest(str(straight / "checkpoints")), "trainer")["rng"]
    masks = []
    for state in rng:
        torch.set_rng_state(state["torch"])
        masks.append(torch.nn.functional.dropout(torch.ones(4096), p=0.1))
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])
    assert not torch.equal(masks[0], masks[1])

    resumed = tmp_path / "resumed"
    first = run_cli(torchrun_cmd(resumed, *DDP, f"train.steps={N}", base=GPT2))
    assert first.returncode == 0, failure(first)
    second = run_cli(torchrun_cmd(resumed, *DDP, f"train.steps={2 * N}", "train.resume_changes=[train.steps]",
                                  base=GPT2))
    assert second.returncode == 0, failure(second)
    assert losses(resumed) == losses(straight)
    assert_same_weights(weights(ckpt.latest(str(resumed / "checkpoints"))),
                        weights(ckpt.latest(str(straight / "checkpoints"))))


def test_continue_on_another_number_of_processes(ddp_run, first_half, tmp_path):
    """2 processes for N steps, then 1 process for N more (same micro-batch, so 4 accumulation steps
    instead of 2): weights, optimizer state and schedule carry over exactly and the data stream
    continues from the global position, so every step sees the same 8 sequences and the run matches
    the 2-process run up to float summation order."""
    run_dir = copy_of(first_half, tmp_path)
    assert run_inprocess(run_dir, *DDP, f"train.steps={2 * N}", "train.resume_changes=[train.steps]") == 0
    log = rows(run_dir)
    assert [(r["from"], r["to"]) for r in log if r.get("event") == "world_size_changed"] == [(2, 1)]
    assert losses(run_dir) == pytest.approx(losses(ddp_run), abs=2e-3)
    assert_same_weights(weights(ckpt.latest(str(run_dir / "checkpoints"))),
                        weights(ckpt.latest(str(ddp_run / "checkpoints"))), exact=False, atol=2e-3)


def test_every_ranks_epoch_events_reach_the_log(tmp_path, t5_tokenizer_dir):
    """Each rank reads its own logical reader; when both wrap around in the same step, rank 0's
    metrics.jsonl records both epochs (it used to record only the readers of rank 0)."""
    import json

    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document number {i} says hello"}) + "\n" for i in range(44)))
    # 40 training documents, 20 per reader; 2 readers on 2 ranks (reader r on rank r); each rank
    # takes 2 micro-batches of 2 documents per step, so both readers wrap in step 6.
    local = ["data=local", f"data.path={corpus}", f"data.tokenizer={t5_tokenizer_dir}", "data.seq_len=32",
             "data.packing=false", "data.val_stride=11", "data.readers=2", "train.eval_tokens=8",
             "train.micro_batch_size=2", "train.steps=6"]
    run_dir = tmp_path / "run"
    done = run_cli(torchrun_cmd(run_dir, *local))
    assert done.returncode == 0, failure(done)
    epochs = [(r["step"], r["reader"], r["epoch"]) for r in rows(run_dir) if r.get("event") == "epoch"]
    assert sorted(epochs) == [(6, 0, 1), (6, 1, 1)]
