"""train.optimizer_in_backward=true: train.py with FRUGAL's step inside backward (frugal.in_backward)
against the ordinary step: the same run (gradient accumulation, clipping, block switches), exact
resume, FSDP2 on 2 processes, a late non-finite gradient, and the settings it refuses."""
import os
import re

import pytest
import torch

import train
from _train_helpers import (assert_same_weights, compose_cfg, failure, losses, rows, run_cli, run_inprocess,
                            torchrun_cmd, weights, TINY)
from train_utils import checkpoint as ckpt
from train_utils import startup
from train_utils.loop import NonFiniteError
from train_utils.validation import ConfigError, check_in_backward

# fp32 (the comparison is to float rounding), clipping on (the tiny model's norm is ~2.5), TINY's
# 2 micro-batches per step and update gap 3: 7 steps cross two block switches.
RUN = ["train.precision=fp32", "train.grad_clip=1.0", "train.steps=7"]
IN_BACKWARD = "train.optimizer_in_backward=true"
LR = 1e-3  # TINY's optimizer lr (configs/optimizer/frugal.yaml)


def final_weights(run_dir):
    return weights(ckpt.latest(os.path.join(run_dir, ckpt.CHECKPOINT_DIR)))


def train_rows(run_dir):
    return [r for r in rows(run_dir) if "loss" in r]


def assert_equal_up_to_sign_flips(a: dict, b: dict, steps: int):
    """Equal up to rounding, except where a gradient is ~0: there two roundings of the clipping norm
    may give signSGD opposite signs, moving that one weight by up to 2 lr per step."""
    assert a.keys() == b.keys()
    flips = total = 0
    for k in a:
        diff = (a[k] - b[k]).abs()
        assert diff.max() <= 2 * LR * steps, f"{k}: {diff.max():.3g} is more than sign flips can explain"
        flips, total = flips + int((diff > 1e-5).sum()), total + diff.numel()
    assert flips <= 1e-4 * total, f"{flips} of {total} weights differ by more than 1e-5"


