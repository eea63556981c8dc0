"""Bad state is never used silently, changed settings are refused or applied for real, and every
failure ends with one clear line (issue: reliability). In-process runs of the tiny config; the
subprocess cases (signals, a file-size limit, a frozen rank) are in test_faults.py."""
import errno
import json
import math
import os
import re
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from _train_helpers import (assert_same_weights, losses, rows, run_inprocess,  # noqa: F401
                            weights)
from train_utils import checkpoint as ckpt
from train_utils import resume
from train_utils.validation import ConfigError
from train_utils.loop import NonFiniteError
from train_utils.metrics import read_metrics

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite, not the fast tier

STEPS = 6
EVERY = ["checkpoint.every=2", "checkpoint.keep=3"]


def _root(run_dir) -> str:
    return os.path.join(run_dir, ckpt.CHECKPOINT_DIR)


def _final_weights(run_dir):
    return weights(ckpt.latest(_root(run_dir)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_inprocess(run_dir, f"train.steps={STEPS}") == 0
    return run_dir


# ------------------------------------------------------------------------------ non-finite state
def test_nonfinite_step_is_never_applied_nor_checkpointed(tmp_path):
    """lr=1e6 breaks the weights at step 2 while its loss is still finite; step 3's gradients are
    NaN. The old loop applied that step and wrote a checkpoint of NaN weights as the 'last good' one."""
    with pytest.raises(NonFiniteError) as err:
        run_inprocess(tmp_path, "train.steps=10", "optimizer.lr=1e6", "checkpoint.every=1", "checkpoint.keep=20")
    written = ckpt.list_checkpoints(_root(tmp_path))
    assert written, "the first steps were finite and checkpointed"
    for c in written:
        model, opt = ckpt.load(c, "model"), ckpt.load(c, "optimizer")
        assert all(t.isfinite().all() for t in model.values()), c
        assert all(t.isfinite().all() for s in opt["state"].values() for t in s.values()
                   if torch.is_tensor(t) and t.is_floating_point()), c
    message = str(err.value)
    assert f"at step {len(written) + 1}" in message
    assert max(r["step"] for r in rows(tmp_path) if "loss" in r) == len(written)
    # Step 1 ran at the warm-up's lr 0: checkpoint 1 holds the initial weights, and step 2's loss on them
    # was healthy; checkpoint 2 (after the first 1e6 update) gives NaN gradients. The old message named 2.
    first = os.path.join(_root(tmp_path), ckpt.step_dir_name(1))
    assert f"Last checkpoint from before the divergence: {first} (kept" in message, message
    remedy = re.search(r"run the same command with (.*?) \(", message).group(1).split()
    assert remedy == [f"train.resume={first}", "optimizer.lr=0.001", "train.resume_changes=[optimizer.lr]"]
    assert run_inprocess(tmp_path, "train.steps=10", "optimizer.lr=1e6", "checkpoint.every=1", "checkpoint.keep=20",
                         *remedy) == 0
    assert rows(tmp_path)[-1]["event"] == "end"


def test_with_no_checkpoint_before_the_divergence_the_message_says_how_to_start_over(tmp_path):
    from train_utils.divergence import LossWatch

    cfg = OmegaConf.create({"optimizer": {"name": "adamw", "lr": 1e6}, "train": {"resume_changes": []}})
    watch = LossWatch(str(tmp_path), True, cfg, resumed_from=None)
    watch.check(1, 6.0, 1.0)
    watch.saved(str(tmp_path / ckpt.step_dir_name(1)))
    watch.check(2, 600.0, 1.0)  # a spike: checkpoint 1 is not confirmed
    with pytest.raises(NonFiniteError) as err:
        watch.check(3, float("nan"), 1.0)
    assert "The loss first spiked at step 2 (600, over 3x the running median 6)" in str(err.value)
    assert ("No checkpoint from before the divergence exists. Start over in a new run dir with a lower learning "
            "rate: the same command with hydra.run.dir=<new dir> optimizer.lr=0.001 ") in str(err.value)
    assert ckpt.last_good(str(tmp_path)) is None


def test_a_resume_from_another_runs_checkpoint_confirms_nothing_of_its(tmp_path):
    """train.resume=<another run dir's checkpoint> into a fresh run dir: the healthy first loss must
    not point this run's last_good at the other run's checkpoint (it raised FileNotFoundError on a
    missing checkpoints/ directory of the new run, the preflight's resume check)."""
    assert run_inprocess(tmp_path / "a", "train.steps=2", "checkpoint.every=2") == 0
    two = os.path.join(_root(tmp_path / "a"), ckpt.step_dir_name(2))
    assert run_inprocess(tmp_path / "b", "train.steps=4", f"train.resume={two}",
                         "train.resume_changes=[train.steps]") == 0
    assert ckpt.last_good(_root(tmp_path / "b")) != two


def test_divergence_names_and_keeps_the_checkpoint_from_before_it(tmp_path):
    """4 healthy steps, then optimizer.lr=1e6 (named on resume): the weights of every checkpoint
    written after the first 1e6 update are finite but diverged, and a resume from them fails again.
    The message names the checkpoint from before the spike (step 4, whose next loss was healthy),
    which checkpoint.keep=1 has not removed, and its remedy, followed literally, trains to the end."""
    keep = ["checkpoint.every=1", "checkpoint.keep=1"]
    assert run_inprocess(tmp_path, "train.steps=4", *keep) == 0
    diverging = ["train.steps=12", *keep, "optimizer.lr=1e6", "train.resume_changes=[optimizer.lr,train.steps]"]
    with pytest.raises(NonFiniteError) as err:
        run_inprocess(tmp_path, *diverging)
    message, four = str(err.value), os.path.join(_root(tmp_path), ckpt.step_dir_name(4))
    assert f"Last checkpoint from before the divergence: {four} (kept" in message, message
    assert ckpt.last_good(_root(tmp_path)) == four and ckpt.verify(four) is None
    assert ckpt.latest(_root(tmp_path)) != four  # what the old message named: finite, diverged
    remedy = re.search(r"run the same command with (.*?) \(", message).group(1).split()
    assert remedy == [f"train.resume={four}", "optimizer.lr=0.001", "train.resume_changes=[optimizer.lr,train.steps]"]
    assert run_inprocess(tmp_path, *diverging, *remedy) == 0
    start = [r for r in rows(tmp_path) if r.get("event") == "start"][-1]
    assert start["resumed_from"] == four and rows(tmp_path)[-1]["event"] == "end"
    assert all(math.isfinite(r["loss"]) for r in rows(tmp_path) if "loss" in r)


def test_a_spike_right_after_a_resume_is_caught_as_in_the_uninterrupted_run(tmp_path, monkeypatch):
    """Step 5's loss spikes (x100) and step 6's is NaN, in one run of 8 steps and in one stopped after
    step 4 and resumed: both stop with the same message, naming checkpoint 3 as the last from before
    the divergence and step 5 as where it began. The resumed run's window used to start empty, so
    step 5's loss was taken as it was and confirmed checkpoint 4, whose weights gave the spike."""
    from train_utils import divergence

    real = divergence.LossWatch.check

    def check(self, step, loss, grad_norm, moved=0):
        return real(self, step, {5: loss * 100, 6: float("nan")}.get(step, loss), grad_norm, moved)

    monkeypatch.setattr(divergence.LossWatch, "check", check)
    job = ["checkpoint.every=1", "checkpoint.keep=2"]
    messages = {}
    for name in ("uninterrupted", "resumed"):
        run_dir = tmp_path / name
        if name == "resumed":
            assert run_inprocess(run_dir, "train.steps=4", *job) == 0
        with pytest.raises(NonFiniteError) as err:
            run_inprocess(run_dir, "train.steps=8", *job, *(["train.resume_changes=[train.steps]"]
                                                             if name == "resumed" else []))
        three = os.path.join(_root(run_dir), ckpt.step_dir_name(3))
        assert ckpt.last_good(_root(run_dir)) == three
        messages[name] = str(err.value).replace(str(run_dir), "<run dir>")
    assert "The loss first spiked at step 5 (" in messages["uninterrupted"], messages["uninterrupted"]
    # the same but for the resume's own named change, which its remedy repeats
    assert messages["resumed"].replace("resume_changes=[train.steps,", "resume_changes=[") == messages["uninterrupted"]


def test_checkpoint_with_nonfinite_state_is_refused(tmp_path):
    from types import SimpleNamespace

    from accelerate import Accelerator

    from train_utils.run import Run

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert ckpt.nonfinite_state(model, opt) is None
    opt.state[model[1].weight]["exp_avg_sq"][0, 0] = float("nan")
    assert ckpt.nonfinite_state(model, opt) == "optimizer state 'exp_avg_sq' of 1.weight"
    with torch.no_grad():
        model[0].bias[1] = float("inf")
    assert ckpt.nonfinite_state(model, opt) == "weight 0.bias"
    run = Run(OmegaConf.create({"checkpoint": {"keep": 2}}), str(tmp_path), Accelerator(cpu=True), accum=1, tf32=False)
    run.raw_model, run.optimizer, run.dm = model, opt, SimpleNamespace(state_dict=dict)
    with pytest.raises(NonFiniteError, match="non-finite values in weight 0.bias after step 7; no checkpoint written"):
        resume.save_checkpoint(run, 7, tokens=0)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------ damaged checkpoints
def _flip_bytes(path, n=64):
    data = bytearray(open(path, "rb").read())
    middle = len(data) // 2
    for i in range(middle, middle + n):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _random_block(path, n=4096):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3:len(data) // 3 + n] = os.urandom(n)
    open(path, "wb").write(bytes(data))


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


DAMAGE = {
    "flipped bytes in model.pt": lambda c: _flip_bytes(os.path.join(c, "model.pt")),
    "4 KiB of random bytes in optimizer.pt": lambda c: _random_block(os.path.join(c, "optimizer.pt")),
    "truncated trainer.pt": lambda c: _truncate(os.path.join(c, "trainer.pt")),
    "missing optimizer.pt": lambda c: os.remove(os.path.join(c, "optimizer.pt")),
    "missing manifest": lambda c: os.remove(os.path.join(c, ckpt.MANIFEST)),
    "empty latest": lambda c: open(os.path.join(os.path.dirname(c), ckpt.LATEST), "w").close(),
    "garbled latest": lambda c: open(os.path.join(os.path.dirname(c), ckpt.LATEST), "wb").write(b"\x00\xffstep_9"),
    "missing latest": lambda c: os.remove(os.path.join(os.path.dirname(c), ckpt.LATEST)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, reference, damage):
    """A finished run (checkpoints 2, 4, 6) whose newest checkpoint is damaged, started again: it
    says what it skipped and why, continues from the newest intact checkpoint and ends exactly as the
    reference; a damaged pointer alone costs nothing (the newest checkpoint is found without it)."""
    assert run_inprocess(tmp_path, f"train.steps={STEPS}", *EVERY) == 0
    newest = ckpt.latest(_root(tmp_path))
    assert newest.endswith(ckpt.step_dir_name(STEPS))
    DAMAGE[damage](newest)
    assert run_inprocess(tmp_path, f"train.steps={STEPS}", *EVERY) == 0
    assert losses(tmp_path) == losses(reference)
    assert_same_weights(_final_weights(tmp_path), _final_weights(reference))
    assert ckpt.verify(ckpt.latest(_root(tmp_path))) is None
    log = (tmp_path / "train.log").read_text()
    if "latest" in damage:
        assert "this run has already finished" in log
        if damage != "missing latest":
            assert "skipped a damaged checkpoint" in log and "`latest` pointer" in log
    else:
        start = [r for r in rows(tmp_path) if r.get("event") == "start"][-1]
        assert start["resumed_from"].endswith(ckpt.step_dir_name(4))
        assert f"skipped a damaged checkpoint: {newest}: " in log, log
        assert os.path.isdir(newest + ckpt.DAMAGED_SUFFIX)  # kept for inspection, out of the way


def test_all_checkpoints_damaged_is_an_error_not_a_fresh_start(tmp_path):
    assert run_inprocess(tmp_path, "train.steps=4", *EVERY) == 0
    for c in ckpt.list_checkpoints(_root(tmp_path)):
        _flip_bytes(os.path.join(c, "model.pt"))
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint in .*model.pt does not match its checksum"):
        run_inprocess(tmp_path, "train.steps=4", *EVERY)


def test_eval_refuses_a_damaged_checkpoint(tmp_path):
    import eval as evaluate_ckpt

    assert run_inprocess(tmp_path, "train.steps=2", "checkpoint.every=1") == 0
    newest = ckpt.latest(_root(tmp_path))
    _flip_bytes(os.path.join(newest, "model.pt"))
    with pytest.raises(ckpt.CheckpointError, match="model.pt does not match its checksum"):
        evaluate_ckpt.main([f"checkpoint={newest}"])
    result = evaluate_ckpt.main([f"checkpoint={tmp_path}"])  # a run dir: its newest intact checkpoint
    assert result["step"] == 1


# ------------------------------------------------------------------------------ metrics.jsonl, finished runs
def test_partial_last_metrics_line_is_dropped(tmp_path, reference):
    """Killed after a disk-full append cut the last line short, before the final checkpoint (its
    removal simulates that): the next start resumes from step 4 and drops the partial line."""
    assert run_inprocess(tmp_path, f"train.steps={STEPS}", *EVERY) == 0
    shutil.rmtree(os.path.join(_root(tmp_path), ckpt.step_dir_name(STEPS)))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.2')
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["event"] == "end"  # the partial line is left out
    assert run_inprocess(tmp_path, f"train.steps={STEPS}", *EVERY) == 0
    assert losses(tmp_path) == losses(reference)
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_read_metrics_reports_a_bad_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def _snapshot(run_dir):
    files = {}
    for root, _, names in os.walk(run_dir):
        for n in names:
            if n not in ("train.log", "run.lock"):  # the console's log and who holds the run dir
                p = os.path.join(root, n)
                files[p] = (os.path.getsize(p), os.stat(p).st_mtime_ns)
    return files


def test_finished_run_started_again_writes_nothing(tmp_path, capsys):
    assert run_inprocess(tmp_path, "train.steps=3") == 0
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert run_inprocess(tmp_path, "train.steps=3") == 0
    assert "this run has already finished" in capsys.readouterr().out
    assert _snapshot(tmp_path) == before
    assert [r["event"] for r in rows(tmp_path) if r.get("event") in ("start", "end")] == ["start", "end"]


def test_kill_after_the_final_checkpoint_completes_only_the_report(tmp_path):
    """Killed between the final checkpoint and the end row (simulated by dropping the end row): the
    next start writes the end row once, without a second evaluation row or more training."""
    assert run_inprocess(tmp_path, "train.steps=3") == 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["event"] == "end"
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:-1]))
    assert run_inprocess(tmp_path, "train.steps=3") == 0
    log = rows(tmp_path)
    assert [r["step"] for r in log if "val_loss" in r and "event" not in r] == [3]
    assert [r["step"] for r in log if r.get("event") == "end"] == [3]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]


