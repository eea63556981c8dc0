"""FRUGAL's step inside backward (frugal.in_backward) against the ordinary step: the same weights
over steps that cross block switches, clipping, accumulation, non-finite gradients, resume."""
import contextlib
import copy
import math
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import frugal
from frugal import FRUGAL, NonFiniteGradientError, step_in_backward
from frugal.in_backward import waiting_numel
from frugal.grouping import param_groups
from train_utils.loop import enable_activation_checkpointing

VOCAB, LAYERS = 64, 4


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


def batches(n, seed=1, rows=2, length=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, length), generator=g) for _ in range(n)]


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def make(seed=0, **kw):
    model = tiny_llama(seed)
    opt = FRUGAL(model, lr=3e-3, weight_decay=0.1, update_gap=3, seed=5, **kw)
    # a schedule whose lr changes every step: each tensor must see the step's own
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def run_ordinary(steps, max_norm=None, accum=1, **kw):
    model, opt, sched = make(**kw)
    norms = []
    data = batches(steps * accum)
    for s in range(steps):
        for ids in data[s * accum:(s + 1) * accum]:
            (loss_of(model, ids) / accum).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), max_norm, norm)
        norms.append(float(norm))
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, norms


def run_in_backward(steps, max_norm=None, accum=1, start=None, **kw):
    model, opt, sched = make(**kw) if start is None else start
    stepper = step_in_backward(opt, max_norm=max_norm)
    norms = []
    data = batches(steps * accum)
    for s in range(steps):
        micro = data[s * accum:(s + 1) * accum]
        for ids in micro[:-1]:
            with stepper.accumulating():
                (loss_of(model, ids) / accum).backward()
        (loss_of(model, micro[-1]) / accum).backward()
        opt.step()
        sched.step()
        norms.append(float(stepper.grad_norm))
    return model, opt, norms, sched


