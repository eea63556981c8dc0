"""train.py end to end on CPU: the quickstart config learns and logs every field; precision modes;
wandb offline; bad input fails early with a message naming the bad value."""
import glob
import math
import os

import pytest
import torch

import frugal
from hydra.errors import MissingConfigException

from _train_helpers import (TINY, compose_cfg, failure, rows,  # noqa: F401
                            run_cli, run_inprocess, train_cmd, wait_for_wandb_run, wandb_history)
from train_utils import checkpoint as ckpt
from train_utils.validation import ConfigError

TRAIN_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "data_wait_s", "scored_tokens_per_s",
                "positions_per_s", "optimizer_state_bytes", "peak_memory_bytes", "state_full_fraction"}
START_FIELDS = {"event", "step", "params", "state_full_fraction", "optimizer_state_bytes_estimate", "optimizer",
                "model", "loss_floor"}


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """The quickstart config (llama_tiny + FRUGAL 0.25, synthetic corpus, default schedule) for a few
    dozen steps, with a smaller batch (speed) and a short update gap (so subspaces switch)."""
    run_dir = tmp_path_factory.mktemp("quickstart")
    status = run_inprocess(run_dir, "train.steps=30", "train.eval_every=15", "optimizer.update_gap=10",
                           "train.batch_size=4", "train.micro_batch_size=4", "train.eval_tokens=4096",
                           "train.progress_bar=false", "wandb.mode=disabled", base=[])
    return run_dir, status


def test_quickstart_config_learns_and_logs_every_field(quickstart_run):
    run_dir, status = quickstart_run
    assert status == 0
    log = rows(run_dir)
    start, end = log[0], log[-1]
    assert START_FIELDS <= start.keys() and start["event"] == "start"
    assert start["optimizer"] == "frugal" and start["model"] == "llama_tiny"
    assert start["state_full_fraction"] == pytest.approx(0.25)
    assert start["optimizer_state_bytes_estimate"] < start["adamw_state_bytes"]
    assert start["loss_floor"] > 0
    assert start["zero_grad_set_to_none"] is True and start["parallelism"] == "ddp"  # one process: no DDP
    assert start["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512...
    train_rows = [r for r in log if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 31))
    for r in train_rows:
        assert TRAIN_FIELDS <= r.keys(), r
        assert math.isfinite(r["loss"]) and r["scored_tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert 0 < r["optimizer_state_bytes"] < start["adamw_state_bytes"]
        assert r["grad_norm"] > 0 and r["state_full_fraction"] == pytest.approx(0.25)
        assert 0 <= r["data_wait_s"] < r["step_time_s"]
        # every row of the synthetic corpus is full: 256 positions, 255 of them scored targets
        assert r["positions_per_s"] / r["scored_tokens_per_s"] == pytest.approx(256 / 255)
        assert "mfu" not in r  # CPU: no peak FLOPS in the table, none given
    assert train_rows[-1]["tokens"] == 30 * 4 * 255  # 4 sequences of 256 tokens = 255 targets each
    first, last = train_rows[0]["loss"], sum(r["loss"] for r in train_rows[-5:]) / 5
    assert first == pytest.approx(math.log(512), abs=0.3)  # a fresh model is uniform over 512 symbols
    assert last < first - 0.5, (first, last)
    evals = [r for r in log if "val_loss" in r and "event" not in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) and r["val_tokens"] >= 4096 for r in evals)
    assert evals[1]["val_loss"] < evals[0]["val_loss"]
    switches = [r for r in log if r.get("event") == "switch"]
    assert [r["step"] for r in switches] == [1, 11, 21]  # the first window, then every update_gap
    assert all(len(r["active_blocks"]) == 1 for r in switches)  # 0.25 of 4 layers
    assert end["event"] == "end" and end["val_loss"] == evals[1]["val_loss"] and end["ranks_in_sync"]
    assert os.path.getsize(os.path.join(run_dir, "loss.png")) > 1000
    log_text = (run_dir / "train.log").read_text()  # the console's lines are kept in train.log
    assert "validation loss" in log_text and "optimizer state" in log_text
    assert os.path.basename(ckpt.latest(os.path.join(run_dir, "checkpoints"))) == "step_00000030"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_other_precisions_run(tmp_path, precision):
    assert run_inprocess(tmp_path, "train.steps=2", f"train.precision={precision}", "train.plot=true") == 0
    sd = torch.load(os.path.join(ckpt.latest(str(tmp_path / "checkpoints")), "model.pt"), weights_only=True)
    expected = torch.bfloat16 if precision == "bf16" else torch.float32
    assert all(t.dtype == expected for t in sd.values() if t.is_floating_point())
    assert os.path.exists(tmp_path / "loss.png")


