"""train.parallelism=fsdp: FSDP2 in the training loop, 2 processes with gloo on CPU (torchrun).

An FSDP2 run matches the DDP run of the same config: in fp32 to float rounding (measured: losses
within 2e-7, gradient norms within 2e-7 relative), in bf16-mixed within 1e-3 on the loss and 1% on
the gradient norm (measured: 3e-4 and 0.4%; FSDP2 computes with bf16 weights and a bf16 residual
stream where DDP's autocast keeps fp32 ones). Each rank holds half the optimizer state. Sharded
checkpoints (torch.distributed.checkpoint) resume bitwise on the same process count and continue on
another (2 -> 1, 1 -> 2); column-projection state is per rank: exact on the same count, fresh (with an
event) on another."""
import os
import shutil

import pytest
import torch

from _train_helpers import (TINY, assert_same_weights, failure, compose_cfg, losses, rows, run_cli,  # noqa: F401
                            run_inprocess, torchrun_cmd)
from train_utils import checkpoint as ckpt
from train_utils import sharded_checkpoint

pytestmark = pytest.mark.slow

N = 3
# Clipping on (the tiny model's gradient norm is ~2.5): the global norm over DTensor shards and the
# clipped update must match DDP's too.
RUN = ["train.micro_batch_size=2", "train.eval_every=3", "train.grad_clip=1.0"]
FSDP = RUN + ["train.parallelism=fsdp", "train.precision=bf16-mixed"]  # the runs["fsdp", "bf16-mixed"] it continues


def torchrun(run_dir, *overrides, nproc=2):
    proc = run_cli(torchrun_cmd(run_dir, *overrides, nproc=nproc))
    assert proc.returncode == 0, failure(proc)
    return run_dir


def train_rows(run_dir) -> list[dict]:
    return [r for r in rows(run_dir) if "loss" in r]