def assert_same_weights(a, b, atol=2e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("projection", ["block", "column", "randk"])
@pytest.mark.parametrize("density", [0.0, 0.25])
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_equals_the_ordinary_step_across_switches(projection, density, max_norm):
    steps = 7  # update_gap 3: windows switch at steps 3 and 6
    ref, ref_opt, ref_norms = run_ordinary(steps, max_norm, projection=projection, density=density,
                                           reset_state="reset_all")
    got, opt, norms, _ = run_in_backward(steps, max_norm, projection=projection, density=density,
                                         reset_state="reset_all")
    if max_norm:
        assert min(ref_norms) > max_norm * 2  # the clipping changed every step's gradient
    assert_same_weights(ref, got)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert opt.step_count == ref_opt.step_count == steps
    pairs = list(zip(ref.parameters(), got.parameters()))
    # the same tensors hold state, and the same state
    assert [i for i, (p, q) in enumerate(pairs) if p in ref_opt.state] == [i for i, (p, q) in enumerate(pairs)
                                                                          if q in opt.state]
    for p, q in pairs:
        for key, value in ref_opt.state.get(p, {}).items():
            torch.testing.assert_close(opt.state[q][key], value, atol=2e-6, rtol=1e-5)


def test_accumulation_is_exact():
    ref, _, _ = run_ordinary(4, max_norm=0.05, accum=3, density=0.25)
    got, _, _, _ = run_in_backward(4, max_norm=0.05, accum=3, density=0.25)
    assert_same_weights(ref, got)


def roles(model, opt):
    """Names of the non-projectable tensors (always state-full) and of the projectable ones."""
    groups = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    fixed = {names[id(p)] for g in groups if not g.get("projectable") for p in g["params"]}
    return fixed, set(names.values()) - fixed


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_gradients_are_freed_during_backward_and_only_scale_dependent_ones_wait(max_norm):
    model, opt, _ = make(density=0.0)
    stepper = step_in_backward(opt, max_norm=max_norm)
    loss_of(model, batches(1)[0]).backward()
    held = {n for n, p in model.named_parameters() if p.grad is not None}
    fixed, projectable = roles(model, opt)
    # rho 0: every projectable tensor is state-free (signSGD), clip-invariant: updated and freed at once.
    # With clipping, the state-full tensors (AdamW) wait for the global norm; without, nothing waits.
    assert held == (fixed if max_norm else set())
    assert stepper.deferred_bytes == sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    # what the memory planner counts as held (frugal.in_backward.waiting_numel)
    assert stepper.deferred_bytes == 4 * waiting_numel(opt, clipping=max_norm is not None)
    assert stepper.applied == len(projectable if max_norm else fixed | projectable)
    opt.step()
    assert all(p.grad is None for p in model.parameters())


def test_a_scale_dependent_state_free_rule_waits_for_the_norm():
    model, opt, _ = make(density=0.0, state_free="sgd")
    stepper = step_in_backward(opt, max_norm=1.0)
    loss_of(model, batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())  # SGD's update scales with the clip
    assert stepper.applied == 0


def poison(param):
    """Make `param`'s next gradient NaN (a tensor hook runs before the gradient is accumulated)."""
    handle = param.register_hook(lambda g: g * float("nan"))
    return handle


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_late_non_finite_gradient_stops_the_step_and_says_what_moved(max_norm):
    model, opt, _ = make(density=0.0)
    step_in_backward(opt, max_norm=max_norm, model=model)
    late = model.model.layers[0].mlp.down_proj.weight  # layer 0's gradients come last in backward
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison(late)
    loss_of(model, batches(1)[0]).backward()
    with pytest.raises(NonFiniteGradientError) as err:
        opt.step()
    message = str(err.value)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert f"{len(moved)} of the step's tensors had already taken it" in message, message
    assert "step 1: model.layers.0.mlp.down_proj.weight (shape (32, 48))" in message  # the step, the tensor
    assert "model.layers.0.mlp.down_proj.weight" not in moved
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the NaN reached no weight
    assert "model.layers.0.self_attn.q_proj.weight" not in moved  # after it in backward: not updated
    assert moved and all(n.startswith(("model.layers.1", "model.layers.2", "model.layers.3", "model.norm",
                                       "lm_head")) for n in moved)
    if max_norm:  # the state-full tensors waited for the norm: none of them moved
        assert not moved & roles(model, opt)[0]
    assert opt.step_count == 0 and all(p.grad is None for p in model.parameters())


def test_a_non_finite_loss_moves_nothing():
    model, opt, _ = make(density=0.25)
    step_in_backward(opt, max_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    (loss_of(model, batches(1)[0]) * float("inf")).backward()
    with pytest.raises(NonFiniteGradientError, match="no tensor had taken it"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_state_dict_resumes_exactly_in_a_new_optimizer():
    kw = dict(density=0.25, reset_state="reset_all")
    full, _, _, _ = run_in_backward(7, max_norm=0.05, **kw)
    first, opt, _, sched = run_in_backward(4, max_norm=0.05, **kw)
    model, opt2, sched2 = make(**kw)
    stepper = step_in_backward(opt2, max_norm=0.05)  # attached before loading, as train.py does
    model.load_state_dict(first.state_dict())
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2._in_backward is stepper and copy.deepcopy(opt2)._in_backward is None
    # continue with the next three batches of the same stream
    for ids in batches(7)[4:]:
        loss_of(model, ids).backward()
        opt2.step()
        sched2.step()
    assert stepper.optimizer is opt2
    for p, q in zip(full.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_torch_hooks_schedulers_and_remove():
    model, opt, sched = make(density=0.25)
    stepper = step_in_backward(opt, max_norm=1.0)
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(o.step_count))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        loss_of(model, batches(1)[0]).backward()
        opt.step()
        sched.step()
    assert calls == [1]
    loss_of(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="a second backward reached .* before optimizer.step\\(\\).*accumulating"):
        loss_of(model, batches(1)[0]).backward()  # a forgotten optimizer.step(): never two steps in one count
    opt.zero_grad()  # abandons the step (StepInBackward.abort): the next backward starts a new one
    with pytest.raises(ValueError, match="already steps inside backward"):
        step_in_backward(opt)
    stepper.remove()
    loss_of(model, batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())  # the ordinary step again
    opt.step()
    assert opt.step_count == 2 and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_bad_input_is_refused(bad):
    model, opt, _ = make()
    with pytest.raises(ValueError, match=f"max_norm={bad}"):
        step_in_backward(opt, max_norm=bad)
    with pytest.raises(TypeError, match="AdamW.*valid choices"):
        step_in_backward(torch.optim.AdamW(model.parameters()))
    assert isinstance(frugal.StepInBackward(opt), frugal.StepInBackward)


@pytest.mark.parametrize("density", [0.0, 0.25])
def test_held_gradients_match_what_waits_at_every_window(density):
    """Block windows move; what waits for the norm keeps its size (the planner's count holds)."""
    model, opt, _ = make(density=density)
    stepper = step_in_backward(opt, max_norm=1.0)
    for ids in batches(7):
        expected = 4 * waiting_numel(opt)
        loss_of(model, ids).backward()
        assert stepper.deferred_bytes == expected
        opt.step()


def test_the_planner_holds_only_the_gradients_that_wait():
    from train_utils.memory_plan import plan_memory

    from _train_helpers import compose_cfg

    import models

    cfg = compose_cfg("model=llama_tiny")
    model = models.build_model(cfg.model, vocab_size=VOCAB)
    fixed = sum(p.numel() for g in param_groups(model) if not g.get("projectable") for p in g["params"])
    kw = dict(micro_batch_size=2, seq_len=32, precision="fp32", vocab_size=VOCAB, device_type="cpu")
    rho0 = {"name": "frugal", "density": 0.0}
    full = sum(p.numel() for p in model.parameters())
    ordinary = plan_memory(cfg.model, rho0, **kw)
    assert ordinary.gradients == 4 * full
    layer = sum(p.numel() for p in frugal.grouping.transformer_blocks(model)[0].parameters())
    clipped = plan_memory(cfg.model, rho0, optimizer_in_backward=True, grad_clip=True, **kw)
    # rho 0: one block's gradients (applied together) and the state-full (non-projectable) tensors, which wait
    assert clipped.gradients == 4 * (layer + fixed)
    assert plan_memory(cfg.model, rho0, optimizer_in_backward=True, **kw).gradients == 4 * layer
    assert plan_memory(cfg.model, rho0, optimizer_in_backward=True, grad_clip=True, accumulation=2,
                       **kw).gradients == 4 * full  # accumulated gradients are held, as in the ordinary step
    assert clipped.total < ordinary.total and "step inside backward (clipping" in clipped.format()
    with pytest.raises(ValueError, match="optimizer_in_backward=True needs an optimizer built on FRUGAL"):
        plan_memory(cfg.model, {"name": "adamw"}, optimizer_in_backward=True, **kw)


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_block_at_a_time_one_call_per_block(max_norm):
    """Gradients applied at once wait only for the rest of their block (one call of the optimizer's
    phases per block, not per tensor); at every gradient hook, the held gradients that do not wait for
    the norm belong to one block (tensors outside blocks, such as norms, join any)."""
    model, opt, _ = make(density=0.0)
    stepper = step_in_backward(opt, max_norm=max_norm)
    block_of = {id(p): g.get("block") for g in opt.param_groups for p in g["params"]}
    calls, blocks_held = [], []
    real_apply = opt._apply

    def apply(works, step):
        calls.append(len(works))
        return real_apply(works, step)

    opt._apply = apply

    def spy(_):
        ready = {id(s.param) for s in stepper._ready}
        blocks_held.append({block_of[id(p)] for p in model.parameters() if id(p) in ready} - {None})

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(spy)  # runs after the stepper's hook
    loss_of(model, batches(1)[0]).backward()
    opt.step()
    assert max(len(b) for b in blocks_held) == 1
    immediate = LAYERS * 7 if max_norm else sum(1 for _ in model.parameters())
    assert sum(calls[:-1] if max_norm else calls) == immediate
    assert len(calls) <= LAYERS + 3 + (1 if max_norm else 0)  # a call per block (+ head, norm, embeddings)


# ---- the edges: each was a silent difference from the ordinary step (issue: the step inside backward
# without silent edges)

def names_moved(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


NORM2 = "model.layers.2.post_attention_layernorm.weight"


@pytest.mark.parametrize("bad,density", [("lm_head.weight", 0.0), (NORM2, 0.0), (NORM2, 0.25)])
def test_a_non_finite_gradient_that_waits_for_the_norm_stops_the_step_with_the_next_block(bad, density):
    """A tensor that waits for the clipping norm (state-full) is checked with the next block: nothing
    applied after it in backward moves, and the message names it (not 'the global norm')."""
    model, opt, _ = make(density=density)
    step_in_backward(opt, max_norm=1.0, model=model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison(dict(model.named_parameters())[bad])
    loss_of(model, batches(1)[0]).backward()
    with pytest.raises(NonFiniteGradientError) as err:
        opt.step()
    message, moved = str(err.value), names_moved(model, before)
    assert f"step 1: {bad} (shape" in message, message
    # backward runs from the output: what moved is what completed before the bad tensor (later layers)
    later = ("model.layers.3",) if bad.startswith("model.layers.2") else ()
    assert all(n.startswith(later) for n in moved), moved
    assert (f"{len(moved)} of the step's tensors had already taken it" in message if moved
            else "no tensor had taken it" in message), message
    for n in sorted(moved)[:1]:
        assert n in message  # the message names what moved
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.step_count == 0 and all(p.grad is None for p in model.parameters())


class TwoHeads(torch.nn.Module):
    """A trunk of repeated blocks and two heads: head A is used only by some micro-batches."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                          for _ in range(3))
        self.head_a, self.head_b = torch.nn.Linear(16, VOCAB), torch.nn.Linear(16, VOCAB)

    def forward(self, ids, heads):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return sum(torch.nn.functional.cross_entropy(getattr(self, f"head_{k}")(h).flatten(0, 1), ids.flatten())
                   for k in heads)


@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_accumulation_is_exact_when_the_last_micro_batch_skips_a_parameter(max_norm):
    """Head A takes gradients in the first micro-batch only: the last backward never reaches it, yet
    it is applied and counted in the norm, and no gradient is left after optimizer.step()."""
    data = batches(6)
    results = []
    for in_backward in (False, True):
        model = TwoHeads()
        opt = FRUGAL(model, lr=1e-2, density=0.5, update_gap=2, seed=1)
        stepper = step_in_backward(opt, max_norm=max_norm) if in_backward else None
        norms, start = [], model.head_a.weight.detach().clone()
        for step in range(3):
            with stepper.accumulating() if stepper else contextlib.nullcontext():
                model(data[2 * step], "ab").backward()
            model(data[2 * step + 1], "b").backward()
            if stepper:
                norms.append(stepper.compute_grad_norm())
            else:
                norms.append(frugal.grad_norm([p for g in opt.param_groups for p in g["params"]]))
                if max_norm:
                    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norms[-1])
            opt.step()
            assert all(p.grad is None for p in model.parameters()) if stepper else True
            opt.zero_grad()
        assert not torch.equal(model.head_a.weight, start)  # head A learned
        results.append((model, norms))
    (ref, ref_norms), (got, norms) = results
    assert [float(n) for n in norms] == [float(n) for n in ref_norms]  # one formula, one order
    for p, q in zip(ref.parameters(), got.parameters()):
        assert torch.equal(p, q)


def test_the_plateau_grown_update_gap_is_refused_in_one_line():
    model = tiny_llama()
    opt = FRUGAL(model, lr=1e-3, update_gap=3, update_gap_growth=2.0)
    with pytest.raises(ValueError, match=r"^update_gap_growth=2.0: .*valid choices: update_gap_growth=1.0") as err:
        step_in_backward(opt, max_norm=1.0)
    assert "\n" not in str(err.value) and opt._in_backward is None


def test_gradients_written_after_the_hooks_are_an_error():
    """What DDP does after the hooks (it writes the all-reduced gradients back into .grad) is seen at
    optimizer.step(), which says so instead of leaving them to the next step."""
    model, opt, _ = make(density=0.0)
    stepper = step_in_backward(opt, max_norm=1.0, model=model)
    loss_of(model, batches(1)[0]).backward()
    applied = model.model.layers[1].mlp.up_proj.weight
    assert applied.grad is None
    applied.grad = torch.ones_like(applied)  # as a reducer that runs after the hooks would
    with pytest.raises(RuntimeError, match=r"gradients were written after the step inside backward had applied them "
                                           r"\(model.layers.1.mlp.up_proj.weight"):
        opt.step()
    assert stepper.applied == 0 and all(p.grad is None for p in model.parameters())


def test_an_error_inside_backward_is_abandoned_through_a_public_call():
    """An exception in the middle of backward (an out-of-memory error, say): the next backward says
    what happened, optimizer.step() refuses the half step, and stepper.abort() / optimizer.zero_grad()
    let training go on; the steps after it equal the ordinary optimizer's from the same weights."""
    model, opt, _ = make(density=0.25)
    stepper = step_in_backward(opt, max_norm=0.05, model=model)
    middle = model.model.layers[1].self_attn.o_proj.weight
    handle = middle.register_hook(lambda g: (_ for _ in ()).throw(MemoryError("out of memory")))
    with pytest.raises(MemoryError):
        loss_of(model, batches(1)[0]).backward()
    handle.remove()
    moved = stepper.applied
    assert moved > 0  # the later layers had taken the step
    with pytest.raises(RuntimeError, match=f"did not finish \\(it stopped with an error after {moved} tensors had "
                                           f"taken the step\\): call stepper.abort\\(\\) or optimizer.zero_grad"):
        opt.step()
    with pytest.raises(RuntimeError, match="while an earlier backward of this step had not finished"):
        loss_of(model, batches(1)[0]).backward()
    for abandon in (stepper.abort, opt.zero_grad):
        abandon()
        assert opt.step_count == 0 and stepper.applied == 0 and all(p.grad is None for p in model.parameters())
    ref_model, ref_opt, _ = make(density=0.25)
    ref_model.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(opt.state_dict())
    for ids in batches(3, seed=7):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            loss_of(m, ids).backward()
            if o is ref_opt:
                torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.05, frugal.grad_norm(
                    [p for g in o.param_groups for p in g["params"]]))
            o.step()
            o.zero_grad()
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)


def bf16_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)  # 8,192-element weights: above bitsandbytes' min_8bit_size


@pytest.mark.parametrize("density,extra", [
    (0.0, {}), (0.25, {}),
    (0.25, {"state_precision": "8bit"}),  # bitsandbytes' format (requirements.txt)
])
def test_pure_bf16_with_stochastic_rounding_equals_the_ordinary_step_bit_for_bit(density, extra):
    """One norm formula (frugal.grad_norm: float32 per-tensor norms, float32 total, the optimizer's
    order) in both schedules: pure bf16 weights with stochastic rounding (and 8-bit moments) take bit
    for bit the same steps over block switches; the logged norm is the same number. (torch's
    get_total_norm over bf16 gradients rounds the norm to bf16: 0.4% off.)"""
    runs = []
    for in_backward in (False, True):
        model = bf16_llama()
        opt = FRUGAL(model, lr=1e-2, weight_decay=0.1, density=density, update_gap=2, seed=3,
                     stochastic_rounding=True, reset_state="reset_all", **extra)
        stepper = step_in_backward(opt, max_norm=0.5, model=model) if in_backward else None
        params = [p for g in opt.param_groups for p in g["params"]]
        norms = []
        for ids in batches(5, length=16):
            loss_of(model, ids).backward()
            if stepper is None:
                norms.append(frugal.grad_norm(params))
                torch.nn.utils.clip_grads_with_norm_(params, 0.5, norms[-1], foreach=True)
            opt.step()
            norms.append(stepper.grad_norm) if stepper else None
            opt.zero_grad()
        runs.append((model, [float(n) for n in norms]))
    (ref, ref_norms), (got, norms) = runs
    assert norms == ref_norms and min(norms) > 0.5  # clipped every step
    assert all(p.dtype == torch.bfloat16 for p in got.parameters())
    if extra:
        assert any(s.get("exp_avg", torch.zeros(())).dtype == torch.uint8 for s in opt.state.values())
    for (name, p), q in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(p, q), name


def test_the_bf16_norm_is_float32s_not_bf16_rounded():
    grads = [torch.randn(300, 200, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(4)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    ours = frugal.grad_norm(params)
    assert ours.dtype == torch.float32 and float(ours) == pytest.approx(exact, rel=1e-5)
    assert abs(float(torch.nn.utils.get_total_norm(grads)) / exact - 1) > 1e-3  # bf16-rounded: what we avoid


def test_tied_embeddings_and_non_reentrant_checkpointing_equal_the_ordinary_step():
    """A tied embedding is one tensor with one hook (its gradient is complete once both uses have
    added to it); non-reentrant activation checkpointing recomputes inside backward."""
    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg).float()
        enable_activation_checkpointing(model)  # train.py's: non-reentrant
        model.train()
        return model

    runs = []
    for in_backward in (False, True):
        model = build()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        opt = FRUGAL(model, lr=3e-3, density=0.25, update_gap=2, seed=5)
        stepper = step_in_backward(opt, max_norm=0.05, model=model) if in_backward else None
        params = [p for g in opt.param_groups for p in g["params"]]
        for ids in batches(5):
            loss_of(model, ids).backward()
            if stepper is None:
                torch.nn.utils.clip_grads_with_norm_(params, 0.05, frugal.grad_norm(params))
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for (name, p), q in zip(runs[0].named_parameters(), runs[1].parameters()):
        assert torch.equal(p, q), name


def test_host_syncs_are_one_per_block_and_one_in_step(monkeypatch):
    """What a GPU waits for: one host sync per applied block (its finiteness check, the waiting tensors'
    included) and one in optimizer.step() (the global norm's), counted on the tensor methods that sync."""
    model, opt, _ = make(density=0.0)
    step_in_backward(opt, max_norm=1.0)
    applies, syncs = [], []
    real_apply = opt._apply
    opt._apply = lambda works, step: (applies.append(len(works)), real_apply(works, step))[1]
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name: (syncs.append(_name),
                                                                                       _real(t, *a))[1])
    loss_of(model, batches(1)[0]).backward()
    in_backward, blocks = len(syncs), len(applies)
    opt.step()
    monkeypatch.undo()
    assert blocks >= LAYERS and in_backward == blocks, (syncs, applies)
    assert len(syncs) - in_backward == 1, syncs[in_backward:]  # the norm's finiteness, once