def test_grad_clip_is_logged(tmp_path):
    assert run_inprocess(tmp_path, "train.steps=2", "train.grad_clip=0.5", "optimizer=adamw",
                         base=[o for o in TINY if not o.startswith("optimizer")]) == 0
    assert all(r["grad_norm"] > 0 for r in rows(tmp_path) if "loss" in r)


@pytest.mark.slow
def test_wandb_offline_writes_readable_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert run_inprocess(tmp_path, "train.steps=3", "wandb.mode=offline", "train.eval_every=3") == 0
    history = wandb_history(tmp_path)
    assert [h["_step"] for h in history if "loss" in h] == [1, 2, 3]
    assert TRAIN_FIELDS - {"step"} <= next(h for h in history if "loss" in h).keys()
    assert any("val_loss" in h and "val_ppl" in h for h in history)
    kinds = {r.WhichOneof("record_type") for r in wait_for_wandb_run(tmp_path)}
    assert {"run", "history", "summary"} <= kinds
    local = {r["step"]: r["loss"] for r in rows(tmp_path) if "loss" in r}
    assert {h["_step"]: h["loss"] for h in history if "loss" in h} == pytest.approx(local)


@pytest.mark.slow
def test_wandb_offline_says_one_line_where_its_run_is(tmp_path):
    """wandb stays the logger but keeps quiet: of the console, one line names the offline run and how to
    upload it (wandb's own banner, hints and summary were ~34 lines per run)."""
    proc = run_cli(train_cmd(tmp_path, "train.steps=2", "wandb.mode=offline"))
    assert proc.returncode == 0, failure(proc)
    said = [ln for ln in (proc.stdout + proc.stderr).replace(str(tmp_path), "<run dir>").splitlines()
            if "wandb" in ln.lower()]
    assert len(said) == 1, said
    sync_dir = said[0].rsplit("`wandb sync ", 1)[1].rstrip("`").replace("<run dir>", str(tmp_path))
    assert said[0].replace("<run dir>", str(tmp_path)).startswith(f"wandb: offline run in {sync_dir}")
    assert glob.glob(os.path.join(sync_dir, "run-*.wandb")), sync_dir


# ------------------------------------------------------------------------------------ bad input
def test_unknown_group_option_lists_choices():
    with pytest.raises(MissingConfigException) as err:
        compose_cfg("optimizer=adamx")
    assert "optimizer/adamx" in str(err.value) and "frugal_rho0" in str(err.value)


@pytest.mark.parametrize("override, words", [
    ("train.batch_size=6", ["train.batch_size=6", "micro_batch_size (4)", "8, 12"]),
    ("train.precision=fp16", ["train.precision='fp16'", "bf16-mixed, bf16, fp32"]),
    ("wandb.mode=cloud", ["wandb.mode='cloud'", "online, offline, disabled"]),
    ("train.steps=0", ["train.steps=0", ">= 1"]),
    ("optimizer.density=1.5", ["density", "1.5"]),
])
def test_bad_values_are_named(tmp_path, override, words):
    with pytest.raises((ConfigError, frugal.HyperparameterError)) as err:
        run_inprocess(tmp_path, override)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert not os.path.exists(tmp_path / "checkpoints")