# ------------------------------------------------------------------------------ changed settings
def test_changed_settings_are_refused_with_the_list_of_keys(tmp_path):
    assert run_inprocess(tmp_path, "train.steps=4", *EVERY) == 0
    with pytest.raises(ConfigError) as err:
        run_inprocess(tmp_path, "train.steps=8", *EVERY, "optimizer.density=0.5", "optimizer.lr=0.003")
    message = str(err.value)
    for text in ("optimizer.density: 0.25 -> 0.5", "optimizer.lr: 0.001 -> 0.003", "train.steps: 4 -> 8",
                 "train.resume_changes=[optimizer.density,optimizer.lr,train.steps]"):
        assert text in message, message
    # Cadence of logging, evaluation and checkpoints may change freely (and so may wandb).
    assert run_inprocess(tmp_path, "train.steps=4", "checkpoint.every=3", "train.log_every=2", "train.eval_every=2",
                         "train.eval_tokens=512") == 0
    with pytest.raises(ConfigError, match="names 'optimizer.lrr', which is not a key"):
        run_inprocess(tmp_path, "train.steps=8", *EVERY, "train.resume_changes=[optimizer.lrr]")


def test_named_changes_are_applied_for_real(tmp_path):
    """density 0.25 -> 0.5 and lr 1e-3 -> 3e-3 on resume: the optimizer's groups take the new values,
    the schedule is rebuilt from the new peak lr (rows show it), and the change is an event."""
    assert run_inprocess(tmp_path, "train.steps=4", *EVERY) == 0
    assert run_inprocess(tmp_path, "train.steps=8", *EVERY, "optimizer.density=0.5", "optimizer.lr=0.003",
                         "train.resume_changes=[optimizer.density,optimizer.lr,train.steps]") == 0
    log = rows(tmp_path)
    event = next(r for r in log if r.get("event") == "resume_changes")
    assert event["step"] == 4 and event["changes"] == {"optimizer.density": [0.25, 0.5], "optimizer.lr": [0.001, 0.003],
                                                       "train.steps": [4, 8]}
    # Same schedule shape (restarts of 8 steps, see TINY), so the lr of a step scales with the peak.
    fresh = tmp_path / "fresh"
    assert run_inprocess(fresh, "train.steps=8", "optimizer.lr=0.003", "optimizer.density=0.5") == 0
    lr_new = {r["step"]: r["lr"] for r in rows(fresh) if "lr" in r}
    lr_resumed = {r["step"]: r["lr"] for r in log if "lr" in r}
    assert [lr_resumed[s] for s in range(5, 9)] == pytest.approx([lr_new[s] for s in range(5, 9)], rel=1e-12)
    assert [r["state_full_fraction"] for r in log if "loss" in r and r["step"] > 4] == [0.5] * 4
    opt = ckpt.load(ckpt.latest(_root(tmp_path)), "optimizer")
    assert {g["density"] for g in opt["param_groups"] if "density" in g} == {0.5}
    config = (tmp_path / "checkpoints" / ckpt.step_dir_name(8) / "config.yaml").read_text()
    assert "density: 0.5" in config and "lr: 0.003" in config


