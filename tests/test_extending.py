"""Extending FRUGAL without editing it: a new state-full rule and a new state-free rule, each in a module
of its own (written here to a temporary directory) that declares its facts and registers itself
(frugal.rules.register_state_full / register_state_free). Nothing else is edited: each trains,
resumes bit for bit from a state_dict, and the memory estimate and the planner count what it holds to
the byte."""
import copy
import importlib
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import frugal
import models
from frugal import rules
from train_utils.memory_plan import plan_memory

ROOT = Path(__file__).resolve().parents[1]

# A researcher's module: RMSprop as the state-full rule (one moment, bias-corrected, with a hyperparameter of
# its own, rms_beta), and a "soft sign" state-free rule (the gradient scaled by 1/tau and clipped to [-1, 1]:
# signSGD for large gradients).
MY_RULES = '''
import torch
from frugal import HyperparameterError
from frugal.rules import StateFreeRule, StateFullRule, register_state_free, register_state_full


def _rms_direction(g, v, step, beta2, eps):
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    return g / ((v / (1.0 - beta2 ** step.double())).sqrt() + eps)


def rmsprop_(targets, grads, states, steps, *, lr, betas, eps, weight_decay, momentum=0.0, rms_beta=0.99):
    """t *= 1 - lr*wd;  v = b v + (1-b) g^2;  t -= lr * g / (sqrt(v / (1 - b^step)) + eps), b = rms_beta."""
    (squares,) = states
    torch._foreach_add_(steps, 1.0)
    for t, g, v, step in zip(targets, grads, squares, steps):
        t.mul_(1.0 - lr * weight_decay)
        t.sub_(lr * _rms_direction(g, v, step, rms_beta, eps))


def rmsprop_direction(grad, state, *, betas, eps, momentum=0.0, rms_beta=0.99):
    state["step"] += 1
    return _rms_direction(grad, state["exp_avg_sq"], state["step"], rms_beta, eps)


def check_rms_beta(hparams):
    beta = hparams.get("rms_beta", 0.5)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        raise HyperparameterError(f"Invalid rms_beta: {beta!r} (expected a number in [0, 1))")
    return hparams


def soft_sign_(params, grads, *, lr, decay=1.0):
    for p, g in zip(params, grads):
        p.mul_(decay).sub_(soft_sign(g), alpha=lr)


def soft_sign(g, tau=1e-3):
    return (g / tau).clamp(-1.0, 1.0)


register_state_full("rmsprop", StateFullRule(rmsprop_, rmsprop_direction, ("exp_avg_sq",), counts_steps=True,
                                             elementwise=True, nonnegative=("exp_avg_sq",),
                                             options={"rms_beta": 0.99}, validate_options=check_rms_beta))
# one temporary of the tensor's size per update (g / tau), for the memory planner
register_state_free("soft_sign", StateFreeRule(soft_sign_, soft_sign,
                                               temporary_bytes=lambda group, numel, elem: numel * elem))
'''