@pytest.fixture(scope="module")
def ordinary(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ordinary")
    assert run_inprocess(run_dir, *RUN) == 0
    return run_dir


@pytest.fixture(scope="module")
def in_backward(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("in_backward")
    assert run_inprocess(run_dir, *RUN, IN_BACKWARD) == 0
    return run_dir


def test_equals_the_ordinary_step(ordinary, in_backward):
    ref, got = train_rows(ordinary), train_rows(in_backward)
    assert [r["step"] for r in got] == list(range(1, 8))
    # one norm formula and order in both schedules (frugal.grad_norm): the same run, bit for bit
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]
    assert min(r["grad_norm"] for r in ref) > 1.0  # clipping changed every step
    assert [r["lr"] for r in got] == [r["lr"] for r in ref]  # the schedule's lr at every step
    switches = [r["step"] for r in rows(in_backward) if r.get("event") == "switch"]
    assert switches == [r["step"] for r in rows(ordinary) if r.get("event") == "switch"] and len(switches) >= 3
    assert_same_weights(final_weights(in_backward), final_weights(ordinary))
    assert rows(in_backward)[-1]["val_loss"] == rows(ordinary)[-1]["val_loss"]
    # the start row and the console say which step ran
    assert rows(in_backward)[0]["optimizer_in_backward"] is True and rows(ordinary)[0]["optimizer_in_backward"] is False
    assert "fp32, ddp, optimizer step inside backward; planned memory" in (in_backward / "train.log").read_text()
    assert "inside backward" not in (ordinary / "train.log").read_text()


@pytest.mark.slow
def test_resume_is_exact(in_backward, tmp_path):
    assert run_inprocess(tmp_path, *RUN, IN_BACKWARD, "train.steps=4") == 0
    assert run_inprocess(tmp_path, *RUN, IN_BACKWARD, "train.resume_changes=[train.steps]") == 0
    assert losses(tmp_path) == losses(in_backward)
    assert_same_weights(final_weights(tmp_path), final_weights(in_backward))


@pytest.mark.slow
def test_a_late_non_finite_gradient_stops_the_run_says_what_moved_and_the_remedy_works(tmp_path, monkeypatch):
    """Step 3's last backward gives layer 0 (the last tensors of backward) a NaN gradient: the
    tensors before it in backward have taken step 3. The run stops, says so, writes nothing from
    those weights, and the remedy it prints, followed literally, trains to the end."""
    real_build = startup.build_model
    calls = {"n": 0}

    def build_model(run):
        out = real_build(run)

        def poison(grad):
            calls["n"] += 1
            return grad * float("nan") if calls["n"] == 6 else grad  # step 3, its 2nd micro-batch

        out[0].model.layers[0].mlp.down_proj.weight.register_hook(poison)
        return out

    monkeypatch.setattr(startup, "build_model", build_model)
    job = [*RUN, IN_BACKWARD, "checkpoint.every=1", "checkpoint.keep=5"]
    with pytest.raises(NonFiniteError) as err:
        run_inprocess(tmp_path, *job)
    message = str(err.value)
    moved = int(re.search(r"with the step inside backward, (\d+) tensors had already taken it", message).group(1))
    assert moved > 0 and "nothing was saved from them" in message and "at step 3" in message, message
    root = os.path.join(tmp_path, ckpt.CHECKPOINT_DIR)
    written = ckpt.list_checkpoints(root)
    assert [os.path.basename(c) for c in written] == [ckpt.step_dir_name(1), ckpt.step_dir_name(2)]
    assert all(t.isfinite().all() for c in written for t in ckpt.load(c, "model").values())
    assert max(r["step"] for r in train_rows(tmp_path)) == 2
    remedy = re.search(r"run the same command with (.*?) \(", message).group(1).split()
    assert remedy[0].startswith("train.resume=")
    assert run_inprocess(tmp_path, *job, *remedy) == 0
    assert rows(tmp_path)[-1]["event"] == "end"


def test_refused_under_ddp_and_for_optimizers_not_built_on_frugal(tmp_path):
    cfg = compose_cfg(*TINY, IN_BACKWARD)
    with pytest.raises(ConfigError, match="cannot run under DDP \\(2 processes\\).*use train.parallelism=fsdp"):
        check_in_backward(cfg, 2)
    check_in_backward(cfg, 1)  # one process: nothing to reduce
    check_in_backward(compose_cfg(*TINY, IN_BACKWARD, "train.parallelism=fsdp"), 2)
    with pytest.raises(ConfigError, match="update_gap_growth=2.0: the plateau-grown gap .*valid choices: optimizer."
                                          "update_gap_growth=1.0 or train.optimizer_in_backward=false"):
        check_in_backward(compose_cfg(*TINY, IN_BACKWARD, "optimizer.update_gap_growth=2.0"), 1)
    with pytest.raises(ConfigError, match="optimizer.name='adamw' is not built on FRUGAL; valid choices: .*frugal"):
        run_inprocess(tmp_path, IN_BACKWARD, "optimizer=adamw",
                      base=[o for o in TINY if not o.startswith("optimizer.")])
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))  # refused before the first step


@pytest.mark.slow
def test_fsdp2_on_two_processes_equals_the_ordinary_step(tmp_path):
    """The hooks of FSDP2's sharded parameters fire after the reduce-scatter: each rank updates its
    shard from the reduced gradient, and the norm's partial sums are all-reduced once. (Two processes
    read another split of the data than one, so the reference is the ordinary step on two.)"""
    fsdp = [*RUN, "train.parallelism=fsdp", "train.micro_batch_size=2"]  # accumulation 2 on each rank
    for name, extra in (("ordinary", []), ("in_backward", [IN_BACKWARD])):
        proc = run_cli(torchrun_cmd(tmp_path / name, *fsdp, *extra))
        assert proc.returncode == 0, failure(proc)
    ref, got = train_rows(tmp_path / "ordinary"), train_rows(tmp_path / "in_backward")
    assert [r["step"] for r in got] == list(range(1, 8))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)
    from test_fsdp_train import model_weights

    assert_equal_up_to_sign_flips(model_weights(tmp_path / "in_backward"), model_weights(tmp_path / "ordinary"), 7)