def test_a_bug_while_loading_a_checkpoint_keeps_its_traceback(tmp_path, monkeypatch):
    """Only a load that fails because of a model/optimizer change the user named gets the one-line
    ConfigError; the same failure on a plain resume is a bug and surfaces as itself."""
    import frugal

    assert run_inprocess(tmp_path, "train.steps=2", *EVERY) == 0

    def broken(self, state_dict):
        raise KeyError("a bug in load_state_dict")

    monkeypatch.setattr(frugal.FRUGAL, "load_state_dict", broken)
    with pytest.raises(KeyError, match="a bug in load_state_dict"):
        run_inprocess(tmp_path, "train.steps=4", *EVERY, "train.resume_changes=[train.steps]")
    with pytest.raises(ConfigError, match="cannot apply train.resume_changes"):
        run_inprocess(tmp_path, "train.steps=4", *EVERY, "optimizer.lr=0.002",
                      "train.resume_changes=[train.steps,optimizer.lr]")


# ------------------------------------------------------------------------------ disk full
def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """Writes into the second checkpoint fail with ENOSPC part-way through a file."""
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 100_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode and ckpt.step_dir_name(4) in str(path) else f

    monkeypatch.setattr(ckpt, "open", open_on_a_full_disk, raising=False)
    with pytest.raises(ckpt.CheckpointError) as err:
        run_inprocess(tmp_path, f"train.steps={STEPS}", *EVERY)
    previous = os.path.join(_root(tmp_path), ckpt.step_dir_name(2))
    failed = os.path.join(_root(tmp_path), ckpt.step_dir_name(4), "model.pt")
    assert str(err.value) == (f"no space left on device while writing {failed}; "
                              f"the previous checkpoint {previous} is intact")
    assert sorted(os.listdir(_root(tmp_path))) == [ckpt.LAST_GOOD, ckpt.LATEST, ckpt.step_dir_name(2)]  # no temporaries
    assert ckpt.latest(_root(tmp_path)) == previous and ckpt.verify(previous) is None


