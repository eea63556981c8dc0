"""Two-process data parallelism on CPU (gloo) through torchrun: ranks stay identical, the loss
trajectory equals a single process with the same global batch, and resume is exact under DDP."""
import pytest

from _train_helpers import (assert_same_weights, losses, one_thread, rows, run_cli, run_inprocess,  # noqa: F401
                            torchrun_cmd, weights)
from train_utils import checkpoint as ckpt

N = 3
# Global batch 8 = 2 sequences per micro-batch x 2 accumulation steps x 2 ranks (no_sync exercised);
# the single-process reference gets 8 = 4 x 2 x 1 from the shared TINY settings.
# grad_clip far above any norm changes nothing but logs the global gradient norm: FRUGAL's AdamW and
# signSGD ignore the gradient's scale, so the norm is what shows a wrong loss scaling across ranks.
DDP = ["train.micro_batch_size=2", "train.eval_every=3", "train.grad_clip=1e9"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp")
    proc = run_cli(torchrun_cmd(run_dir, *DDP, f"train.steps={2 * N}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def test_ranks_identical_and_match_single_process(ddp_run, tmp_path):
    log = rows(ddp_run)
    assert log[0]["world_size"] == 2 and log[0]["accumulation"] == 2
    end = log[-1]
    assert end["event"] == "end" and end["ranks_in_sync"] is True  # every rank's weights identical
    assert run_inprocess(tmp_path, "train.eval_every=3", "train.grad_clip=1e9", f"train.steps={2 * N}") == 0
    single, ddp = losses(tmp_path), losses(ddp_run)
    assert single.keys() == ddp.keys()
    # Same data (the ranks' rows interleave into the single process's rows), same token weighting;
    # only the order of float additions differs.
    assert ddp == pytest.approx(single, abs=2e-3)
    norms = lambda run: [r["grad_norm"] for r in rows(run) if "grad_norm" in r]
    assert len(norms(ddp_run)) == 2 * N and norms(ddp_run) == pytest.approx(norms(tmp_path), rel=1e-2)
    val = {r["step"]: r["val_loss"] for r in rows(tmp_path) if "val_loss" in r and "event" not in r}
    val_ddp = {r["step"]: r["val_loss"] for r in log if "val_loss" in r and "event" not in r}
    assert val_ddp == pytest.approx(val, abs=2e-3)
    assert [r["val_tokens"] for r in log if "val_tokens" in r] == [r["val_tokens"] for r in rows(tmp_path)
                                                                   if "val_tokens" in r]


def test_ddp_resume_is_exact(ddp_run, tmp_path):
    first = run_cli(torchrun_cmd(tmp_path, *DDP, f"train.steps={N}"))
    assert first.returncode == 0, first.stderr[-4000:]
    trainer = ckpt.load(ckpt.latest(str(tmp_path / "checkpoints")), "trainer")
    assert trainer["world_size"] == 2 and len(trainer["data"]) == len(trainer["rng"]) == 2  # per rank
    second = run_cli(torchrun_cmd(tmp_path, *DDP, f"train.steps={2 * N}"))
    assert second.returncode == 0, second.stderr[-4000:]
    assert losses(tmp_path) == losses(ddp_run)
    assert_same_weights(weights(ckpt.latest(str(tmp_path / "checkpoints"))),
                        weights(ckpt.latest(str(ddp_run / "checkpoints"))))