# A state-free rule that is not elementwise, declared with the minimal fields: signSGD at the scale of the
# gradient it is given, d = sign(g) * rms(g) (one number per tensor: the residual's, never a chunk's).
RMS_SIGN = '''
import torch
from frugal.rules import StateFreeRule, register_state_free


def rms_sign(g):
    return torch.sign(g) * g.square().mean().sqrt()


register_state_free("rms_sign", StateFreeRule(direction=rms_sign))
'''


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """``load(name, text)`` imports the module ``name`` (``text``) from a temporary directory; what it
    registers and the module itself are gone after the test (this worker runs other tests next)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    tables = {id(t): (t, dict(t)) for t in (rules.STATE_FULL, rules.STATE_FREE)}
    names = []

    def load(name, text):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
        names.append(name)
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    yield load
    for table, saved in tables.values():
        table.clear()
        table.update(saved)
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def my_rules(registered):
    return registered("my_rules", MY_RULES)


@pytest.fixture
def rms_sign(registered):
    return registered("rms_sign", RMS_SIGN)


HP = dict(lr=1e-3, weight_decay=0.1, density=0.5, update_gap=2, seed=1, state_full="rmsprop", state_free="soft_sign",
          rms_beta=0.999)  # not its default
MODEL = yaml.safe_load((ROOT / "configs" / "model" / "llama_tiny.yaml").read_text())
VOCAB = 64


def batch(step):
    """Sequences that count up from a random start: a pattern the model can learn in a few steps."""
    starts = torch.randint(0, VOCAB, (4, 1), generator=torch.Generator().manual_seed(step))
    return (starts + torch.arange(16)) % VOCAB


def train(model, opt, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_new_rules_train_resume_and_are_counted_to_the_byte(my_rules):
    torch.manual_seed(0)
    model = models.build_model(MODEL, vocab_size=VOCAB)
    opt = frugal.build_optimizer(model, "frugal", **HP)
    assert {g["state_full"] for g in opt.param_groups} == {"rmsprop"}
    losses = train(model, opt, 8)
    assert losses[-1] < losses[0] - 0.3, losses  # it learns
    blocks = [g for g in opt.param_groups if g["projectable"]]
    full = {id(p) for p, s in opt.state.items() if "exp_avg_sq" in s}
    assert full and all(set(s) <= {"exp_avg_sq", "step"} for s in opt.state.values())
    assert any(id(p) not in full for g in blocks for p in g["params"])  # state-free blocks: soft sign, no state

    # resume: a new model and optimizer from the state dicts, 3 more steps on both, bit for bit
    twin = copy.deepcopy(model)
    opt2 = frugal.build_optimizer(twin, "frugal", **HP)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt, 3, start=8)
    train(twin, opt2, 3, start=8)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))

    # the estimate and the planner: what it holds, to the byte
    held = frugal.state_bytes(opt)
    assert frugal.estimate_state_bytes(model, "frugal", **HP) == held
    plan = plan_memory(MODEL, {"name": "frugal", **HP}, micro_batch_size=4, seq_len=16, vocab_size=VOCAB,
                       device_type="cpu")
    assert plan.optimizer_state == held


def test_new_rules_take_the_reference_path_and_the_step_in_backward(my_rules):
    """The single-tensor reference (foreach=False) and the step inside backward take the new rules too:
    at every step (across block switches), from the fast path's weights and state, the same step."""
    torch.manual_seed(0)
    model = models.build_model(MODEL, vocab_size=VOCAB)
    opt = frugal.build_optimizer(model, "frugal", **HP)
    for step in range(5):
        twins = []
        for kw, in_backward in (({"foreach": False}, False), ({}, True)):
            twin = copy.deepcopy(model)
            twin_opt = frugal.build_optimizer(twin, "frugal", **HP, **kw)
            twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            stepper = frugal.step_in_backward(twin_opt) if in_backward else None
            train(twin, twin_opt, 1, start=step)
            if stepper is not None:
                stepper.remove()
            twins.append(twin)
        train(model, opt, 1, start=step)
        for twin in twins:
            for p, q in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:frugal.FRUGAL found no projectable")
def test_a_rules_own_option_is_a_keyword_everywhere(my_rules):
    """rms_beta, declared with its default next to the rule: FRUGAL(...), build_optimizer and the registry's
    defaults (the option files) take it; a bad value or a misspelt key is one line naming the valid ones."""
    assert frugal.registry.defaults("frugal")["rms_beta"] == 0.99
    w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    g = torch.randn(4, 3, dtype=torch.float64)
    before = w.detach().clone()
    opt = frugal.FRUGAL([w], lr=0.1, state_full="rmsprop", rms_beta=0.5)  # no projectable tensor: all RMSprop
    w.grad = g.clone()
    opt.step()
    v_hat = 0.5 * g * g / (1 - 0.5)  # one step: v = (1 - b) g^2, bias-corrected
    torch.testing.assert_close(w.detach(), before - 0.1 * g / (v_hat.sqrt() + 1e-8), rtol=1e-12, atol=0)
    with pytest.raises(frugal.HyperparameterError, match=r"^Invalid rms_beta: 1.5 \(expected a number in \[0, 1\)\)$"):
        frugal.FRUGAL([w], state_full="rmsprop", rms_beta=1.5)
    with pytest.raises(frugal.HyperparameterError, match=r"FRUGAL does not take \['rms_betta'\]; valid keys: .*'rms_b"):
        frugal.FRUGAL([w], state_full="rmsprop", rms_betta=0.5)
    model = models.build_model(MODEL, vocab_size=VOCAB)
    with pytest.raises(frugal.HyperparameterError, match=r"does not take \['rms_betta'\]; valid keys .*'rms_beta'"):
        frugal.build_optimizer(model, "frugal", state_full="rmsprop", rms_betta=0.5)
    opt = frugal.build_optimizer(model, "frugal", state_full="rmsprop", rms_beta=0.5)
    assert {g["rms_beta"] for g in opt.param_groups} == {0.5}


