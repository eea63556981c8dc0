"""The memory planner (train_utils/memory_plan.py) against independent references.

- Activations, term by term: the bytes the autograd graph of the real transformers LLaMA/GPT-2 saves
  (saved-tensor hooks, unique storages), for every precision regime: exact equality.
- Whole training steps: the allocator's peak of real steps on CPU (models.build_model, bf16 autocast,
  train.py's token_loss_sum, backward, optimizer step, accumulation, DDP buckets, FSDP2), measured in
  a process of its own with the profiler's allocation events (bench/memory_plan.py `measure_case`):
  within 10% (most cases agree to 1%), the step inside backward included.
- Table 2's optimizer-state column and the per-rank figures stated in issue 11.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import frugal
import models
from _forkserver import run_python
from _train_helpers import subprocess_env
from bench.memory_plan import VALIDATION_CASES, Case, measure_case, plan_case
from train_utils import memory_plan as mp
from train_utils.memory_plan import GIB, largest_micro_batch, plan_memory

ROOT = Path(__file__).resolve().parent.parent


def model_cfg(name: str, **changes) -> dict:
    from omegaconf import OmegaConf

    return {**OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml")), **changes}


def optimizer_cfg(name: str) -> dict:
    """configs/optimizer/<name>.yaml resolved as train.py resolves it."""
    from omegaconf import OmegaConf

    from bench.memory_plan import compose

    return OmegaConf.to_container(compose([f"optimizer={name}"]).optimizer, resolve=True)


# ---- activations: the formula against what autograd saves -------------------------------------------
SHRINK = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=97, max_position_embeddings=64)
TINY = {"llama": model_cfg("llama_tiny", intermediate_size=176, **SHRINK), "gpt2": model_cfg("gpt2_124m", **SHRINK)}
# (weights in bf16, autocast): DDP bf16-mixed, pure bf16, fp32, FSDP bf16-mixed (bf16 weights + autocast)
REGIMES = {"bf16-mixed": (False, True), "bf16": (True, False), "fp32": (False, False),
           "fsdp-bf16-mixed": (True, True)}


def _is_weight_cast(t: torch.Tensor) -> bool:
    """A bf16 copy autocast made of a parameter (possibly transposed): ToCopy of an AccumulateGrad leaf."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
        fn = fn.next_functions[0][0]
    return (fn is not None and type(fn).__name__ == "ToCopyBackward0"
            and type(fn.next_functions[0][0]).__name__ == "AccumulateGrad")


def saved_bytes(model, ids, bf16_weights: bool, autocast: bool) -> tuple[int, int]:
    """(activation bytes, weight-cast bytes) the forward pass saves for backward: unique storages of
    the saved tensors that are neither parameters nor autocast's weight copies / are such copies."""
    if bf16_weights:
        model.to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[bool, int]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (_is_weight_cast(t), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, use_cache=False)
    return (sum(n for cast, n in seen.values() if not cast), sum(n for cast, n in seen.values() if cast))


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layer_terms_equal_the_saved_tensors(family, regime):
    cfg = TINY[family]
    bf16_weights, autocast = REGIMES[regime]
    torch.manual_seed(0)
    model = models.build_model(cfg)
    for module in model.modules():  # GPT-2's dropout: on CPU it changes the attention kernel
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batch, seq = 3, 16
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    activations, casts = saved_bytes(model, ids, bf16_weights, autocast)

    facts = dataclasses.replace(mp._facts(cfg, {"name": "adamw"}, "fp32", None), dropout=(0.0, 0.0, 0.0))
    regime_ = mp._Regime(weight_bytes=2 if bf16_weights else 4, autocast=autocast, cuda=False)
    layer, head = mp._layer_terms(facts, batch * seq, seq, regime_)
    assert activations == facts.layers * sum(layer.values()) + sum(head.values()), (layer, head)
    assert casts == (2 * facts.matmul_weights if regime_.casts_weights else 0)


