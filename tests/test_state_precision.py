"""Low-precision state-full moments (frugal.state_precision): 8 bits against bitsandbytes' own 8-bit
optimizers on the same tensors, bf16 against a float64 re-implementation, and FRUGAL's contract
(fast path = reference path, exact resume, the step inside backward, estimate = measured bytes)."""
import copy
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import frugal
from frugal import FRUGAL, HyperparameterError, estimate_state_bytes, state_bytes, step_in_backward
from frugal import state_precision
from frugal.rules import STATE_FULL

bnb = pytest.importorskip("bitsandbytes")  # a test dependency (requirements.txt); the library's 8bit extra


def mlp(seed=0):
    torch.manual_seed(seed)
    # two matrices above bitsandbytes' min_8bit_size (4096 elements), one matrix and biases below it
    return torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Linear(96, 80), torch.nn.Linear(80, 3))


def set_grads(params_a, params_b, step):
    g = torch.Generator().manual_seed(step)
    for a, b in zip(params_a, params_b):
        grad = torch.randn(a.shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()


def whole(model, **kw):
    """FRUGAL with every tensor state-full: AdamW (or ``state_full``) on the whole model."""
    return FRUGAL([{"params": list(model.parameters()), "projectable": False}], **kw)


@pytest.mark.parametrize("rule,reference", [("adamw", "AdamW8bit"), ("lion", "Lion8bit")])
def test_8bit_equals_bitsandbytes(rule, reference):
    ours, theirs = mlp(), mlp()
    kw = {"betas": (0.9, 0.99)} if rule == "lion" else {}
    opt = whole(ours, lr=1e-2, weight_decay=0.1, state_full=rule, state_precision="8bit", **kw)
    ref = getattr(bnb.optim, reference)(theirs.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    for step in range(6):
        set_grads(list(ours.parameters()), list(theirs.parameters()), step)
        opt.step()
        ref.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
        mine, bnbs = opt.state[p], ref.state[q]
        if p.numel() >= state_precision.MIN_8BIT_NUMEL:  # the same codes and scales
            assert mine["exp_avg"].dtype == torch.uint8
            assert torch.equal(mine["exp_avg"], bnbs["state1"])
            torch.testing.assert_close(mine["exp_avg_absmax"], bnbs["absmax1"], rtol=1e-6, atol=0)
            if rule == "adamw":
                assert torch.equal(mine["exp_avg_sq"], bnbs["state2"])
        else:  # small tensors keep full-precision moments, as bitsandbytes' min_8bit_size
            assert mine["exp_avg"].dtype == torch.float32


def test_bf16_moments_equal_a_float64_reimplementation():
    model = mlp()
    opt = whole(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, state_precision="bf16")
    ref = {p: (p.detach().double(), torch.zeros_like(p, dtype=torch.bfloat16),
               torch.zeros_like(p, dtype=torch.bfloat16)) for p in model.parameters()}
    for step in range(1, 6):
        set_grads(list(model.parameters()), list(model.parameters()), step)
        opt.step()
        for p, (w, m, v) in ref.items():
            g = p.grad.double()
            m64 = 0.9 * m.double() + 0.1 * g
            v64 = 0.95 * v.double() + 0.05 * g * g
            w.mul_(1 - 1e-2 * 0.1).sub_(1e-2 * (m64 / (1 - 0.9 ** step))
                                        / ((v64 / (1 - 0.95 ** step)).sqrt() + 1e-8))
            m.copy_(m64), v.copy_(v64)  # stored in bf16
    for p, (w, m, v) in ref.items():
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(p.double(), w, rtol=0, atol=1e-6)
        # a moment computed in float32 may round to the neighbouring bf16 value of the float64 one
        torch.testing.assert_close(opt.state[p]["exp_avg"].float(), m.float(), rtol=2 ** -7, atol=1e-12)


VOCAB = 64


def tiny_llama(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def train(model, opt, steps, in_backward=False, max_norm=None, check_reference=False):
    """``steps`` steps of a fixed batch stream; ``check_reference``: before each one, a copy of the
    model and the optimizer state takes the same step on the single-tensor reference path."""
    stepper = step_in_backward(opt, max_norm=max_norm) if in_backward else None
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        if max_norm and not in_backward:  # the global norm as the step inside backward takes it
            params = [p for group in opt.param_groups for p in group["params"]]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, frugal.grad_norm(params))
        if check_reference:
            twin = copy.deepcopy(model)
            for p, q in zip(model.parameters(), twin.parameters()):
                q.grad = p.grad.clone()
            ref = FRUGAL(twin, foreach=False, **{k: v for k, v in opt.defaults.items() if k != "foreach"})
            ref.load_state_dict(copy.deepcopy(opt.state_dict()))
            ref.step()
        opt.step()
        opt.zero_grad()
        if check_reference:
            for p, q in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    if stepper is not None:
        stepper.remove()
    return model


HP = dict(lr=3e-3, weight_decay=0.1, density=0.5, update_gap=2, seed=3)


@pytest.mark.parametrize("precision", ["8bit", "bf16"])
def test_frugal_paths_resume_in_backward_and_bytes(precision):
    """Across block switches: each step of the fast path equals the single-tensor reference's from
    the same state; the step inside backward (with clipping) equals the ordinary step; a state_dict
    resumes bit for bit in a new optimizer; the estimate is the measured state to the byte."""
    fast = tiny_llama()
    opt = FRUGAL(fast, state_precision=precision, **HP)
    model_bytes = estimate_state_bytes(tiny_llama(), "frugal", state_precision=precision, **HP)
    train(fast, opt, 3, check_reference=True)
    assert state_bytes(opt) == model_bytes
    codes = torch.uint8 if precision == "8bit" else torch.bfloat16
    assert opt.state[fast.model.embed_tokens.weight]["exp_avg"].dtype == codes
    # resume: a new model and optimizer from the state dicts, then 4 more steps on both
    resumed = copy.deepcopy(fast)
    opt2 = FRUGAL(resumed, state_precision=precision, **HP)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for s, s2 in zip(opt.state.values(), opt2.state.values()):
        assert {k: v.dtype for k, v in s.items()} == {k: v.dtype for k, v in s2.items()}
    train(fast, opt, 4, check_reference=True)
    train(resumed, opt2, 4)
    for p, q in zip(fast.parameters(), resumed.parameters()):
        assert torch.equal(p, q)

    # the step inside backward: 7 steps (3 switches) bit for bit, with and without clipping (one norm
    # formula and order in both schedules: frugal.grad_norm)
    for max_norm in (None, 0.5):
        ordinary, hooked = tiny_llama(), tiny_llama()
        train(ordinary, FRUGAL(ordinary, state_precision=precision, **HP), 7, max_norm=max_norm)
        train(hooked, FRUGAL(hooked, state_precision=precision, **HP), 7, in_backward=True, max_norm=max_norm)
        for p, q in zip(ordinary.parameters(), hooked.parameters()):
            assert torch.equal(p, q)


def test_pure_bf16_with_stochastic_rounding_and_8bit_state():
    model = tiny_llama(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    opt = FRUGAL(model, state_precision="8bit", stochastic_rounding=True, **HP)
    train(model, opt, 3)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert state_bytes(opt) == estimate_state_bytes(tiny_llama(torch.bfloat16), "frugal", state_precision="8bit",
                                                    stochastic_rounding=True, **HP)
    embed = opt.state[model.model.embed_tokens.weight]
    assert embed["exp_avg"].dtype == torch.uint8 and embed["exp_avg_absmax"].dtype == torch.float32
    # the moments are about the same as in the weights' dtype: 8 bits lose precision, not the signal
    plain = tiny_llama(torch.bfloat16)
    opt_plain = FRUGAL(plain, stochastic_rounding=True, **HP)
    train(plain, opt_plain, 3)
    m8 = state_precision.decode(embed, "exp_avg", 0, embed["exp_avg"].numel(), torch.float32)
    m16 = opt_plain.state[plain.model.embed_tokens.weight]["exp_avg"].float().view(-1)
    assert torch.corrcoef(torch.stack([m8, m16]))[0, 1] > 0.99


@pytest.mark.parametrize("kw,words", [
    ({"state_precision": "4bit"}, ["state_precision", "4bit", "param, bf16, 8bit"]),
    ({"state_precision": "8bit", "projection": "column"}, ["'column'", "projection 'block'"]),
    ({"state_precision": "bf16", "state_full": "adafactor_momentum", "projection": "column"},
     ["elementwise", "adamw, adamw_hf, lion, sgdm"]),
])
def test_bad_state_precision_names_the_valid_choices(kw, words):
    with pytest.raises(HyperparameterError) as err:
        FRUGAL(tiny_llama(), **kw)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kw,words", [
    ({"projection": "svd"}, ["projection 'svd'", "valid choices: projection 'block'"]),
    ({"state_full": "muon"}, ["elementwise state-full rule; got state_full 'muon'"]),
    ({"state_full": "muon", "density": 1.0}, ["elementwise state-full rule; got state_full 'muon'"]),
])
def test_8bit_moments_refuse_what_they_cannot_store(kw, words):
    """8-bit moments are decoded a chunk at a time (elementwise rules only) and stored for whole tensors
    (block projection): svd's reduced moments and Muon's whole-matrix update are refused by name."""
    with pytest.raises(HyperparameterError) as err:
        FRUGAL(tiny_llama(), state_precision="8bit", **kw)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_8bit_moments_refuse_fsdp2_shards():
    """FSDP2 shards' state is checkpointed as DTensors in the weights' dtype: refused with the valid choice
    (the check FRUGAL's group validation runs with sharded=True for DTensor parameters)."""
    group = {"state_precision": "8bit", "master_weights": False, "state_full": "adamw", "projection": "block"}
    state_precision.check(group, STATE_FULL["adamw"], True, sharded=False)  # unsharded: accepted
    with pytest.raises(HyperparameterError, match="state_precision '8bit' is not supported for FSDP2 shards.*"
                                                  "valid choice with FSDP2: 'param'"):
        state_precision.check(group, STATE_FULL["adamw"], True, sharded=True)


def test_8bit_without_bitsandbytes_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        train(mlp_model := tiny_llama(), FRUGAL(mlp_model, state_precision="8bit", **HP), 1)
    assert frugal.FRUGAL(tiny_llama(), state_precision="bf16", **HP)  # bf16 needs nothing


def test_llama7b_rho025_preset_fits_a_24gb_card_with_8bit_moments():
    """experiment=llama7b_single_gpu_rho025: the 7B single-GPU recipe at density 0.25 with 8-bit
    moments, at the largest micro-batch the planner allows on a 24 GB card (and what it needs)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from train_utils.memory_check import in_backward_settings
    from train_utils.memory_plan import DEVICES, plan_memory

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "configs"), version_base=None):
        cfg = compose("config", overrides=["experiment=llama7b_single_gpu_rho025"])
    OmegaConf.resolve(cfg)
    opt = OmegaConf.to_container(cfg.optimizer)
    assert (opt["name"], opt["density"], opt["state_precision"], opt["lr"], opt["update_gap"]) == (
        "frugal", 0.25, "8bit", 5e-4, 500)
    assert cfg.train.grad_clip == 1.0 and cfg.train.optimizer_in_backward and cfg.train.precision == "bf16"
    settings = in_backward_settings(cfg, 1)

    def plan(micro, **changes):
        return plan_memory(cfg.model, {**opt, **changes}, micro_batch_size=micro, seq_len=cfg.data.seq_len,
                           precision="bf16", activation_checkpointing=True, **settings)

    card = DEVICES["rtx-24gb"]
    # micro-batch 4 fits by 0.03 GiB (docs/in_backward.md): the preset keeps 2, 0.24 GiB to spare; 8 does not fit
    assert cfg.train.micro_batch_size == 2 and plan(2).fits(card) and not plan(8).fits(card)
    assert card - plan(2).required > 0.2 * 2 ** 30 > card - plan(4).required
    assert not plan(2).fits(DEVICES["l4"])
    assert not plan(2, state_precision="bf16").fits(card)  # the 8 bits are what make it fit
    eight, half = plan(2).optimizer_state, plan(2, state_precision="bf16").optimizer_state
    assert 0.5 < eight / half < 0.52  # one byte per moment element and a float32 scale per 256


@pytest.mark.slow
def test_train_py_with_8bit_moments_in_backward_resumes_exactly(tmp_path):
    """train.py end to end, as the 7B rho 0.25 preset runs (pure bf16, stochastic rounding, the step in
    backward, clipping, 8-bit moments): the checkpoint holds the codes, and a resume is bit for bit."""
    from _train_helpers import assert_same_weights, losses, run_inprocess, weights
    from train_utils import checkpoint as ckpt

    # a quarter of the helpers' tokens per step (pure bf16 matmuls cost ~10x more without native bf16),
    # still two micro-batches per step
    run = ["train.precision=bf16", "optimizer.stochastic_rounding=true", "optimizer.state_precision=8bit",
           "train.optimizer_in_backward=true", "train.grad_clip=1.0", "train.steps=6", "data.seq_len=32",
           "train.batch_size=4", "train.micro_batch_size=2", "train.eval_tokens=256"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_inprocess(straight, *run) == 0
    assert run_inprocess(resumed, *run, "train.steps=3") == 0
    assert run_inprocess(resumed, *run, "train.resume_changes=[train.steps]") == 0
    assert losses(resumed) == losses(straight) and len(losses(straight)) == 6
    last = ckpt.latest(str(straight / ckpt.CHECKPOINT_DIR))
    saved = torch.load(f"{last}/optimizer.pt", map_location="cpu", weights_only=True)["state"]
    assert any(s.get("exp_avg", torch.zeros(0)).dtype == torch.uint8 and "exp_avg_absmax" in s for s in saved.values())
    assert_same_weights(weights(str(ckpt.latest(str(resumed / ckpt.CHECKPOINT_DIR)))), weights(str(last)))


def _peak_allocated(fn) -> int:
    """Peak bytes torch's CPU allocator holds while ``fn`` runs, above what it held at the start
    (the profiler's allocation events, as bench/memory_plan.py measures its validation cases)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort()
    return max(e[2] for e in events) - (events[0][2] - events[0][1])


@pytest.mark.parametrize("precision", ["param", "8bit"])
def test_single_tensor_path_works_a_chunk_at_a_time(precision, monkeypatch):
    """bf16 weights with stochastic rounding take the single-tensor path: a whole state-full tensor is
    updated a chunk at a time, bit for bit what the whole tensor at once gives (CPU: the rounding
    noise is one stream), with float32 copies of one chunk instead of the tensor."""
    n, chunk = 1 << 20, 1 << 16

    def run(chunk_size):
        monkeypatch.setattr(state_precision, "CHUNK", chunk_size)
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(n // 1024, 1024).bfloat16())
        opt = FRUGAL([{"params": [w], "projectable": False}], lr=1e-3, weight_decay=0.1, stochastic_rounding=True,
                     state_precision=precision)
        peaks = []
        for step in range(3):
            w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(step)).bfloat16()
            peaks.append(_peak_allocated(opt.step))
        return w.detach().clone(), opt.state[w], max(peaks[1:])  # the first step allocates the moments

    whole_w, whole_state, whole_peak = run(1 << 30)
    chunked_w, chunked_state, chunked_peak = run(chunk)
    assert torch.equal(whole_w, chunked_w)
    assert all(torch.equal(whole_state[k], chunked_state[k]) for k in whole_state)
    assert whole_peak >= 20 * n  # the float32 copy, the update, the rounding noise of the whole tensor
    assert chunked_peak <= 40 * chunk, (whole_peak, chunked_peak)