def checkpoint_weights(ckpt_dir) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, whole, whatever wrote them (DCP or torch.save)."""
    import models

    if not sharded_checkpoint.is_sharded(ckpt_dir):
        return ckpt.load(ckpt_dir, "model")
    model = models.build_model(compose_cfg(*TINY).model, vocab_size=512)  # the synthetic corpus's vocabulary
    sharded_checkpoint.load_model(ckpt_dir, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def model_weights(run_dir) -> dict[str, torch.Tensor]:
    """The weights of a run's latest checkpoint."""
    return checkpoint_weights(ckpt.latest(str(run_dir / "checkpoints")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2N steps on 2 processes: DDP and FSDP2, in fp32 and bf16-mixed."""
    out = {}
    for parallelism in ("ddp", "fsdp"):
        for precision in ("fp32", "bf16-mixed"):
            run_dir = tmp_path_factory.mktemp(f"{parallelism}_{precision}")
            out[parallelism, precision] = torchrun(run_dir, *RUN, f"train.parallelism={parallelism}",
                                                   f"train.precision={precision}", f"train.steps={2 * N}")
    return out


# fp32: reductions run in a different order over shards, so the norms drift apart by ~1e-5 relative
# after a few steps (measured 1.3e-5 at step 6); a wrong norm (one shard missed) is off by tens of %.
@pytest.mark.parametrize("precision, loss_tol, norm_tol", [("fp32", 1e-5, 1e-4), ("bf16-mixed", 1e-3, 1e-2)])
def test_fsdp_matches_ddp(runs, precision, loss_tol, norm_tol):
    ddp, fsdp = train_rows(runs["ddp", precision]), train_rows(runs["fsdp", precision])
    assert [r["step"] for r in fsdp] == [r["step"] for r in ddp] == list(range(1, 2 * N + 1))
    assert [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in ddp], abs=loss_tol)
    assert [r["grad_norm"] for r in fsdp] == pytest.approx([r["grad_norm"] for r in ddp], rel=norm_tol)
    start, end = rows(runs["fsdp", precision])[0], rows(runs["fsdp", precision])[-1]
    assert start["parallelism"] == "fsdp" and start["world_size"] == 2
    assert end["event"] == "end" and end["ranks_in_sync"] is None  # shards: no replicas to compare
    assert end["val_loss"] == pytest.approx(rows(runs["ddp", precision])[-1]["val_loss"], abs=loss_tol)
    if precision == "fp32":
        # Equal up to rounding, except where a gradient is ~0: there the two reduction orders may give
        # signSGD opposite signs, moving that one weight by up to 2 lr per step (lr 1e-3 here).
        fsdp_w, ddp_w = model_weights(runs["fsdp", precision]), model_weights(runs["ddp", precision])
        assert fsdp_w.keys() == ddp_w.keys()
        flips = total = 0
        for k in fsdp_w:
            diff = (fsdp_w[k] - ddp_w[k]).abs()
            assert diff.max() <= 2 * 1e-3 * 2 * N, f"{k}: {diff.max():.3g} is more than sign flips can explain"
            flips, total = flips + int((diff > 1e-5).sum()), total + diff.numel()
        # How many gradients sit near 0 depends on the trajectory: 688 of 935,040 weights (7.4e-4) with the
        # float64-drawn initial weights (models.build_model), under 1e-4 with the earlier fp32 draw.
        assert flips <= 2e-3 * total, f"{flips} of {total} weights differ by more than 1e-5"
    else:  # signSGD steps of lr 1e-3 may flip on ~0 gradients: at most 2 lr a step, as above
        assert_same_weights(model_weights(runs["fsdp", precision]), model_weights(runs["ddp", precision]),
                            exact=False, atol=2 * 1e-3 * 2 * N)


def test_optimizer_state_per_rank_is_half_of_ddps(runs):
    for precision in ("fp32", "bf16-mixed"):
        ddp = train_rows(runs["ddp", precision])[-1]["optimizer_state_bytes"]
        fsdp = train_rows(runs["fsdp", precision])[-1]["optimizer_state_bytes"]  # summed over the ranks
        end = rows(runs["fsdp", precision])[-1]
        assert abs(fsdp / ddp - 1.0) < 0.02 and end["optimizer_state_bytes"] == fsdp, (fsdp, ddp)
        assert abs(end["optimizer_state_bytes_rank0"] / ddp - 0.5) < 0.02, (end, ddp)  # rank 0's shards


def test_checkpoint_is_sharded_and_verified(runs):
    ckpt_dir = ckpt.latest(str(runs["fsdp", "bf16-mixed"] / "checkpoints"))
    assert sharded_checkpoint.is_sharded(ckpt_dir) and not os.path.exists(os.path.join(ckpt_dir, "model.pt"))
    names = set(__import__("json").load(open(os.path.join(ckpt_dir, ckpt.MANIFEST)))["files"])
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "trainer.pt", "config.yaml"} <= names
    assert ckpt.verify(ckpt_dir) is None
    with open(os.path.join(ckpt_dir, "dcp", "__1_0.distcp"), "r+b") as f:  # rank 1's shard, damaged
        f.seek(100)
        f.write(b"\xff" * 16)
    assert "__1_0.distcp does not match its checksum" in ckpt.verify(ckpt_dir)


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    """N steps of the bf16-mixed FSDP2 run on 2 processes (checkpoint at step N)."""
    return torchrun(tmp_path_factory.mktemp("fsdp_first_half"), *FSDP, f"train.steps={N}")


def continued(first_half, tmp_path, nproc):
    run_dir = tmp_path / "continued"
    shutil.copytree(first_half, run_dir)
    more = [*FSDP, f"train.steps={2 * N}", "train.resume_changes=[train.steps]"]
    if nproc == 1:
        assert run_inprocess(run_dir, *more) == 0
    else:
        torchrun(run_dir, *more, nproc=nproc)
    return run_dir


def test_resume_on_the_same_process_count_is_exact(runs, first_half, tmp_path):
    run_dir = continued(first_half, tmp_path, nproc=2)
    assert losses(run_dir) == losses(runs["fsdp", "bf16-mixed"])
    assert_same_weights(model_weights(run_dir), model_weights(runs["fsdp", "bf16-mixed"]))


def test_continue_on_one_process(runs, first_half, tmp_path):
    run_dir = continued(first_half, tmp_path, nproc=1)
    assert [(r["from"], r["to"]) for r in rows(run_dir) if r.get("event") == "world_size_changed"] == [(2, 1)]
    assert losses(run_dir) == pytest.approx(losses(runs["fsdp", "bf16-mixed"]), abs=2e-3)
    assert_same_weights(model_weights(run_dir), model_weights(runs["fsdp", "bf16-mixed"]), exact=False, atol=5e-3)


def test_continue_from_one_process_on_two(runs, tmp_path):
    run_dir = tmp_path / "one_then_two"
    assert run_inprocess(run_dir, *FSDP, f"train.steps={N}") == 0  # FSDP2 in one process: a group of one
    torchrun(run_dir, *FSDP, f"train.steps={2 * N}", "train.resume_changes=[train.steps]")
    assert [(r["from"], r["to"]) for r in rows(run_dir) if r.get("event") == "world_size_changed"] == [(1, 2)]
    assert losses(run_dir) == pytest.approx(losses(runs["fsdp", "bf16-mixed"]), abs=2e-3)


def test_activation_checkpointing_under_fsdp_recomputes_the_same(runs, tmp_path):
    run_dir = torchrun(tmp_path, *FSDP, f"train.steps={N}", "train.activation_checkpointing=true")
    assert rows(run_dir)[0]["activation_checkpointing"] is True
    reference = {s: v for s, v in losses(runs["fsdp", "bf16-mixed"]).items() if s <= N}
    assert losses(run_dir) == pytest.approx(reference, abs=1e-6)


# fp32: the claim is about the column state per rank, not bf16 (cheaper, on every CPU).
COLUMN = RUN + ["train.parallelism=fsdp", "train.precision=fp32", "optimizer.projection=column"]


def test_column_state_is_per_rank_exact_on_the_same_count_fresh_on_another(tmp_path):
    straight = torchrun(tmp_path / "straight", *COLUMN, f"train.steps={2 * N}")
    split = torchrun(tmp_path / "split", *COLUMN, f"train.steps={N}")
    first = ckpt.latest(str(split / "checkpoints"))
    assert {"rank00000.pt", "rank00001.pt"} <= set(os.listdir(first))
    shutil.copytree(split, tmp_path / "other_count")
    torchrun(split, *COLUMN, f"train.steps={2 * N}", "train.resume_changes=[train.steps]")
    assert losses(split) == losses(straight)
    assert not [r for r in rows(split) if r.get("event") == "optimizer_state_reset"]

    other = tmp_path / "other_count"
    assert run_inprocess(other, *COLUMN, f"train.steps={2 * N}", "train.resume_changes=[train.steps]") == 0
    (reset,) = [r for r in rows(other) if r.get("event") == "optimizer_state_reset"]
    assert reset["step"] == N and reset["tensors"] == 4 * 7  # every projectable weight of 4 layers
    assert all(abs(a - b) < 0.1 for a, b in zip(losses(other).values(), losses(straight).values()))


def test_parallelism_cannot_change_on_resume(first_half, tmp_path):
    from train_utils.validation import ConfigError

    run_dir = tmp_path / "ddp_now"
    shutil.copytree(first_half, run_dir)
    # Without naming the key: the message must not suggest train.resume_changes, which cannot help.
    with pytest.raises(ConfigError, match="train.parallelism=fsdp") as err:
        run_inprocess(run_dir, *RUN, f"train.steps={2 * N}", "train.resume_changes=[train.steps]")
    assert "resume_changes" not in str(err.value)
    with pytest.raises(ConfigError, match="train.parallelism=fsdp"):
        run_inprocess(run_dir, *RUN, f"train.steps={2 * N}", "train.resume_changes=[train.steps,train.parallelism]")


def test_named_model_change_on_a_sharded_checkpoint_is_one_line(first_half, tmp_path):
    """DCP's failed load is a BaseException (CheckpointException): still the one-line ConfigError."""
    from train_utils.validation import ConfigError

    run_dir = tmp_path / "wider"
    shutil.copytree(first_half, run_dir)
    with pytest.raises(ConfigError, match="cannot apply train.resume_changes"):
        run_inprocess(run_dir, *FSDP, f"train.steps={2 * N}", "model.intermediate_size=96",
                      "train.resume_changes=[train.steps,model.intermediate_size]")


def test_growing_update_gap_is_refused_under_fsdp_before_training(tmp_path):
    """Its windows depend on the losses, which a sharded checkpoint cannot restore before loading:
    such a run would train and write checkpoints it can never resume from."""
    from train_utils.validation import ConfigError

    with pytest.raises(ConfigError, match="update_gap_growth=2.0"):
        run_inprocess(tmp_path, *FSDP, "train.steps=1", "optimizer.update_gap_growth=2.0")
    assert not os.path.exists(tmp_path / "checkpoints")


def test_eval_reads_a_sharded_checkpoint(runs):
    import eval as evaluate

    run_dir = runs["fsdp", "fp32"]
    result = evaluate.main([f"checkpoint={run_dir}", f"out={run_dir / 'eval.json'}"])
    assert result["step"] == 2 * N
    assert result["val_loss"] == pytest.approx(rows(run_dir)[-1]["val_loss"], abs=1e-6)


def test_svd_under_fsdp_is_refused_before_training(tmp_path):
    from frugal import HyperparameterError

    with pytest.raises(HyperparameterError, match="FSDP2"):
        run_inprocess(tmp_path, *FSDP, "train.steps=1", "optimizer=galore",
                      base=[o for o in TINY if not o.startswith("optimizer")])
    assert not os.path.exists(tmp_path / "checkpoints")


def test_disk_full_during_a_sharded_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """A rank's DCP write fails with ENOSPC in the second checkpoint: one line naming the previous,
    intact checkpoint, no temporary left (FSDP2 in one process: the same code path as N ranks)."""
    import contextlib
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and ckpt.step_dir_name(4) in str(path) and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    with pytest.raises(ckpt.CheckpointError) as err:
        run_inprocess(tmp_path, *FSDP, "train.steps=4", "checkpoint.every=2")
    root = str(tmp_path / "checkpoints")
    previous = os.path.join(root, ckpt.step_dir_name(2))
    failed = os.path.join(root, ckpt.step_dir_name(4), sharded_checkpoint.SHARDED_DIR)
    assert str(err.value) == (f"no space left on device while writing {failed}; "
                              f"the previous checkpoint {previous} is intact")
    assert sorted(os.listdir(root)) == [ckpt.LAST_GOOD, ckpt.LATEST, ckpt.step_dir_name(2)]
    assert ckpt.latest(root) == previous and ckpt.verify(previous) is None


def test_nonfinite_shards_are_never_checkpointed(tmp_path):
    from train_utils.loop import NonFiniteError

    with pytest.raises(NonFiniteError) as err:
        run_inprocess(tmp_path, *FSDP, "train.steps=10", "optimizer.lr=1e6", "checkpoint.every=1",
                      "checkpoint.keep=20")
    written = ckpt.list_checkpoints(str(tmp_path / "checkpoints"))
    assert written and f"Last checkpoint from before the divergence: {written[0]}" in str(err.value)  # lr 0 at step 1
    for ckpt_dir in written:
        assert all(t.isfinite().all() for t in checkpoint_weights(ckpt_dir).values()), ckpt_dir


def test_damaged_shard_falls_back_to_the_newest_intact_checkpoint(tmp_path):
    reference = tmp_path / "reference"
    assert run_inprocess(reference, *FSDP, f"train.steps={2 * N}") == 0
    run_dir = tmp_path / "damaged"
    assert run_inprocess(run_dir, *FSDP, f"train.steps={N}", "checkpoint.every=1", "checkpoint.keep=3") == 0
    latest = ckpt.latest(str(run_dir / "checkpoints"))
    with open(os.path.join(latest, "dcp", "__0_0.distcp"), "r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 64)
    assert run_inprocess(run_dir, *FSDP, f"train.steps={2 * N}", "train.resume_changes=[train.steps]") == 0
    assert os.path.isdir(latest + ckpt.DAMAGED_SUFFIX)  # set aside, named
    assert losses(run_dir) == losses(reference)  # redid step N from step N - 1: bitwise the same run


def test_pure_bf16_and_compiled_blocks_under_fsdp(tmp_path):
    """Pure bf16 shards (no mixed-precision policy: computed and reduced in bf16, as DDP does), and
    compiled blocks with activation checkpointing under fully_shard, agree with the eager run."""
    # 16 validation rows of 63 scored tokens: 8 whole micro-batches of 2. TINY's 1024 tokens take a 17th row,
    # a micro-batch of 1 that recompiles the blocks and the loss for a dynamic batch size (8 graphs, not 5).
    steps = ["train.steps=3", "train.eval_tokens=1008"]
    assert run_inprocess(tmp_path / "eager", *FSDP, *steps) == 0
    assert run_inprocess(tmp_path / "compiled", *FSDP, *steps, "train.compile=true",
                         "train.activation_checkpointing=true") == 0
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), abs=2e-3)
    assert run_inprocess(tmp_path / "bf16", *FSDP, *steps, "train.precision=bf16") == 0
    assert losses(tmp_path / "bf16") == pytest.approx(losses(tmp_path / "eager"), abs=2e-2)
    from torch.distributed.checkpoint import FileSystemReader

    saved = os.path.join(ckpt.latest(str(tmp_path / "bf16" / "checkpoints")), sharded_checkpoint.SHARDED_DIR)
    metadata = FileSystemReader(saved).read_metadata().state_dict_metadata
    assert metadata["model.lm_head.weight"].properties.dtype == torch.bfloat16  # the shards are bf16