def test_cuda_terms_differ_from_cpu_only_where_autocast_does():
    """LLaMA saves the same on CUDA and CPU; GPT-2's gelu_new runs in fp32 from pow onwards under CUDA
    autocast (pow is on CUDA's fp32 list, not CPU's) and its dropout masks are bool on CUDA."""
    llama = mp._facts(TINY["llama"], {"name": "adamw"}, "bf16-mixed", None)
    gpt2 = dataclasses.replace(mp._facts(TINY["gpt2"], {"name": "adamw"}, "bf16-mixed", None),
                               dropout=(0.1, 0.1, 0.1))
    cpu, cuda = mp._Regime(4, True, False), mp._Regime(4, True, True)
    assert mp._layer_terms(llama, 48, 16, cpu) == mp._layer_terms(llama, 48, 16, cuda)
    gelu_cpu = mp._layer_terms(gpt2, 48, 16, cpu)[0]["MLP (gelu_new)"]
    gelu_cuda = mp._layer_terms(gpt2, 48, 16, cuda)[0]["MLP (gelu_new)"]
    assert (gelu_cpu, gelu_cuda) == (10 * 48 * 256, 16 * 48 * 256)
    assert mp._layer_terms(gpt2, 48, 16, cuda)[0]["dropout masks"] == 2 * 48 * 64  # one byte each


def test_a_family_is_planned_from_its_entry_in_models(monkeypatch):
    """The planner reads a family's block facts from models.FAMILY: a new entry needs no planner edit,
    and an entry that declares none is refused with the families it can plan."""
    monkeypatch.setitem(models.FAMILY, "llama_alias", models.FAMILY["llama"])
    alias = mp._facts(dict(TINY["llama"], family="llama_alias"), {"name": "adamw"}, "bf16-mixed", None)
    llama = mp._facts(TINY["llama"], {"name": "adamw"}, "bf16-mixed", None)
    regime = mp._Regime(4, True, True)
    assert mp._layer_terms(alias, 48, 16, regime) == mp._layer_terms(llama, 48, 16, regime)
    monkeypatch.setitem(models.FAMILY, "bare", models.Family(models.FAMILY["llama"].build))
    with pytest.raises(ValueError, match=r"'bare' .*declares no activations.*\['llama', 'gpt2', 'llama_alias'\]"):
        mp._facts(dict(TINY["llama"], family="bare"), {"name": "adamw"}, "fp32", None)