@pytest.mark.slow
def test_a_plugin_rule_with_its_own_option_trains_through_train_py(tmp_path):
    """optimizer.plugins imports a researcher's module before the config is checked: its state-full rule and
    that rule's own hyperparameter are set on train.py's command line like any other (no file edited); a
    module that does not import is one line and exit code 2."""
    from _train_helpers import run_python, subprocess_env, train_cmd

    (tmp_path / "my_rules.py").write_text(textwrap.dedent(MY_RULES))
    env = subprocess_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    run = tmp_path / "run"
    cmd = train_cmd(run, "train.steps=2", "optimizer.plugins=[my_rules]", "optimizer.state_full=rmsprop",
                    "optimizer.state_free=soft_sign", "optimizer.rms_beta=0.9")
    proc = run_python(cmd, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(run / "checkpoints" / "step_00000002" / "optimizer.pt", weights_only=True)
    assert {(g["state_full"], g["state_free"], g["rms_beta"]) for g in saved["param_groups"]} == {
        ("rmsprop", "soft_sign", 0.9)}
    assert any("exp_avg_sq" in s for s in saved["state"].values())

    bad = run_python(train_cmd(tmp_path / "bad", "optimizer.plugins=[no_such_rules]"), cwd=ROOT, env=env)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: Invalid plugins: module 'no_such_rules' does not import (ModuleNotFoundError: No module named "
        "'no_such_rules'); valid choices: modules Python can import (on PYTHONPATH)")


ROWS, COLS = 1030, 1024  # 1,054,720 elements: above the 2^20 of the single-tensor path's chunks


def _rms_sign_step(projection, dtype, path, lr=0.05, wd=0.1):
    """One step of AdamW + rms_sign from fresh state on two projectable tensors (two blocks) whose
    gradients change scale along both dimensions; returns (weights before, gradients, weights after, the
    optimizer)."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.ones(ROWS, 1)
    scale[1024:] = 10.0  # the last rows (the second chunk) have gradients 10x larger
    scale = scale * torch.logspace(-1, 1, COLS)  # and the columns from 0.1x to 10x
    weights = [torch.randn(ROWS, COLS, generator=gen).to(dtype).requires_grad_() for _ in range(2)]
    grads = [(torch.randn(ROWS, COLS, generator=gen) * scale).to(dtype) for _ in range(2)]
    before = [w.detach().clone() for w in weights]
    groups = [{"params": [w], "projectable": True, "block": i} for i, w in enumerate(weights)]
    opt = frugal.FRUGAL(groups, lr=lr, weight_decay=wd, density=0.5, projection=projection, state_free="rms_sign",
                        stochastic_rounding=dtype == torch.bfloat16, foreach=path != "single")
    stepper = frugal.step_in_backward(opt) if path == "in_backward" else None
    sum((w * g).sum() for w, g in zip(weights, grads)).backward()
    opt.step()
    if stepper is not None:
        stepper.remove()
    return before, grads, weights, opt


def _expected(p, g, mask, lr=0.05, wd=0.1, eps=1e-8):
    """The step in float64, as Algorithm 1 states it: AdamW's first step where ``mask`` is 1 (m_hat = g,
    v_hat = g^2), sign(r) * rms(r) of the residual r = g * (1 - mask) on the whole tensor."""
    p, g = p.double(), g.double()
    residual = g * (1 - mask)
    return (p * (1 - lr * wd) - lr * mask * g / (g.abs() + eps)
            - lr * torch.sign(residual) * residual.square().mean().sqrt())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projection", ["block", "column"])
@pytest.mark.parametrize("path", ["fast", "single", "in_backward"])
def test_a_non_elementwise_state_free_rule_steps_the_same_on_every_path(rms_sign, path, projection, dtype):
    """A state-free rule that is not elementwise (sign(g) * rms(g), declared with the direction alone) gets the
    residual on every projection and is never chunked: the fast path, the single-tensor path (foreach=False;
    pure bf16 with stochastic rounding always takes it) and the step inside backward take the step Algorithm 1
    states, computed here in float64, for a block and a column projection of tensors above 2^20 elements."""
    before, grads, after, opt = _rms_sign_step(projection, dtype, path)
    for p, g, w in zip(before, grads, after):
        state, new = opt.state.get(w, {}), w.detach()
        mask = torch.zeros(ROWS, COLS, dtype=torch.float64)
        if projection == "block":
            mask[:] = float("exp_avg" in state)  # the active block: AdamW on the whole tensor
        else:
            assert state["index"].numel() == COLS // 2
            mask[:, state["index"]] = 1.0  # the state-full columns
        expected = _expected(p, g, mask)
        if dtype == torch.float32:
            torch.testing.assert_close(new.double(), expected, rtol=1e-6, atol=1e-6)
        else:  # stochastic rounding lands on one of the two bf16 neighbours of the exact value
            err = (new.double() - expected).abs()
            rms_step = 0.05 * g.double().square().mean().sqrt()  # lr * rms(g): the bf16 arithmetic's share
            bound = 2 * torch.finfo(torch.bfloat16).eps * expected.abs() + 0.02 * rms_step
            assert (err <= bound).all(), err.max()
    if projection == "block":
        assert sum("exp_avg" in opt.state.get(w, {}) for w in after) == 1  # one block each way


def test_a_non_elementwise_state_free_rule_refuses_fsdp2_shards(rms_sign, monkeypatch):
    """Its direction would read a shard's part of the tensor (a shard's RMS): a sharded parameter is refused,
    naming the elementwise rules that work on shards."""
    from frugal import hparams

    w = torch.nn.Parameter(torch.zeros(4, 4))
    opt = frugal.FRUGAL([{"params": [w], "projectable": True, "block": 0}], state_free="rms_sign")
    monkeypatch.setattr(hparams, "is_dtensor", lambda p: True)  # as if w were an FSDP2 shard
    with pytest.raises(frugal.HyperparameterError, match=r"^state_free 'rms_sign' is not elementwise .* FSDP2 shard; "
                                                         r"valid choices for sharded parameters: signsgd, sgd, none$"):
        hparams.check_group(opt.param_groups[0])
    opt.param_groups[0]["state_free"] = "signsgd"
    hparams.check_group(opt.param_groups[0])  # elementwise: accepted


def test_a_taken_name_or_a_wrong_kind_is_refused(my_rules):
    with pytest.raises(ValueError, match="state_full 'rmsprop' is taken"):
        rules.register_state_full("rmsprop", rules.StateFullRule(None, None, ("m",), False))
    with pytest.raises(TypeError, match="register a StateFreeRule"):
        rules.register_state_free("x", rules.STATE_FULL["adamw"])
    with pytest.raises(ValueError, match=r"'x' declares options \['rms_beta'\] that another rule declares"):
        rules.register_state_free("x", rules.StateFreeRule(direction=torch.sign, options={"rms_beta": 0.5}))
    assert "x" not in rules.STATE_FREE
    with pytest.raises(frugal.HyperparameterError, match="valid choices: .*rmsprop"), pytest.warns(UserWarning):
        frugal.FRUGAL(torch.nn.Linear(2, 2).parameters(), state_full="rmsprop2")


def test_the_estimate_the_planner_and_the_checks_name_no_rule():
    """What a rule is (its state, temporaries, options, checks) is declared next to it: the three modules
    that used to restate it read the declarations."""
    names = set(rules.STATE_FULL) | set(rules.STATE_FREE)
    for path in ("frugal/memory.py", "train_utils/memory_plan.py", "frugal/hparams.py"):
        text = (ROOT / path).read_text()
        named = sorted(n for n in names if f'"{n}"' in text or f"'{n}'" in text)
        # "adamw" appears only as torch's AdamW registry entry (an optimizer, not a rule)
        assert named in ([], ["adamw"]), (path, named)
        if named:
            assert all('name == "adamw"' in line for line in text.splitlines() if '"adamw"' in line), path


@pytest.mark.slow
def test_an_optimizer_metric_in_one_method_reaches_metrics_jsonl_and_wandb(tmp_path, monkeypatch):
    """The training row is assembled in one place (train_utils.report.training_row); an optimizer adds
    its own numbers with one method, `log_metrics()`, read through the loop's hooks adapter."""
    from _train_helpers import rows, run_inprocess, wandb_history

    def log_metrics(self):  # the one edit: which subspace window the next step is in
        return {"window": self.step_count // self.defaults["update_gap"]}

    monkeypatch.setattr(frugal.FRUGAL, "log_metrics", log_metrics, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert run_inprocess(tmp_path, "train.steps=4", "optimizer.update_gap=2", "wandb.mode=offline") == 0
    logged = {r["step"]: r["window"] for r in rows(tmp_path) if "loss" in r}
    assert logged == {1: 0, 2: 1, 3: 1, 4: 2}  # after step s: the window of step s + 1
    assert {h["_step"]: h["window"] for h in wandb_history(tmp_path) if "window" in h} == logged


def test_one_validation_pass_per_construction(monkeypatch):
    """FRUGAL(model) checks its hyperparameters once; a group's own values are checked when it is added."""
    from frugal import hparams, optimizer

    calls = []

    def counting(values):
        calls.append(sorted(values))
        return hparams.validate(values)

    monkeypatch.setattr(optimizer, "validate", counting)
    model = models.build_model(MODEL, vocab_size=VOCAB)
    frugal.FRUGAL(model, lr=1e-3)
    assert len(calls) == 1
    with pytest.warns(UserWarning, match="no projectable parameters"):
        opt = frugal.FRUGAL([{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.5}], lr=1e-3)
    assert calls[-1] == ["lr"] and opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(frugal.HyperparameterError, match="Invalid lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1.0})


def test_the_package_docstrings_list_every_module():
    """train_utils/__init__.py and frugal/__init__.py name each of their modules (the map a newcomer reads)."""
    import ast

    for package in ("train_utils", "frugal"):
        doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
        modules = sorted(p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__")
        missing = [m for m in modules if m not in doc]
        assert not missing, f"{package}/__init__.py's docstring does not name {missing}"