def test_programming_errors_keep_their_traceback(tmp_path, monkeypatch):
    """Only validated errors become one-line messages; a bug inside model construction (here a plain
    ValueError) must reach the caller as itself, not as a ConfigError (exit 2, no traceback)."""
    import models

    def broken(*args, **kwargs):
        raise ValueError("a bug, not a bad setting")

    monkeypatch.setattr(models, "build_model", broken)
    with pytest.raises(ValueError, match="a bug") as err:
        run_inprocess(tmp_path, "train.steps=1")
    assert not isinstance(err.value, ConfigError)


def test_missing_checkpoint_to_resume(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint there"):
        run_inprocess(tmp_path, f"train.resume={tmp_path / 'nowhere'}")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    # lr=1e30 makes the first update blow the weights up; step 2's loss is then not finite.
    with pytest.raises(FloatingPointError, match="at step 2"):
        run_inprocess(tmp_path, "train.steps=5", "optimizer=signsgd", "optimizer.lr=1e30", "checkpoint.every=1",
                      "schedule=constant", "schedule.warmup_fraction=0",
                      base=[o for o in TINY if not o.startswith(("schedule", "optimizer"))])
    latest = ckpt.latest(str(tmp_path / "checkpoints"))
    assert os.path.basename(latest) == "step_00000001"
    assert ckpt.load(latest, "trainer")["step"] == 1
    assert all(r["step"] <= 1 for r in rows(tmp_path) if "loss" in r)


@pytest.mark.slow
def test_cli_errors_are_clear(tmp_path, c4_dir):
    """The command line shows the message (no traceback) and exits with 2; an unknown option is one
    line naming the closest and the available options (schema.bad_group_choice), before Hydra's own."""
    bad_batch = run_cli(train_cmd(tmp_path / "a", "train.batch_size=6"))
    assert bad_batch.returncode == 2, bad_batch.stderr
    assert "error: train.batch_size=6 must equal" in bad_batch.stderr and "Traceback" not in bad_batch.stderr
    unknown = run_cli(train_cmd(tmp_path / "b", "optimizer=adamx"))
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines()[-1].startswith(
        "error: optimizer='adamx' is not an option of configs/optimizer/ (did you mean badam?); valid options: ")
    assert "frugal_rho0" in unknown.stderr and "Traceback" not in unknown.stderr
    missing = run_cli(train_cmd(tmp_path / "c", "data=local", f"data.path={tmp_path / 'no_such_corpus'}"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert "no_such_corpus" in missing.stderr and "does not exist" in missing.stderr
    # The Hub is unreachable (HF_HUB_OFFLINE=1): the error names the tokenizer and how to pass a local one.
    offline = run_cli(train_cmd(tmp_path / "d", "data=c4", f"data.path={c4_dir}", "data.tokenizer=t5-base"))
    assert offline.returncode == 2 and "Traceback" not in offline.stderr, offline.stderr
    assert "t5-base" in offline.stderr and "data.tokenizer=" in offline.stderr


# ------------------------------------------------------------------------- start-up memory check
def test_memory_check_refuses_llama_7b_on_this_host_with_the_figures(tmp_path, monkeypatch):
    """7B needs ~27 GB of fp32 weights before anything else; the planner (meta device, nothing
    allocated) refuses the run with the planned and the available figures, before a model exists."""
    import re

    import models
    from train_utils.memory_check import MemoryCheckError
    from train_utils.memory_plan import device_memory

    built = []
    real_build = models.build_model

    def spy(*args, **kwargs):
        built.append(torch.get_default_device().type)  # the planner builds on the meta device only
        return real_build(*args, **kwargs)

    monkeypatch.setattr(models, "build_model", spy)
    if device_memory("cpu") > 200 * 2**30:
        pytest.skip("this host has room for llama_7b")
    with pytest.raises(MemoryCheckError) as err:
        run_inprocess(tmp_path, "model=llama_7b", "train.steps=1")
    text = str(err.value)
    assert re.search(r"llama_7b \+ frugal .* needs about [\d.]+ GiB .* available RAM is [\d.]+ GiB", text), text
    assert "train.memory_check=false" in text and "train.activation_checkpointing=true" in text
    assert built and set(built) == {"meta"}
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.slow
def test_memory_check_logs_its_figures_and_can_be_skipped(tmp_path, monkeypatch):
    import train_utils.memory_check as memory_check
    from train_utils.memory_check import MemoryCheckError

    assert run_inprocess(tmp_path / "fits", "train.steps=1") == 0
    start = rows(tmp_path / "fits")[0]
    assert 0 < start["memory_planned_bytes"] < start["memory_available_bytes"]
    monkeypatch.setattr(memory_check, "device_memory", lambda device: 2**20)  # a host with 1 MiB free
    with pytest.raises(MemoryCheckError, match="available RAM is 0.0 GiB"):
        run_inprocess(tmp_path / "refused", "train.steps=1")
    assert run_inprocess(tmp_path / "skipped", "train.steps=1", "train.memory_check=false") == 0
    assert rows(tmp_path / "skipped")[0]["memory_check"].startswith("off")


# ------------------------------------------------------------------------- density, optimizer hooks
def as_subclass(cls):
    """frugal.build_optimizer, returning its FRUGAL as `cls` (a subclass that only adds methods)."""
    build = frugal.build_optimizer

    def built(model, name, **hp):
        optimizer = build(model, name, **hp)
        optimizer.__class__ = cls
        return optimizer

    return built


def test_realised_density_is_logged_and_a_far_one_is_warned(tmp_path, monkeypatch, capsys):
    """The start row carries optimizer.density_report(); the console says when the realised share
    differs from the request, with a warning beyond half a selection unit."""
    assert run_inprocess(tmp_path / "rounded", "train.steps=1", "optimizer.density=0.1") == 0
    start = rows(tmp_path / "rounded")[0]
    # 4 equal layers: round-half-up(0.4) = 0 blocks; a unit is a quarter; 0.1 is within half a unit
    assert (start["density_requested"], start["density_realised"], start["density_unit"]) == pytest.approx(
        (0.1, 0.0, 0.25))
    out = capsys.readouterr().out
    assert "optimizer.density=0.1 is realised as a state-full share of 0" in out and "warning" not in out

    class Far(frugal.FRUGAL):
        def density_report(self):
            return {"requested": 0.5, "realised": 0.2, "unit": 0.25}

    monkeypatch.setattr(frugal, "build_optimizer", as_subclass(Far))
    assert run_inprocess(tmp_path / "far", "train.steps=1") == 0
    assert "warning: optimizer.density=0.5 is realised as a state-full share of 0.2" in capsys.readouterr().out


def test_a_signsgd_only_optimizer_gets_no_density_note():
    """optimizer=signsgd (Table 16's last column): nothing is selectable, so its density (the default 0.25)
    is not "realised as 0": no note, no warning."""
    from train_utils.report import density_message

    import models
    from omegaconf import OmegaConf

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = models.build_model(OmegaConf.load(os.path.join(root, "configs", "model", "llama_tiny.yaml")), vocab_size=64)
    report = frugal.build_optimizer(model, "signsgd").density_report()
    assert report["requested"] > 0 and report["realised"] == 0 and density_message(report) is None
    assert density_message({"requested": 0.5, "realised": 0.2, "unit": 0.25}).startswith("warning")


def test_optimizer_hooks_see_the_global_loss_and_their_events_are_logged(tmp_path, monkeypatch):
    """Duck-typed hooks for optimizers that adapt to the loss or report what they did:
    observe_loss(global loss) before every step, pop_events() rows logged after it."""
    seen = []

    class Hooked(frugal.FRUGAL):
        def observe_loss(self, value):
            seen.append((self.step_count, value))

        def pop_events(self):
            return [{"event": "probe", "optimizer_step": self.step_count}]

    monkeypatch.setattr(frugal, "build_optimizer", as_subclass(Hooked))
    assert run_inprocess(tmp_path, "train.steps=3") == 0
    log = rows(tmp_path)
    logged = [(r["step"] - 1, r["loss"]) for r in log if "loss" in r]
    assert seen == logged  # before the step (step_count = steps taken), the loss the row logs
    assert [(r["step"], r["optimizer_step"]) for r in log if r.get("event") == "probe"] == [(1, 1), (2, 2), (3, 3)]


# ------------------------------------------------------------------------- compiled model
@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path):
    """train.compile=true (blocks and loss compiled by inductor) trains like eager: bf16-mixed
    losses within 2e-3 and gradient norms within 1% over 4 steps, the validation loss within 2e-3
    (measured on llama_tiny: 1.4e-4, 0.07%, 1.2e-5; in fp32: 1.5e-6 and 1e-7); so does it with the
    step inside backward."""
    # 16 validation rows of 63 scored tokens: 4 whole micro-batches. TINY's 1024 tokens take a 17th row, a
    # micro-batch of 1 that recompiles the blocks and the loss for a dynamic batch size (6 graphs, not 4).
    steps = ["train.steps=4", "train.eval_every=4", "train.eval_tokens=1008"]
    assert run_inprocess(tmp_path / "eager", *steps) == 0
    assert run_inprocess(tmp_path / "compiled", *steps, "train.compile=true") == 0
    assert rows(tmp_path / "compiled")[0]["compiled"] is True and rows(tmp_path / "eager")[0]["compiled"] is False
    eager, compiled = [r for r in rows(tmp_path / "eager") if "loss" in r], [r for r in rows(tmp_path / "compiled")
                                                                            if "loss" in r]
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], abs=2e-3)
    assert [r["grad_norm"] for r in compiled] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-2)
    assert rows(tmp_path / "compiled")[-1]["val_loss"] == pytest.approx(rows(tmp_path / "eager")[-1]["val_loss"],
                                                                         abs=2e-3)
    # and with FRUGAL's step inside backward (the 7B single-GPU presets compile on a GPU: train.compile=auto):
    # the hooks fire under the compiled blocks' backward as under eager ones
    assert run_inprocess(tmp_path / "hooked", *steps, "train.compile=true", "train.optimizer_in_backward=true") == 0
    hooked = [r for r in rows(tmp_path / "hooked") if "loss" in r]
    assert [r["loss"] for r in hooked] == pytest.approx([r["loss"] for r in compiled], abs=2e-3)
    assert [r["grad_norm"] for r in hooked] == pytest.approx([r["grad_norm"] for r in compiled], rel=1e-2)