# ------------------------------------------------------------------------------ signals at the end
def test_signal_during_or_after_the_last_step_lets_the_run_finish(tmp_path, monkeypatch):
    """A stop signal that arrives during the final step (and another after the final checkpoint):
    nothing is left to save for later, so the run finishes normally (end row, exit 0), not 75."""
    import signal

    import train

    real_save = resume.save_checkpoint

    def save_then_signal(*args, **kwargs):
        path = real_save(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # after the final checkpoint
        return path

    real_forward_backward = train.forward_backward

    def signal_in_last_step(model, batches, accelerator, precision, loss_fn=None, accumulating=None):
        out = real_forward_backward(model, batches, accelerator, precision, loss_fn, accumulating)
        if len([r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]) == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # during step 3 of 3
        return out

    monkeypatch.setattr(train, "forward_backward", signal_in_last_step)
    monkeypatch.setattr(resume, "save_checkpoint", save_then_signal)
    assert run_inprocess(tmp_path, "train.steps=3") == 0
    assert rows(tmp_path)[-1]["event"] == "end"
    assert not [r for r in rows(tmp_path) if r.get("event") == "preempted"]


# ------------------------------------------------------------------------------ memory-mapped loads
def test_checkpoints_load_memory_mapped(tmp_path):
    ckpt.save(str(tmp_path), 1, {"model": {"w": torch.arange(1_000_000, dtype=torch.float32)}})
    path = os.path.join(ckpt.latest(str(tmp_path)), "model.pt")
    state = ckpt.load(ckpt.latest(str(tmp_path)), "model")
    with open("/proc/self/maps") as f:
        assert path in f.read(), "model.pt is not mapped into memory"
    assert torch.equal(state["w"], torch.arange(1_000_000, dtype=torch.float32))


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    import hashlib

    final = ckpt.save(str(tmp_path), 3, {"model": {"w": torch.ones(10)}}, texts={"config.yaml": "a: 1\n"})
    manifest = json.loads(open(os.path.join(final, ckpt.MANIFEST)).read())
    assert manifest["step"] == 3 and set(manifest["files"]) == {"model.pt", "config.yaml"}
    for name, entry in manifest["files"].items():
        data = open(os.path.join(final, name), "rb").read()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert ckpt.verify(final) is None
    shutil.copy(os.path.join(final, "config.yaml"), os.path.join(final, "model.pt"))
    assert "model.pt has" in ckpt.verify(final)


def _with_entry(final, name, data: bytes) -> None:
    """Add `name` to the checkpoint's manifest with the size and checksum of `data`."""
    import hashlib

    path = os.path.join(final, ckpt.MANIFEST)
    manifest = json.loads(open(path).read())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    open(path, "w").write(json.dumps(manifest))


@pytest.mark.parametrize("where", ["..", "absolute"])
def test_a_manifest_naming_a_file_outside_its_checkpoint_is_refused(tmp_path, where):
    """A hand-made manifest listing a file outside the checkpoint (with its right size and checksum)
    is refused, naming the entry; verification used to read the file and pass the checkpoint."""
    final = ckpt.save(str(tmp_path / "checkpoints"), 1, {"model": {"w": torch.ones(4)}})
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not the checkpoint's\n")
    name = os.path.join("..", "..", "secret.txt") if where == ".." else str(secret)
    _with_entry(final, name, secret.read_bytes())
    reason = ckpt.verify(final)
    assert reason.startswith(f"{ckpt.MANIFEST} lists {name!r}, outside the checkpoint directory"), reason
    assert "\n" not in reason
    found, skipped = ckpt.find_intact(str(tmp_path / "checkpoints"))
    assert found is None and skipped[0][1] == reason


@pytest.mark.parametrize("link", ["model.pt", "a directory on an entry's path"])
def test_a_symlink_inside_a_checkpoint_is_refused(tmp_path, link):
    """model.pt replaced by a link to an identical file elsewhere, or a manifest entry reached through
    a linked directory (sizes and checksums match): refused, naming the link; verification used to
    pass it, and loading would read whatever the link points at."""
    final = ckpt.save(str(tmp_path / "checkpoints"), 1, {"model": {"w": torch.ones(4)}})
    if link == "model.pt":
        target = tmp_path / "model_elsewhere.pt"
        shutil.move(os.path.join(final, "model.pt"), target)
        os.symlink(str(target), os.path.join(final, "model.pt"))
        shown = "model.pt"
    else:
        target = tmp_path
        (tmp_path / "secret.txt").write_bytes(b"not the checkpoint's\n")
        os.mkdir(os.path.join(final, "sub"))
        os.symlink(str(target), os.path.join(final, "sub", "up"))
        _with_entry(final, "sub/up/secret.txt", (tmp_path / "secret.txt").read_bytes())
        shown = os.path.join("sub", "up")
    assert ckpt.verify(final) == (f"{shown} is a symbolic link (to {target}); a checkpoint holds its own files "
                                  f"only: replace the link with the file, or use a checkpoint written by this code")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant here
def test_a_dcp_storage_entry_that_is_a_symlink_is_refused(tmp_path):
    """The sharded reader refuses a DCP data file that is a link (verification refuses it first; the
    reader is the second line, for any caller that reads without verifying)."""
    import torch.distributed.checkpoint as dcp

    from train_utils.sharded_checkpoint import _SafeReader

    where = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(where), no_dist=True)
    (data,) = [p for p in os.listdir(where) if p.endswith(".distcp")]
    shutil.move(str(where / data), str(tmp_path / data))
    os.symlink(str(tmp_path / data), str(where / data))
    with pytest.raises(ckpt.RefusedFile, match=f"a storage entry naming {data!r}, a symbolic link"):
        _SafeReader(str(where)).read_metadata()


