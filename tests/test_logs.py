"""What a training row shows (issue: throughput, "What the logs show") and the loop's memory
settings, each against an independent reference: the gradient norm, model FLOPs and MFU, the peak
memory of an interval, activation checkpointing."""
import math

import pytest
import torch

from _train_helpers import TINY, compose_cfg, losses, rows, run_inprocess  # noqa: F401
from train_utils.loop import enable_activation_checkpointing, grad_norm_
from train_utils.measure import Interval, flops_per_position, peak_flops


def _params_with_grads(seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(7, 5), (5,), (3, 3, 3)]]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    params.append(torch.nn.Parameter(torch.randn(4)))  # no gradient: skipped
    return params


def test_grad_norm_matches_float64_and_clipping_matches_torch():
    params = _params_with_grads()
    expected = torch.cat([p.grad.double().flatten() for p in params if p.grad is not None]).norm()
    assert grad_norm_(params, None).item() == pytest.approx(expected.item(), rel=1e-6)
    clipped = _params_with_grads()
    reference = _params_with_grads()
    norm = grad_norm_(clipped, 1.5)
    torch_norm = torch.nn.utils.clip_grad_norm_([p for p in reference if p.grad is not None], 1.5)
    assert norm.item() == pytest.approx(torch_norm.item(), rel=1e-6)
    for a, b in zip(clipped, reference):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    assert torch.cat([p.grad.flatten() for p in clipped
                      if p.grad is not None]).norm().item() == pytest.approx(1.5, rel=1e-5)


def test_flops_per_position_counts_the_config_by_hand():
    """6 x (weights except the input embedding) + 12 x layers x hidden x seq_len, from llama_tiny's
    config numbers (4 layers of hidden 128, MLP 352, 512 symbols, untied head)."""
    import models

    cfg = compose_cfg("model=llama_tiny")
    model = models.build_model(cfg.model, vocab_size=512)
    h, f, layers, vocab, seq = 128, 352, 4, 512, 256
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # attention, SwiGLU MLP, two RMSNorms
    matmul_params = layers * per_layer + h + vocab * h  # + final norm + output head
    assert flops_per_position(model, layers, h, seq) == 6 * matmul_params + 12 * layers * h * seq
    # GPT-2 ties its head to the input embedding: the head's matmul still counts, the lookups do not.
    gpt2 = models.build_model(compose_cfg("model=gpt2_124m", "model.hidden_size=64", "model.num_hidden_layers=2",
                                          "model.num_attention_heads=2").model, vocab_size=512)
    positions_table = 1024 * 64
    total = sum(p.numel() for p in gpt2.parameters())
    assert flops_per_position(gpt2, 2, 64, 128) == 6 * (total - positions_table) + 12 * 2 * 64 * 128


def test_peak_flops_table_and_override():
    assert peak_flops(torch.device("cpu"), None) is None  # no MFU on CPU unless told
    assert peak_flops(torch.device("cpu"), 2e12) == 2e12


def test_gpu_peak_flops_and_tf32_follow_the_device(monkeypatch):
    """The GPU branches, with torch.cuda's queries stubbed (no GPU here): the peak comes from the
    device name's table entry, TF32 is switched on only from compute capability 8 (Ampere) on."""
    from train_utils.loop import allow_tf32

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(cuda, None) == 312e12 and peak_flops(cuda, 1e15) == 1e15
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(cuda, None) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    assert peak_flops(cuda, None) is None  # not in the table: no MFU unless train.peak_flops is given
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert allow_tf32(True, cuda) is True and torch.backends.cuda.matmul.allow_tf32
        assert allow_tf32(False, cuda) is False and not torch.backends.cuda.matmul.allow_tf32
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
        assert allow_tf32(True, cuda) is False and not torch.backends.cudnn.allow_tf32
        assert allow_tf32(True, torch.device("cpu")) is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_batches_are_copied_without_blocking(monkeypatch):
    """to_device asks for asynchronous copies (they overlap with the GPU's work from pinned memory)."""
    from train_utils.loop import to_device

    calls = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking"))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    to_device({"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)},
              torch.device("cpu"))
    assert calls == [True, True]