def test_compile_setting_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="train.compile='sometimes' is invalid; choose true, false or auto"):
        run_inprocess(tmp_path, "train.compile=sometimes")
    with pytest.raises(ConfigError, match="train.parallelism='zero3' is invalid; choose one of ddp, fsdp"):
        run_inprocess(tmp_path, "train.parallelism=zero3")


def test_memory_check_on_a_gpu_also_counts_the_host_ram_of_building_the_model(monkeypatch):
    """On a GPU node every process builds its fp32 model on the host before moving it: 8 processes
    x 4 bytes x 6.7B parameters do not fit a host with 64 GiB free, whatever the GPUs hold."""
    import train_utils.memory_check as memory_check
    from train_utils.memory_check import MemoryCheckError
    from train_utils.memory_plan import DEVICES, GIB

    free = {"cpu": 64 * GIB, "cuda": DEVICES["a100-80gb"]}
    monkeypatch.setattr(memory_check, "device_memory", lambda device: free[torch.device(device).type])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = compose_cfg("experiment=table2", "model=llama_7b")
    opt = {"name": "frugal", "density": 0.0}
    with pytest.raises(MemoryCheckError, match=r"building llama_7b needs about 208.8 GiB of host RAM \(8 processes"):
        memory_check.check(cfg, opt, 32000, 8, torch.device("cuda"))
    free["cpu"] = 512 * GIB  # a host with room: the GPU's own check passes (FSDP2, micro-batch 32)
    result = memory_check.check(cfg, opt, 32000, 8, torch.device("cuda"))
    assert result["memory_planned_bytes"] < result["memory_available_bytes"] == DEVICES["a100-80gb"]