# ---- whole steps: the plan against the allocator's peak of a real step on CPU -----------------------
@pytest.fixture(scope="module")
def measured():
    """bench/memory_plan.py --validate: (peak, optimizer-step peak) per case, every case in one process of
    one thread, forked from the tests' warm interpreter (tests/_forkserver.py; allocations are counted from
    the start of each case's profile, so what the interpreter held before does not count). One process,
    not two: each process pays ~15 CPU-s of its own before its first case (imports, inductor's start-up
    and the compiled sign update's graphs), more than splitting the cases saves on two loaded cores."""
    proc = run_python([sys.executable, "-m", "bench.memory_plan", "--validate", "--json"], cwd=ROOT,
                      env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(measured) == len(VALIDATION_CASES)
    return measured


@pytest.mark.slow  # the measured fixture: 23 cases of two real steps in one forked process: ~30 CPU-s
# (case 18, compiled, alone 24 s with an empty inductor cache, 6 s warm); ~90 CPU-s with torch held to AVX2
@pytest.mark.parametrize("index", range(len(VALIDATION_CASES)))
def test_plan_matches_measured_peak(measured, index):
    case = VALIDATION_CASES[index]
    (peak, step_peak), planned = measured[index], plan_case(case)
    assert abs(planned / peak - 1) <= 0.10, f"{case}: measured {peak}, planned {planned}"
    assert planned >= 0.98 * peak, f"{case}: the plan is optimistic: measured {peak}, planned {planned}"
    step_planned = plan_case(case, "optimizer step")
    report = f"{case}: optimizer step measured {step_peak}, planned {step_planned}"
    assert step_planned >= 0.98 * step_peak, report
    # The plan takes a block switch at the optimizer's contract, resting state + at most one block
    # (DESIGN.md, invariant 9); an optimizer that frees leaving blocks first may stay below it.
    assert step_planned <= 1.15 * step_peak + switch_allowance(case), report


def switch_allowance(case: Case) -> int:
    """State bytes of one block (layer) when a block switch can happen, else 0."""
    opt = case.optimizer
    block = opt["name"] in ("frugal", "badam") and opt.get("projection", "block") == "block"
    if not (block and 0 < opt.get("density", 0.25) < 1):
        return 0
    facts = mp._facts(model_cfg(case.model), opt, case.precision, case.vocab)
    moments = 1 if opt.get("state_full") in ("lion", "sgdm") else 2
    return moments * (2 if case.precision == "bf16" else 4) * facts.layer_matmul_weights


@pytest.mark.slow
def test_bucket_view_saves_a_gradient_copy_only_with_in_place_zeroing(measured):
    """DDP(gradient_as_bucket_view=True) + zero_grad(set_to_none=False): no second copy; with
    set_to_none=True, no_sync micro-batches allocate fresh gradients beside the buckets."""
    grads = mp._facts(model_cfg("llama_20m"), {"name": "adamw"}, "bf16-mixed", 1000).params * 4
    peaks = {c.wrapper: m[0] for c, m in zip(VALIDATION_CASES, measured) if c.wrapper.startswith("ddp")}
    in_place, no_view, to_none = peaks["ddp"], peaks["ddp-no-view"], peaks["ddp-set-to-none"]
    assert abs((no_view - in_place) / grads - 1) < 0.01
    assert abs((to_none - in_place) / grads - 1) < 0.01


@pytest.mark.slow
def test_switch_of_two_blocks_stays_within_one_block_of_the_steady_state():
    """The plan counts a switch as the optimizer does it (leaving blocks freed before entering ones
    are allocated); density 0.5 of 4 layers switches 2 blocks at once. In fp32: the step's tensors
    (fp32 weights, gradients and state) are those of bf16-mixed, whose autocast matmuls cost ~7x more
    on a CPU without native bf16."""
    case = Case("llama_20m", 1000, {"name": "badam", "density": 0.5, "update_gap": 1}, 4, 128, precision="fp32")
    _, step_peak = measure_case(case)
    assert step_peak <= 1.02 * plan_case(case, "optimizer step")


# ---- the paper's numbers -----------------------------------------------------------------------------
TABLE2_GIB = {  # Table 2's memory column: method -> 60M, 130M, 350M, 1B
    "adamw": (0.43, 1.00, 2.74, 9.98), "galore": (0.30, 0.54, 1.10, 3.41), "badam": (0.29, 0.52, 1.05, 3.23),
    "frugal": (0.29, 0.52, 1.05, 3.23), "frugal_rho0": (0.24, 0.37, 0.49, 0.98),
}


@pytest.mark.parametrize("method", list(TABLE2_GIB))
def test_optimizer_state_is_table2(method):
    opt = optimizer_cfg(method)
    for model, paper in zip(("llama_60m", "llama_130m", "llama_350m", "llama_1b"), TABLE2_GIB[method]):
        plan = plan_memory(model_cfg(model), opt, micro_batch_size=1, seq_len=256)
        if method != "galore":
            assert round(plan.optimizer_state / GIB, 2) == paper, model
            continue
        # Appendix D counts GaLore's projection on the larger side; the optimizer (like GaLore's code)
        # holds it on the smaller side, and the planner counts what is held.
        meta = mp._meta_model(json.dumps(model_cfg(model), sort_keys=True, default=str), False, None)
        hp = {k: v for k, v in opt.items() if k != "name"}
        assert round(frugal.estimate_state_bytes(meta, "galore", **hp) / GIB, 2) == paper
        assert plan.optimizer_state == frugal.estimate_state_bytes(meta, "galore", svd_layout="implementation",
                                                                   **hp) > paper * GIB


def test_issue_figures():
    """Issue 11: per rank, DDP, no checkpointing, before the CUDA context: 3B micro 16 AdamW ~74 GiB,
    FRUGAL 0.25 ~60; 7B micro 8 AdamW ~153, FRUGAL 0 ~104. They hold a second gradient copy (today's
    DDP without gradient_as_bucket_view); keeping the gradients in the buckets saves 4 bytes/param."""
    figures = [("llama_3b", 16, {"name": "adamw"}, 74), ("llama_3b", 16, {"name": "frugal", "density": 0.25}, 60),
               ("llama_7b", 8, {"name": "adamw"}, 153), ("llama_7b", 8, {"name": "frugal", "density": 0.0}, 104)]
    for model, micro, opt, gib in figures:
        kw = dict(micro_batch_size=micro, seq_len=256, world_size=8, parallelism="ddp")
        copy = plan_memory(model_cfg(model), opt, gradient_as_bucket_view=False, **kw)
        view = plan_memory(model_cfg(model), opt, **kw)
        assert abs(copy.total / GIB - gib) < 1.0, (model, opt, copy.total / GIB)
        assert copy.total - view.total == copy.gradients == copy.weights


def test_fsdp_shards_weights_gradients_and_state():
    cfg, opt = model_cfg("llama_1b"), {"name": "frugal", "density": 0.25}
    ddp = plan_memory(cfg, opt, micro_batch_size=8, seq_len=256, world_size=8)
    fsdp = plan_memory(cfg, opt, micro_batch_size=8, seq_len=256, world_size=8, parallelism="fsdp")
    for part in ("weights", "gradients", "optimizer_state"):
        assert getattr(fsdp, part) == -(-getattr(ddp, part) // 8)
    assert fsdp.total < ddp.total


def test_switch_transient_is_one_block_of_state():
    cfg = model_cfg("llama_60m")
    layer = 4 * 512 * 512 + 3 * 512 * 1376  # q, k, v, o, gate, up, down of one block

    def transient(density, **hp):
        p = plan_memory(cfg, {"name": "frugal", "density": density, **hp}, micro_batch_size=1, seq_len=256,
                        activation_checkpointing=True)
        return p.phases["optimizer step"] - (p.weights + p.gradients + p.comm_buffers + p.optimizer_state)

    # The compiled sign update (sign_update="auto": every weight here has >= 65536 elements) makes no
    # temporary; AdamW's fused kernel neither: only a switch's entering block counts.
    assert transient(0.25) == 2 * 4 * layer  # AdamW's two fp32 moments of the entering block
    assert transient(0.0) == 0  # nothing ever enters
    assert transient(1.0) == 0  # everything stays, nothing is state-free
    # The eager sign update makes one sign(g) at a time: the largest state-free weight.
    assert transient(0.0, sign_update="eager") == 4 * 512 * 1376


def test_split_temporaries_are_one_batch_of_tensors():
    """Column projections gather the reduced weights and gradients of one batch of split tensors at
    a time (frugal/optimizer.py: at most 8 tensors of one param group, i.e. one LLaMA layer), not of
    every tensor: 2 x 4 bytes x one layer's reduced elements."""
    from frugal.optimizer import _BATCH_TENSORS

    plan = plan_memory(model_cfg("llama_60m"), {"name": "frugal", "density": 0.25, "projection": "column"},
                       micro_batch_size=1, seq_len=256)
    transient = plan.phases["optimizer step"] - (plan.weights + plan.gradients + plan.optimizer_state)
    layer = [(512, 512)] * 4 + [(1376, 512)] * 2 + [(512, 1376)]  # q, k, v, o, gate, up, down: (out, in)
    assert len(layer) <= _BATCH_TENSORS
    reduced = sum(out * round(0.25 * inp) for out, inp in layer)  # a quarter of the input columns
    assert transient == 2 * 4 * reduced  # 8 layers: an eighth of what gathering every tensor would cost


def test_compiled_loss_keeps_the_logits_gradient_only():
    """Eager cross-entropy keeps three fp32 tensors of micro x seq x vocab at the start of backward
    (14 bytes per entry with the bf16 logits); the compiled loss the logits and their gradient (4)."""
    cfg, B, S, V = model_cfg("llama_1b"), 64, 256, 32000
    eager = plan_memory(cfg, {"name": "adamw"}, micro_batch_size=B, seq_len=S, activation_checkpointing=True)
    compiled = plan_memory(cfg, {"name": "adamw"}, micro_batch_size=B, seq_len=S, activation_checkpointing=True,
                           compiled_loss=True)
    base = eager.phases["loss backward"] - (2 * B * S * V + 12 * B * (S - 1) * V)
    assert compiled.phases["loss backward"] == base + 4 * B * S * V + 4 * B * S
    assert round((eager.phases["loss backward"] - base) / GIB, 1) == 6.8  # the figure of docs/memory_plan.md


# ---- the micro-batch search and the questions it answers ----------------------------------------------
def test_largest_micro_batch_is_the_largest_candidate_that_fits():
    cfg, opt = model_cfg("llama_130m"), {"name": "adamw"}
    need = {m: plan_memory(cfg, opt, micro_batch_size=m, seq_len=256).required for m in (16, 32)}
    micro, plan = largest_micro_batch(cfg, opt, device_bytes=need[16] + (need[32] - need[16]) // 2, seq_len=256)
    assert micro == 16 and plan.required == need[16]
    assert largest_micro_batch(cfg, opt, device_bytes=10**6, seq_len=256)[0] is None
    assert mp.micro_batch_candidates(512, 8) == [64, 32, 16, 8, 4, 2, 1]
    assert mp.micro_batch_candidates(96, 1)[:3] == [96, 48, 32]


def test_llama_7b_frugal_rho0_on_one_80gb_a100():
    """The question of the brief: yes, with micro-batch 4 (or 32 with activation checkpointing)."""
    cfg, opt, device = model_cfg("llama_7b"), {"name": "frugal", "density": 0.0}, mp.DEVICES["a100-80gb"]
    for checkpointing in (False, True):
        micro, plan = largest_micro_batch(cfg, opt, device_bytes=device, seq_len=256,
                                          activation_checkpointing=checkpointing)
        assert micro is not None and plan.fits(device)
        bigger = plan_memory(cfg, opt, micro_batch_size=2 * micro, seq_len=256,
                             activation_checkpointing=checkpointing)
        assert not bigger.fits(device)
    adamw = plan_memory(cfg, {"name": "adamw"}, micro_batch_size=1, seq_len=256, activation_checkpointing=True)
    assert not adamw.fits(device)  # 16 bytes per parameter are 100 GiB before any activation


# ---- interface -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    (dict(parallelism="zero3"), ["parallelism", "zero3", "ddp", "fsdp"]),
    (dict(precision="fp16"), ["precision", "fp16", "bf16-mixed"]),
    (dict(micro_batch_size=0), ["micro_batch_size", "0"]),
    (dict(world_size=2.5), ["world_size", "2.5"]),
    (dict(seq_len=2048), ["seq_len", "2048", "max_position_embeddings"]),
    (dict(device_type="tpu"), ["device_type", "tpu", "cuda"]),
])
def test_bad_values_name_the_value_and_the_choices(kwargs, words):
    args = dict(micro_batch_size=1, seq_len=256) | kwargs
    with pytest.raises(ValueError) as err:
        plan_memory(model_cfg("llama_tiny"), {"name": "adamw"}, **args)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_bad_optimizer_and_model_are_refused():
    with pytest.raises(ValueError, match="adamx.*valid choices"):
        plan_memory(model_cfg("llama_tiny"), {"name": "adamx"}, micro_batch_size=1, seq_len=64)
    with pytest.raises(ValueError, match="name"):
        plan_memory(model_cfg("llama_tiny"), {"density": 0.25}, micro_batch_size=1, seq_len=64)
    with pytest.raises(ValueError, match="family"):
        plan_memory(model_cfg("llama_tiny", family="mamba"), {"name": "adamw"}, micro_batch_size=1, seq_len=64)


def test_plan_accepts_dictconfig_and_reports():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(model_cfg("llama_tiny"))
    plan = plan_memory(cfg, OmegaConf.create({"name": "adamw"}), micro_batch_size=2, seq_len=64)
    d = plan.as_dict()
    assert d["total"] == plan.total == sum(d[p] for p in mp.MemoryPlan.PARTS)
    assert d["required"] == plan.total + plan.allowance and plan.phase in d["phases"]
    assert plan.phases[plan.phase] == max(plan.phases.values()) == plan.total
    text = plan.format(mp.DEVICES["a100-80gb"])
    assert "llama_tiny" in text and "fits" in text


def test_device_memory():
    assert 0 < mp.device_memory("cpu") <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ValueError, match="meta.*cuda, cpu"):
        mp.device_memory("meta")