def test_mfu_is_logged_with_a_peak(tmp_path):
    assert run_inprocess(tmp_path, "train.steps=3", "train.peak_flops=1e12") == 0
    start = rows(tmp_path)[0]
    assert start["peak_flops"] == 1e12 and start["flops_per_position"] > 0
    for r in [r for r in rows(tmp_path) if "loss" in r]:
        assert r["mfu"] == pytest.approx(start["flops_per_position"] * r["positions_per_s"] / 1e12, rel=1e-9)


_PEAKS = """
import torch
from train_utils.measure import Interval
interval = Interval(torch.device("cpu"), 1.0, None, 1)
big = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched, freed before the interval ends
big.add_(1)
del big
interval.add(1, 1, 0.1, 0.0)
first = interval.row()["peak_memory_bytes"]
interval.add(1, 1, 0.1, 0.0)
print(first, interval.row()["peak_memory_bytes"])
"""


@pytest.mark.slow
def test_peak_memory_is_the_peak_of_each_interval():
    """In a fresh interpreter: inside a test process (a pytest-xdist worker after other tests), memory
    that earlier tests' objects or threads free during the first interval can hide the 64 MiB below the
    resident size the interval started from (seen once: both rows 1,016,025,088 bytes)."""
    import subprocess
    import sys

    from _train_helpers import REPO, subprocess_env

    out = subprocess.run([sys.executable, "-c", _PEAKS], cwd=REPO, env=subprocess_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = map(int, out.stdout.split())
    assert first - second > 48 * 2 ** 20, (first, second)


def test_activation_checkpointing_recomputes_each_block():
    import models

    cfg = compose_cfg("model=llama_tiny")
    calls = {"on": 0, "off": 0}
    out = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        model = models.build_model(cfg.model, vocab_size=512)
        if mode == "on":
            enable_activation_checkpointing(model)
        model.train()
        # A pre-hook: the recomputation stops as soon as it has what backward needs (torch's early stop),
        # before a post-hook of the block's last part would run.
        model.model.layers[1].mlp.register_forward_pre_hook(
            lambda *a, mode=mode: calls.__setitem__(mode, calls[mode] + 1))
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        out[mode] = [p.grad.clone() for p in model.parameters()]
    assert calls == {"off": 1, "on": 2}  # forward, then again in backward
    for a, b in zip(out["off"], out["on"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_activation_checkpointing_in_the_loop(tmp_path):
    assert run_inprocess(tmp_path / "on", "train.steps=3", "train.activation_checkpointing=true") == 0
    assert run_inprocess(tmp_path / "off", "train.steps=3") == 0
    assert rows(tmp_path / "on")[0]["activation_checkpointing"] is True
    assert rows(tmp_path / "off")[0]["activation_checkpointing"] is False
    assert losses(tmp_path / "on") == losses(tmp_path / "off")


def test_every_row_has_a_finite_grad_norm_without_clipping(tmp_path):
    assert run_inprocess(tmp_path, "train.steps=2") == 0
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows(tmp_path) if "loss" in r)
    assert "grad_clip=null" not in str(TINY)  # the default: no clipping, yet the norm is logged


# ------------------------------------------------------------- what the console (and train.log) says
def test_start_block_progress_and_evaluations_reach_the_console_and_train_log(tmp_path, capsys):
    from train_utils.validation import native_bf16

    assert run_inprocess(tmp_path, "train.steps=8", "train.eval_every=4", "train.progress_bar=true") == 0
    precision = "bf16-mixed" if native_bf16("cpu") else "fp32"  # train.precision=auto, this CPU's choice
    log = (tmp_path / "train.log").read_text()
    start = rows(tmp_path)[0]
    for text in (f"run dir {tmp_path}", f"model llama_tiny ({start['params'] / 1e3:.3g}k parameters), optimizer frugal",
                 "density 0.25 requested, 0.25 realised",
                 "batch 8 sequences per step = micro-batch 4 x accumulation 2 x 1 process; 8 steps",
                 f"device cpu, {precision}, ddp; planned memory", "step 4/8: validation loss"):
        assert text in log, (text, log)
    # a console that is not a terminal (captured here; a SLURM log) gets no bar, even with
    # train.progress_bar=true: the progress lines go to the console too
    console = capsys.readouterr()
    assert "step 2/8: loss" in log and "step 2/8: loss" in console.out
    assert "\r" not in console.err and "step/s" not in console.err and "s/step" not in console.err
    assert start["micro_batch_size"] == 4 and start["batch_size"] == 8 and start["device"] == "cpu"
    assert log.index("run dir") < log.index("step 2/8") < log.index("validation loss")


def test_evaluation_shows_progress_over_the_same_batches():
    from train_utils.report import EvalProgress

    class DM:
        loss_floor = 1.5

        def val_batches(self, n):
            return [{"n": i} for i in range(n)]

    shown, hidden = EvalProgress(DM(), enabled=True), EvalProgress(DM(), enabled=False)
    bar = shown.val_batches(3)
    assert len(bar) == 3 and list(bar) == DM().val_batches(3) and type(bar).__name__ == "tqdm"
    assert hidden.val_batches(3) == DM().val_batches(3) and shown.loss_floor == 1.5


def test_an_absurd_eta_for_the_device_is_warned_once(tmp_path, monkeypatch, capsys):
    from train_utils import report

    assert report.eta_warning(100, 0.5, "cpu") is None
    msg = report.eta_warning(200_000, 400.0, "cpu")
    assert "22,222 hours" in msg and "debug=toy" in msg
    monkeypatch.setattr(report, "ABSURD_ETA_S", 1e-3)  # the mechanism in a real run: any pace is absurd now
    assert run_inprocess(tmp_path, "train.steps=8") == 0
    assert (tmp_path / "train.log").read_text().count("warning: at ") == 1


def test_a_stopped_sweep_job_says_rerun_the_sweep(monkeypatch, tmp_path):
    from train_utils import naming, report

    monkeypatch.setattr(naming, "is_multirun", lambda hydra_cfg=None: True)
    msg = report.stopped_message("SIGTERM", 5, str(tmp_path / "3" / "checkpoints"), str(tmp_path / "3"))
    assert f"rerun the same -m command with hydra.sweep.dir={tmp_path}" in msg and "remaining jobs did not run" in msg
    monkeypatch.setattr(naming, "is_multirun", lambda hydra_cfg=None: False)
    assert f"hydra.run.dir={tmp_path / '3'}" in report.stopped_message("SIGTERM", 5, "c", str(tmp_path / "3"))


def test_optimizer_hooks_are_frugals_own_or_no_ops():
    import frugal
    from train_utils.hooks import OptimizerHooks

    w = torch.nn.Parameter(torch.ones(3))
    plain = OptimizerHooks(torch.optim.AdamW([w]))
    plain.observe_loss(1.0)
    assert (plain.active_blocks(), plain.pop_events(), plain.state_full_fraction(), plain.density_report()) == \
        (None, [], None, None)

    class Seen(torch.optim.SGD):
        losses = []

        def observe_loss(self, loss):
            self.losses.append(loss)

        def pop_events(self):
            return [{"event": "x"}]

    own = OptimizerHooks(Seen([w], lr=0.1))
    own.observe_loss(2.5)
    assert Seen.losses == [2.5] and own.pop_events() == [{"event": "x"}]
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    opt = frugal.FRUGAL(model, density=0.25)
    hooks = OptimizerHooks(opt)
    assert hooks.density_report() == opt.density_report() and hooks.state_full_fraction() == 0.25
    assert hooks.active_blocks() == opt.active_blocks()


def test_logged_rows_count_the_optimizer_state_once_per_change(tmp_path, monkeypatch):
    """`optimizer_state_bytes` is an all-reduce and a host read under FSDP2: the loop counts it at the
    first logged row and after each window switch (the same steps on every rank), not at every row.
    9 steps at update_gap 3, a row per step: 3 counts (the windows starting at steps 1, 4 and 7; the
    code before this counted at each of the 9 rows), and the last row's figure is what a fresh count
    at the end gives."""
    import train  # noqa: F401  (imported first: the end summary's own count keeps the real function)
    from train_utils import measure

    real, counts = measure.optimizer_state_bytes, []

    def counted(*args, **kwargs):
        counts.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "optimizer_state_bytes", counted)
    assert run_inprocess(tmp_path, "train.steps=9", "train.log_every=1", "optimizer.update_gap=3") == 0
    got = rows(tmp_path)
    switches = [r for r in got if r.get("event") == "switch"]
    train_rows = [r for r in got if "loss" in r and "event" not in r]
    assert len(train_rows) == 9 and [r["step"] for r in switches] == [1, 4, 7]
    assert len(counts) == 3
    end = [r for r in got if r.get("event") == "end"][-1]
    assert train_rows[-1]["optimizer_state_bytes"] == end["optimizer_state_bytes"] > 0