def test_a_short_validation_set_stops_a_strict_run_before_training(tmp_path, t5_tokenizer_dir):
    """train.require_eval_tokens=true (the paper presets) refuses a validation set that scores fewer
    than train.eval_tokens, before the first step: nothing is logged or checkpointed."""
    import json

    from data import DataConfigError

    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document number {i} says hello"}) + "\n" for i in range(44)))
    run_dir = tmp_path / "run"
    local = ["data=local", f"data.path={corpus}", f"data.tokenizer={t5_tokenizer_dir}", "data.seq_len=32",
             "data.val_stride=11", "train.steps=2", "train.eval_tokens=1000"]
    with pytest.raises(DataConfigError, match=r"fewer than train.eval_tokens=1,000.*require_eval_tokens=false"):
        run_inprocess(run_dir, *local, "train.require_eval_tokens=true")
    assert not os.path.exists(run_dir / "metrics.jsonl") and not os.path.exists(run_dir / "checkpoints")
    with pytest.warns(UserWarning, match="fewer than train.eval_tokens=1,000"):
        assert run_inprocess(run_dir, *local) == 0  # not strict (the default): a warning, and the run goes on


@pytest.mark.slow
def test_density_schedule_and_growing_gap_events_reach_the_log(tmp_path):
    """The opt-in schedules of frugal.adaptive report through pop_events(); the loop logs them."""
    assert run_inprocess(tmp_path, "train.steps=9", "optimizer.update_gap=3", "optimizer.density=0.5",
                         "optimizer.density_schedule=step", "optimizer.density_end=0.0",
                         "optimizer.density_steps=3") == 0
    events = [(r["step"], r["window"], r["density"]) for r in rows(tmp_path) if r.get("event") == "density"]
    assert events and events[0][2] == 0.0  # from the second window on, the schedule's end value