def test_a_resume_loads_its_checkpoint_memory_mapped(tmp_path, monkeypatch):
    """Every checkpoint file a resume reads is memory-mapped (torch.load(mmap=True)): pages are read
    as they are copied into the model and optimizer, not as a second full copy per rank."""
    assert run_inprocess(tmp_path, "train.steps=2", *EVERY) == 0
    seen, real = [], torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("mmap"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    assert run_inprocess(tmp_path, "train.steps=4", *EVERY, "train.resume_changes=[train.steps]") == 0
    assert len(seen) >= 3 and all(seen)  # trainer, model, optimizer


# ------------------------------------------------------------------------------ a checkpoint is data
class _Payload:
    """What a hand-made checkpoint could hide in a pickle: unpickling it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _rehash(ckpt_dir) -> None:
    """Whoever writes a checkpoint writes its manifest too: a forged checkpoint passes verification."""
    import hashlib

    files = {}
    for folder, _, names in os.walk(ckpt_dir):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ckpt_dir)
            if rel != ckpt.MANIFEST:
                files[rel] = {"bytes": os.path.getsize(path),
                              "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    with open(os.path.join(ckpt_dir, ckpt.MANIFEST), "w") as f:
        json.dump({"format": 1, "step": 2, "files": files}, f)
    assert ckpt.verify(ckpt_dir) is None


def forge(run_dir, kind: str, marker) -> str:
    """Hide a payload in the latest checkpoint of `run_dir`; return the file that carries it."""
    import pickle

    ckpt_dir = ckpt.latest(_root(run_dir))
    if kind == "plain model.pt":
        path = os.path.join(ckpt_dir, "model.pt")
        state = torch.load(path, weights_only=True)  # not memory-mapped: the file is rewritten next
        torch.save({**state, "payload": _Payload(marker)}, path)
    elif kind == "dcp metadata":
        path = os.path.join(ckpt_dir, "dcp", ".metadata")
        with open(path, "wb") as f:
            pickle.dump(_Payload(marker), f)
    else:  # a non-tensor item inside the DCP files (DCP loads those with torch.load(weights_only=False))
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_dir, whole = os.path.join(ckpt_dir, "dcp"), os.path.join(str(run_dir), "whole.pt")
        dcp_to_torch_save(dcp_dir, whole)
        state = torch.load(whole, weights_only=False)  # our own file, written just now
        os.remove(whole)
        state["model"][next(iter(state["model"]))] = _Payload(marker)  # read by resume and by eval.py
        shutil.rmtree(dcp_dir)
        dcp.save(state, checkpoint_id=dcp_dir, no_dist=True)
        path = dcp_dir
    _rehash(ckpt_dir)
    return path


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """2-step runs of both checkpoint formats (FSDP2 in a group of one)."""
    out = {}
    for parallelism in ("ddp", "fsdp"):
        run_dir = tmp_path_factory.mktemp(parallelism)
        assert run_inprocess(run_dir, "train.steps=2", f"train.parallelism={parallelism}") == 0
        out[parallelism] = run_dir
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as meant here
@pytest.mark.parametrize("load_path", ["resume", "eval.py"])
@pytest.mark.parametrize("kind", ["plain model.pt", "dcp metadata", "dcp non-tensor item"])
def test_a_hand_made_checkpoint_runs_no_code(honest, tmp_path, kind, load_path):
    """A checkpoint whose pickles would create a file when loaded: resuming from it and evaluating it
    refuse it with one line naming the file, and the payload never runs (DCP's own reader unpickled
    the metadata and the non-tensor items with weights_only=False: the file appeared)."""
    import eval as evaluate_ckpt

    run_dir, marker = tmp_path / "run", tmp_path / "PAYLOAD_RAN"
    shutil.copytree(honest["ddp" if kind.startswith("plain") else "fsdp"], run_dir)
    carrier = forge(run_dir, kind, marker)
    with pytest.raises(ckpt.RefusedFile) as err:
        if load_path == "resume":
            parallelism = "ddp" if kind.startswith("plain") else "fsdp"
            run_inprocess(run_dir, "train.steps=3", "train.resume_changes=[train.steps]",
                          f"train.parallelism={parallelism}")
        else:
            evaluate_ckpt.main([f"checkpoint={run_dir}"])
    assert not marker.exists(), "the checkpoint's payload ran"
    message = str(err.value)
    assert message.startswith(f"refused to load {carrier}") and "\n" not in message
    assert "nothing from it was run" in message


# ------------------------------------------------------------------------------ every exit path
def test_binary_garbage_as_a_text_data_file_is_named(tmp_path):
    """A binary file where text belongs (or a damaged .gz): a DataConfigError naming the file (it
    was a UnicodeDecodeError without the file's name)."""
    import gzip

    from data import DataConfigError
    from data.local import read_documents

    good, garbage, bad_gz = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt.gz"
    good.write_text("one document\n\nanother\n")
    garbage.write_bytes(b"text at first\n" + bytes(range(128, 256)) * 8)
    bad_gz.write_bytes(gzip.compress(b"fine text\n" * 100)[:-20])  # cut short
    assert read_documents([str(good)]) == ["one document", "another"]
    with pytest.raises(DataConfigError, match=f"^{garbage} is not UTF-8 text") as err:
        read_documents([str(good), str(garbage)])
    assert "\n" not in str(err.value)
    with pytest.raises(DataConfigError, match=f"^{bad_gz} is not a readable gzip file"):
        read_documents([str(bad_gz)])


def test_a_latest_pointer_older_than_the_newest_intact_checkpoint_is_noted(tmp_path):
    """checkpoints 2, 4, 6 with `latest` naming 4 (a branch resumed from 4, or a pointer set by hand):
    the run continues from 4 as `latest` says, and says that 6 is there and how to take it instead."""
    assert run_inprocess(tmp_path, "train.steps=6", *EVERY) == 0
    root = _root(tmp_path)
    ckpt.point_latest(root, os.path.join(root, ckpt.step_dir_name(4)))
    assert run_inprocess(tmp_path, "train.steps=6", *EVERY) == 0
    start = [r for r in rows(tmp_path) if r.get("event") == "start"][-1]
    assert start["resumed_from"].endswith(ckpt.step_dir_name(4))
    six = os.path.join(root, ckpt.step_dir_name(6))
    log = (tmp_path / "train.log").read_text()
    assert f"note: `latest` names {os.path.join(root, ckpt.step_dir_name(4))}, but a newer intact checkpoint " \
           f"exists, {six}" in log and f"pass train.resume={six}" in log


def test_a_bad_line_inside_metrics_jsonl_is_one_error_naming_it(tmp_path):
    """A line that is not JSON before the last one of metrics.jsonl (not the partial last line of an
    interrupted append, which is dropped): the run stops before any work with one error naming the
    file and the line (it was a traceback from the metrics truncation)."""
    from train_utils.metrics import MetricsFileError

    assert run_inprocess(tmp_path, "train.steps=4", *EVERY) == 0
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(MetricsFileError, match=f"^{path}, line 3 of {len(lines)}: not a JSON row"):
        run_inprocess(tmp_path, "train.steps=6", *EVERY, "train.resume_changes=[train.steps]")


def test_a_full_disk_outside_a_checkpoint_write_names_the_file(tmp_path, monkeypatch):
    """ENOSPC while appending to metrics.jsonl (no checkpoint write under way): a CheckpointError
    naming the file and the intact latest checkpoint (it was a raw OSError traceback)."""
    from train_utils import metrics

    assert run_inprocess(tmp_path, "train.steps=2", *EVERY) == 0
    import builtins

    real_open, real_log, calls = builtins.open, metrics.MetricsLog.log, []

    def full_open(file, mode="r", *args, **kwargs):
        """From the continued run's third row on, appends to metrics.jsonl fail as on a full disk."""
        f = real_open(file, mode, *args, **kwargs)
        if str(file) == str(tmp_path / "metrics.jsonl") and "a" in mode and len(calls) >= 3:
            def write(_data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what a file write raises: no file name
            f.write = write
        return f

    monkeypatch.setattr(metrics.MetricsLog, "log", lambda self, row: (calls.append(row), real_log(self, row))[1])
    monkeypatch.setattr(builtins, "open", full_open)
    with pytest.raises(ckpt.CheckpointError) as err:
        run_inprocess(tmp_path, "train.steps=6", *EVERY, "train.resume_changes=[train.steps]")
    monkeypatch.undo()
    assert str(err.value) == (f"no space left on device while writing {tmp_path / 'metrics.jsonl'}; the latest "
                              f"checkpoint {os.path.join(_root(tmp_path), ckpt.step_dir_name(2))} is intact; free "
                              f"space, then run the same command again to continue")


def test_a_pickled_stop_flag_is_the_receiving_processs_own(tmp_path):
    """submitit pickles train.py's functions by value with the globals they use: the launching
    process's installed flag arrived in the job looking installed, so no handler caught SIGUSR2 and
    submitit requeued the job without train.py's checkpoint (found by the Slurm requeue test)."""
    import pickle

    from train_utils.signals import STOP

    installed = STOP.install()
    try:
        assert pickle.loads(pickle.dumps(STOP)) is STOP
    finally:
        if installed:
            STOP.restore()


def test_checkpoint_formats_depend_one_way():
    """checkpoint.py (the format's base) imports no other checkpoint module; sharded_checkpoint.py
    builds on it; writing/restoring either format is resume.py's (they imported each other)."""
    import ast

    def imported(name):
        tree = ast.parse(open(os.path.join(os.path.dirname(__file__), "..", "train_utils", name)).read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("train_utils"):
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level:
                found |= {a.name for a in node.names}
        return found

    assert not {m for m in imported("checkpoint.py") if "checkpoint" in m or "resume" in m}
    assert not {m for m in imported("sharded_checkpoint.py") if "resume" in m}
    assert "train_utils.checkpoint" in imported("sharded_checkpoint.py")
