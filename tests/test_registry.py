"""build_optimizer: the registry, the presets, and clear errors for bad input."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from frugal import FRUGAL, OPTIMIZERS, build_optimizer, estimate_state_bytes, state_bytes


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=4, vocab_size=64, max_position_embeddings=32,
    ))


def _grads(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_registry_names():
    assert {"adamw", "frugal", "galore", "badam", "signsgd", "sgd", "lion", "sgdm", "apollo", "adam_mini",
            "fira", "ldadam", "adamem", "muon", "frugal_muon"} == set(OPTIMIZERS)


def test_adamw_is_fused_torch_adamw(llama):
    opt = build_optimizer(llama, "adamw", lr=3e-4, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.1, seed=3)
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert group["fused"] is True
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-6, 0.1)
    assert len(group["params"]) == len(list(llama.parameters()))


def test_frugal_and_presets(llama):
    opt = build_optimizer(llama, "frugal", density=0.5, update_gap=10, state_free_modules=["norms"])
    assert isinstance(opt, FRUGAL)
    assert opt.defaults["density"] == 0.5 and opt.defaults["update_gap"] == 10
    assert sum(bool(g.get("always_state_free")) for g in opt.param_groups) == 1
    galore = build_optimizer(llama, "galore", density=0.25)
    d = galore.defaults
    assert (d["projection"], d["state_free"], d["reset_state"], d["projectable_lr_scale"], d["update_gap"]) == \
        ("svd", "none", "keep", 0.25, 200)
    badam = build_optimizer(llama, "badam")
    d = badam.defaults
    assert (d["projection"], d["state_free"], d["block_order"]) == ("block", "none", "descending")
    # presets are defaults: Table 12's GaLore+Lion overrides the state-full rule
    assert build_optimizer(llama, "galore", state_full="lion").defaults["state_full"] == "lion"


def test_signsgd_is_stateless_sign_descent():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # no transformer blocks
    before = [p.detach().clone() for p in model.parameters()]
    _grads(model)
    grads = [p.grad.clone() for p in model.parameters()]
    opt = build_optimizer(model, "signsgd", lr=0.1)
    opt.step()
    for p, p0, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g.sign())
    assert state_bytes(opt) == 0


def test_lion_and_sgdm_are_pure_state_full_rules():
    model = torch.nn.Linear(6, 4)
    p0 = model.weight.detach().clone()
    _grads(model)
    g = model.weight.grad.clone()
    opt = build_optimizer(model, "lion", lr=0.01)
    opt.step()
    # first Lion step from zero momentum: sign((1 - beta1) g) = sign(g)
    torch.testing.assert_close(model.weight.detach(), p0 - 0.01 * g.sign())
    assert state_bytes(opt) == 4 * (24 + 4)  # one momentum per parameter
    model2 = torch.nn.Linear(6, 4)
    p0 = model2.weight.detach().clone()
    _grads(model2)
    g = model2.weight.grad.clone()
    opt = build_optimizer(model2, "sgdm", lr=0.5, momentum=0.9)
    opt.step()
    torch.testing.assert_close(model2.weight.detach(), p0 - 0.5 * 0.1 * g)


@pytest.mark.parametrize("name, hparams, match", [
    ("adam", {}, r"'adam'.*\['adam_mini', 'adamem', 'adamw', 'apollo', 'badam', 'fira', 'frugal', 'frugal_muon', "
                 r"'galore', 'ldadam', 'lion', 'muon', 'sgd', 'sgdm', 'signsgd'\]"),
    ("frugal", {"density": 1.5}, r"density: 1\.5.*\[0, 1\]"),
    ("frugal", {"density": -0.1}, r"density: -0\.1"),
    ("frugal", {"update_gap": 0}, r"update_gap=0 is invalid.*>= 1"),
    ("galore", {"update_gap": 2.5}, r"update_gap=2\.5 is invalid"),
    ("frugal", {"lr": -1e-3}, r"lr: -0\.001.*>= 0"),
    ("adamw", {"lr": -1.0}, r"lr: -1\.0"),
    ("adamw", {"density": 0.25}, r"'adamw' does not take \['density'\].*valid keys"),
    ("signsgd", {"betas": (0.9, 0.99)}, r"does not take \['betas'\]"),
    ("frugal", {"projection": "qr"}, r"'qr'.*block.*column.*randk.*svd"),
    ("frugal", {"state_full": "adam"}, r"'adam'.*adamw.*lion.*sgdm"),
    ("frugal", {"block_order": "shuffled"}, r"'shuffled'.*ascending.*descending"),
    ("frugal", {"state_free_modules": ["head"]}, r"'head'.*embeddings.*norms.*output"),
    ("adamw", {"betas": (0.9, 1.2)}, r"index 1: 1\.2"),
])
def test_bad_input(llama, name, hparams, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer(llama, name, **hparams)


def test_frugal_needs_transformer_blocks():
    with pytest.raises(ValueError, match="pass the groups yourself"):
        build_optimizer(torch.nn.Linear(3, 3), "frugal")


def test_frugal_step_on_llama_runs(llama):
    opt = build_optimizer(llama, "frugal", density=0.25, update_gap=2)
    for seed in range(3):
        _grads(llama, seed)
        opt.step()
    assert opt.active_blocks() == [2]  # descending: window 1 holds the block below the top one


# ---- one source of defaults (FRUGAL's signature + registry.defaults) --------------------------------
import frugal  # noqa: E402
from frugal import registry  # noqa: E402


@pytest.mark.parametrize("name", sorted(frugal.OPTIMIZERS))
def test_defaults_cover_exactly_the_accepted_keys_and_build(name, llama):
    values = registry.defaults(name)
    assert set(values) == set(registry.accepted_keys(name))
    frugal.build_optimizer(llama, name, **values)


def test_frugal_defaults_are_the_constructor_defaults():
    import inspect

    from frugal.rules import STATE_FREE, STATE_FULL

    sig = inspect.signature(frugal.FRUGAL.__init__)
    expected = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    # and the rules' own options (StateFullRule.options, StateFreeRule.options), which FRUGAL(...) takes as keywords
    options = {k: v for rule in (*STATE_FULL.values(), *STATE_FREE.values()) for k, v in rule.options.items()}
    assert {"sign_update", "ns_steps", "fira_gamma"} <= set(options) and not set(options) & set(expected)
    expected.update(options)
    assert registry.frugal_defaults() == expected
    with pytest.warns(UserWarning, match="no projectable"):
        opt = frugal.FRUGAL([torch.nn.Parameter(torch.zeros(2))], ns_steps=3)
    assert set(opt.defaults) == set(expected) and opt.defaults["ns_steps"] == 3
    # presets overlay the constructor defaults
    assert registry.defaults("galore")["projection"] == "svd"
    assert registry.defaults("frugal")["projection"] == expected["projection"]


@pytest.mark.parametrize("bad, message", [
    ({"density": 1.5}, "Invalid density: 1.5"),
    ({"update_gap": 0}, "update_gap=0 is invalid"),
    ({"projection": "cols"}, "valid choices: block, column"),
    ({"betas": (0.9, 1.0)}, "beta parameter at index 1"),
    ({"lr": float("nan")}, "Invalid lr"),
])
def test_one_validator_for_constructor_and_registry(bad, message, llama):
    model = llama
    with pytest.raises(frugal.HyperparameterError, match=message):
        frugal.build_optimizer(model, "frugal", **bad)
    with pytest.raises(frugal.HyperparameterError, match=message):
        frugal.FRUGAL(frugal.param_groups(model), **bad)
    assert issubclass(frugal.HyperparameterError, ValueError)


def test_target_modules_through_the_registry(llama):
    assert registry.defaults("frugal")["target_modules"] is None
    assert "target_modules" in registry.accepted_keys("galore") and "target_modules" in registry.accepted_keys("apollo")
    assert "target_modules" not in registry.accepted_keys("signsgd")
    opt = frugal.build_optimizer(llama, "frugal", target_modules=["q_proj", "v_proj"], density=0.5)
    assert sum(len(g["params"]) for g in opt.param_groups if g["projectable"]) == 2 * 4
    # the estimate groups the same way: q and v of 2 of the 4 layers are state-full
    full = estimate_state_bytes(llama, "frugal", target_modules=["q_proj", "v_proj"], density=1.0)
    half = estimate_state_bytes(llama, "frugal", target_modules=["q_proj", "v_proj"], density=0.5)
    assert full - half == 4 * (2 * 32 * 32 * 4 + 4)  # 4 matrices: AdamW moments and a step counter
    with pytest.raises(frugal.HyperparameterError, match=r"'signsgd' does not take \['target_modules'\]"):
        frugal.build_optimizer(llama, "signsgd", target_modules=["q_proj"])


def test_entry_docs_name_their_keys():
    for name, build in frugal.OPTIMIZERS.items():
        assert all(key in build.__doc__ for key in registry.accepted_keys(name)), name