# ------------------------------------------------------------------------ micro-batch `auto`
def test_auto_micro_batch_is_the_largest_share_divisor_that_fits_the_memory_plan(monkeypatch):
    from omegaconf import OmegaConf

    from train_utils import memory_check, memory_plan
    from train_utils.memory_check import auto_micro_batch
    from train_utils.validation import AUTO, resolve_precision, validate_config

    cfg = compose_cfg()
    assert cfg.train.micro_batch_size == AUTO and cfg.train.batch_size == 8  # the quickstart default
    assert [auto_micro_batch(cfg, world, "cpu") for world in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert validate_config(cfg, 2) == 1  # `auto` passes start-up validation (train.py resolves it first)
    with pytest.raises(ConfigError, match=r"train.batch_size=8 cannot be split over 3 processes.*3, 6, 9, 12"):
        auto_micro_batch(cfg, 3, "cpu")
    # The memory plan decides: a host with room for micro-batch 2 (but not 4) of 8 gets 2, accumulating 4.
    opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
    tc = cfg.train
    need = {m: memory_plan.plan_memory(cfg.model, opt, micro_batch_size=m, seq_len=cfg.data.seq_len,
                                       vocab_size=cfg.model.vocab_size,
                                       precision=resolve_precision(tc.precision, "cpu"),
                                       parallelism=tc.parallelism, device_type="cpu").required for m in (2, 4)}
    assert need[2] < need[4]
    monkeypatch.setattr(memory_check, "device_memory", lambda d: need[2] + memory_check.PROCESS_BYTES)
    assert auto_micro_batch(cfg, 1, "cpu") == 2
    monkeypatch.setattr(memory_check, "device_memory", lambda d: 1)
    assert auto_micro_batch(cfg, 1, "cpu") == 1  # nothing fits: the smallest, and the memory check says why


def test_an_explicit_micro_batch_is_kept_and_a_bad_one_still_refused(tmp_path):
    assert run_inprocess(tmp_path / "ok", "train.steps=1", "train.micro_batch_size=2") == 0
    assert rows(tmp_path / "ok")[0]["accumulation"] == 4 and rows(tmp_path / "ok")[0]["micro_batch_size"] == 2
    with pytest.raises(ConfigError, match=r"train.batch_size=8 must equal train.micro_batch_size \(3\)"):
        run_inprocess(tmp_path / "bad", "train.micro_batch_size=3")


@pytest.mark.slow
def test_quickstart_runs_on_two_processes_and_a_bad_micro_batch_ends_torchruns_output(tmp_path):
    """`torchrun --nproc_per_node 2 train.py` on the default config (micro-batch auto: 8 = 4 x 1 x 2), and
    an explicit micro-batch that does not divide: its one line is torchrun's last word on the failure."""
    from _train_helpers import torchrun_cmd

    quick = ["train.steps=2", "data.seq_len=64", "train.eval_tokens=512", "train.progress_bar=false",
             "train.plot=false", "wandb.mode=disabled"]
    proc = run_cli(torchrun_cmd(tmp_path / "ok", *quick, base=[]))
    assert proc.returncode == 0, failure(proc)
    start = rows(tmp_path / "ok")[0]
    assert (start["world_size"], start["micro_batch_size"], start["accumulation"]) == (2, 4, 1)
    bad = run_cli(torchrun_cmd(tmp_path / "bad", *quick, "train.micro_batch_size=8", base=[]))
    assert bad.returncode != 0
    lines = [ln.strip() for ln in bad.stderr.splitlines() if ln.strip() and not ln.startswith("=====")]
    assert lines[-1].startswith("traceback : error: train.batch_size=8 must equal train.micro_batch_size (8)"), \
        bad.stderr[-3000:]


# ------------------------------------------------------------------------------- debug=toy
@pytest.mark.parametrize("overrides", [
    ["experiment=table2", "model=llama_1b"], ["experiment=table13_gpt2"], ["experiment=table5_3b"],
    ["experiment=tables6_7_schedules", "schedule=cosine"], ["experiment=table16_density", "optimizer.density=0.5"],
])
def test_debug_toy_wins_over_every_preset_and_keeps_the_runs_shape(overrides):
    from train_utils.validation import validate_config

    paper, toy = compose_cfg(*overrides), compose_cfg(*overrides, "debug=toy")
    assert (toy.model.name, toy.model.family, toy.optimizer, toy.schedule.name, toy.train.precision) == \
        (paper.model.name, paper.model.family, paper.optimizer, paper.schedule.name, paper.train.precision)
    # each model its rung of the toy ladder (configs/debug/toy.yaml; 4 x 128 for 130M and any model not in it)
    shape = {"llama_1b": (6, 160), "llama_3b": (8, 160)}.get(paper.model.name, (4, 128))
    assert (toy.model.num_hidden_layers, toy.model.hidden_size, toy.data.name, toy.data.num_workers) == \
        (*shape, "synthetic", 0)
    assert (toy.train.steps, toy.train.batch_size, toy.train.eval_every, toy.train.eval_tokens) == (200, 8, 0, 16384)
    assert toy.schedule.warmup_steps < toy.train.steps and not toy.train.require_eval_tokens
    assert toy.wandb.mode == "disabled" and toy.train.parallelism == "ddp" and toy.train.compile is False
    validate_config(toy, 1)
    # what the command line names still wins over it
    assert compose_cfg(*overrides, "debug=toy", "data=local", "train.steps=50").train.steps == 50


@pytest.mark.slow
def test_debug_toy_turns_a_paper_cell_into_a_short_cpu_run_that_learns(tmp_path):
    """A paper preset's cell under debug=toy, as the README shows it, unchanged: it finishes and the loss
    falls far below a fresh model's (uniform over the 512 symbols: ln 512 = 6.24)."""
    proc = run_cli([*train_cmd(tmp_path, "experiment=table2", "model=llama_130m", "optimizer=galore", "debug=toy",
                               "train.progress_bar=false", base=[])], timeout=900)
    assert proc.returncode == 0, failure(proc)
    log = rows(tmp_path)
    train_rows = [r for r in log if "loss" in r]
    assert len(train_rows) == 200 and log[0]["debug"] == "toy" and log[0]["params"] < 2e6
    from train_utils.validation import resolve_precision

    assert log[0]["precision"] == resolve_precision("auto", "cpu")  # the preset's bf16-mixed, at toy scale
    assert train_rows[0]["loss"] == pytest.approx(math.log(512), abs=0.3)
    assert sum(r["loss"] for r in train_rows[-10:]) / 10 < 3.0 and log[-1]["val_loss"] < 3.0
    assert "shrunk by debug=toy" in (tmp_path / "train.log").read_text()


@pytest.mark.slow
def test_memory_plan_script_plans_the_default_auto_micro_batch():
    import sys as _sys

    proc = run_cli([_sys.executable, "-m", "bench.memory_plan", "model=llama_tiny"], timeout=120)
    assert proc.returncode == 0 and "micro-batch 8" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------ data.num_workers `auto`
@pytest.mark.slow
def test_auto_workers_follow_the_device_demand_within_the_spare_cores(tmp_path, monkeypatch, c4_dir,
                                                                       t5_tokenizer_dir):
    """C4's default data.num_workers=auto: a device whose peak (train.peak_flops, as an H100's) needs
    many workers gets as many as the rank's spare cores allow (4 cores: 3 spare, 2 dividing 64
    readers); the run trains with them and its checkpoint's config holds the resolved count."""
    import yaml

    import data

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    built = []
    real = data.DataModule.__init__
    monkeypatch.setattr(data.DataModule, "__init__", lambda self, *a, **k: (built.append(k["num_workers"]),
                                                                            real(self, *a, **k))[1])
    assert compose_cfg("data=c4").data.num_workers == "auto"
    assert run_inprocess(tmp_path, "data=c4", f"data.path={c4_dir}", f"data.tokenizer={t5_tokenizer_dir}",
                         "data.seq_len=32", "train.steps=2", "train.eval_tokens=256", "train.peak_flops=989e12") == 0
    assert built == [2]
    saved = yaml.safe_load(open(os.path.join(ckpt.list_checkpoints(str(tmp_path / "checkpoints"))[-1],
                                             "config.yaml")))
    assert saved["data"]["num_workers"] == 2


def test_a_run_shorter_than_one_window_says_no_switch_will_happen_and_a_bad_value_comes_first(tmp_path):
    """update_gap >= steps with a partly state-full subspace: a note at start; rho 0 (nothing to
    switch) and runs that do switch get none. optimizer.density=1.5 is the registry's one line before
    the memory planner sees it (it used to warn that its check was skipped, then stop)."""
    assert run_inprocess(tmp_path / "a", "train.steps=3", "optimizer.update_gap=3") == 0
    log = (tmp_path / "a" / "train.log").read_text()
    assert "note: optimizer.update_gap=3 >= train.steps=3: the state-full subspace never changes in this run" in log
    assert run_inprocess(tmp_path / "b", "train.steps=4", "optimizer.update_gap=3") == 0
    assert "never changes" not in (tmp_path / "b" / "train.log").read_text()
    with pytest.raises(frugal.HyperparameterError, match="Invalid density: 1.5"):
        run_inprocess(tmp_path / "c", "optimizer.density=1.5")
    assert not (tmp_path / "c" / "metrics.jsonl").exists()