@pytest.mark.slow
def test_cli(capsys):
    from bench.memory_plan import main

    assert main(["model=llama_7b", "optimizer=frugal_rho0", "train.micro_batch_size=4"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["model=llama_7b", "optimizer=adamw"]) == 1  # does not fit: exit code 1
    assert main(["model=llama_130m", "optimizer=adamw", "--search", "--activation-checkpointing", "off"]) == 0
    assert "largest micro-batch that fits" in capsys.readouterr().out
    # the search is not capped by the configured batch (8 sequences): it says what train.py can take
    assert main(["model=llama_7b", "optimizer=frugal_rho0", "--search", "--activation-checkpointing", "on"]) == 0
    out = capsys.readouterr().out
    assert "largest micro-batch that fits: 32" in out
    assert "train.batch_size=8 over 1 process(es) needs a micro-batch that divides 8: train.micro_batch_size=8, " \
           "or train.batch_size=32 (or a multiple of it) to use 32" in out
    from bench.memory_plan import usable_micro_batch

    assert usable_micro_batch(32, 512, 8) is None  # 64 per process: 32 divides it
    assert usable_micro_batch(32, 48, 1).startswith("  train.batch_size=48 over 1 process(es) needs a micro-batch "
                                                    "that divides 48: train.micro_batch_size=24")
    assert main(["--table", "--models", "llama_60m", "--optimizers", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "| llama_60m | AdamW |" in out
    assert main(["model=llama_tiny", "--parallelism", "fsdp", "--seq-len", "4096"]) == 2
    assert "seq_len" in capsys.readouterr().err




def test_host_memory_respects_cgroup_limits(tmp_path):
    """A SLURM job's --mem (a cgroup limit on the job, an ancestor of the task's cgroup) bounds what
    the start-up check may count on, not the node's MemAvailable; v1 and v2, file cache reclaimable."""
    from train_utils.memory_plan import cgroup_available

    gib = 2**30

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    v2 = tmp_path / "v2"
    job = v2 / "slurm" / "job_7"
    write(tmp_path / "cg2", "0::/slurm/job_7/step_0\n")
    write(job / "memory.max", f"{8 * gib}\n")
    write(job / "memory.current", f"{3 * gib}\n")
    write(job / "memory.stat", f"anon 1\ninactive_file {gib}\n")
    write(job / "step_0" / "memory.max", "max\n")
    assert cgroup_available(str(tmp_path / "cg2"), str(v2)) == 6 * gib  # 8 - 3 + 1 (cache)

    v1 = tmp_path / "v1"
    write(tmp_path / "cg1", "5:cpu:/x\n4:memory:/job\n0::/\n")
    write(v1 / "memory" / "job" / "memory.limit_in_bytes", f"{4 * gib}\n")
    write(v1 / "memory" / "job" / "memory.usage_in_bytes", f"{gib}\n")
    write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit at the root
    assert cgroup_available(str(tmp_path / "cg1"), str(v1)) == 3 * gib

    write(tmp_path / "none", "4:memory:/\n0::/\n")
    assert cgroup_available(str(tmp_path / "none"), str(v1 / "empty")) is None


def _listed_changes(out: str) -> list[list[str]]:
    """The command-line changes of the planner's "what would fit" lines."""
    lines = out.split("what would fit (cheapest first):\n")[1].splitlines()
    return [line.split("  ")[2].split() if line.startswith("    ") else [] for line in lines if line.startswith("    ")]


@pytest.mark.parametrize("run,device,expected", [
    # 7B, FRUGAL rho=0, pure bf16, clipping, on one 24 GB card: only the step in backward together with
    # checkpointing fits on one card; or FSDP2 over 4
    (["model=llama_7b", "optimizer=frugal_rho0", "train.precision=bf16", "train.grad_clip=1.0",
      "train.batch_size=16"], "rtx-24gb", ["train.optimizer_in_backward=true", "--world-size"]),
    # 1B AdamW at micro-batch 128 on 80 GB: checkpointing, or the largest smaller micro-batch
    (["model=llama_1b", "optimizer=adamw", "train.batch_size=512", "train.micro_batch_size=128"], "a100-80gb",
     ["train.activation_checkpointing=true", "train.micro_batch_size=64"]),
])
@pytest.mark.slow
def test_a_run_that_does_not_fit_gets_the_changes_that_would(run, device, expected, capsys):
    """Each change listed, applied to the same command, plans a run that fits (exit 0)."""
    from bench.memory_plan import main

    assert main(run + ["--device", device]) == 1
    out = capsys.readouterr().out
    listed = _listed_changes(out)
    assert listed and all(any(word in " ".join(change) for change in listed) for word in expected), out
    for change in listed:
        args = [c for c in change if not c.startswith("--") and not c.isdigit()]
        world = change[change.index("--world-size") + 1] if "--world-size" in change else "1"
        assert main(run + args + ["--device", device, "--world-size", world]) == 0, change
        capsys.readouterr()


def test_gpu_hours_from_the_run_s_flops(capsys):
    """--gpu-hours: 6 x (the weights a position passes through) + attention, per trained position, over
    the device's dense bf16 peak at the MFU; checked against the same count from the model's shape."""
    from bench.memory_plan import main

    run = ["model=llama_1b", "optimizer=frugal", "train.steps=1000", "train.batch_size=512", "data.seq_len=256",
           "train.micro_batch_size=16"]
    assert main(run + ["--gpu-hours", "--device", "h100-80gb", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)["compute"]
    d, ff, layers, vocab = 2048, 5461, 24, 32000
    weights = layers * (4 * d * d + 3 * d * ff + 2 * d) + d + vocab * d  # blocks, final norm, head (untied)
    flops = (6 * weights + 12 * layers * d * 256) * 1000 * 512 * 256
    assert est["flops"] == pytest.approx(flops, rel=1e-9)
    assert est["gpu_hours"] == pytest.approx(flops / (989e12 * 0.4) / 3600, rel=1e-9)
    assert main(run + ["--gpu-hours", "--device", "a100-80gb", "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert f"~{flops / (312e12 * 0.5) / 3600:,.0f} GPU-hours (an estimate" in out and "MFU 50% measured" in out
    with pytest.raises(SystemExit):
        main(run + ["--gpu-hours", "--mfu", "40"])  # a percentage, not a fraction: refused
    assert "--mfu 40.0: expected a fraction in (0, 1]" in capsys.readouterr().err
