"""FRUGAL(params) does FRUGAL whatever the user passes: a model, named_parameters(), parameters(),
groups without FRUGAL keys (HF Trainer), and warns loudly when nothing is projectable."""
import warnings

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import frugal
from frugal import grouping


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


def _split(optimizer):
    """{id(param): block or None} of every tensor an optimizer holds."""
    return {id(p): (g["block"] if g["projectable"] else None) for g in optimizer.param_groups for p in g["params"]}


def _build(params, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = frugal.FRUGAL(params, **kwargs)
    return optimizer, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _step_state(model, optimizer):
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()
    for p in model.parameters():
        p.grad = None
    return frugal.state_bytes(optimizer)


@pytest.mark.parametrize("model_name", ["llama", "gpt2"])
def test_model_named_and_plain_tensors_give_param_groups_split(model_name, request):
    model = request.getfixturevalue(model_name)
    exact = {id(p): (g["block"] if g["projectable"] else None) for g in frugal.param_groups(model) for p in g["params"]}
    assert any(b is not None for b in exact.values())

    by_model, caught = _build(model, density=0.25)
    assert _split(by_model) == exact and caught == []  # the model: exact, no warning
    by_name, caught = _build(model.named_parameters(), density=0.25)
    assert _split(by_name) == exact
    assert len(caught) == 1 and "named parameters" in caught[0] and "FRUGAL(model" in caught[0]
    by_shape, caught = _build(model.parameters(), density=0.25)
    assert _split(by_shape) == exact
    assert len(caught) == 1 and "repeat every" in caught[0] and "FRUGAL(model" in caught[0]

    # names recover GPT-2's Conv1D orientation; plain tensors are read as nn.Linear (documented)
    transposed = {g["transposed"] for g in by_name.param_groups if g["projectable"]}
    assert transposed == {model_name == "gpt2"}
    assert {g["transposed"] for g in by_shape.param_groups if g["projectable"]} == {False}
    # named groups keep their names, as torch optimizers do
    assert all("param_names" in g for g in by_name.param_groups)


def test_plain_parameters_hold_frugal_state_not_adamw(llama):
    """The issue's first call: FRUGAL(model.parameters(), density=0.25) used to hold AdamW's state."""
    adamw = frugal.estimate_state_bytes(llama, "adamw")
    optimizer, _ = _build(llama.parameters(), density=0.25)
    measured = _step_state(llama, optimizer)
    assert measured == frugal.estimate_state_bytes(llama, "frugal", density=0.25)
    assert measured < 0.5 * adamw


def test_hf_trainer_groups_keep_weight_decay(llama, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, weight_decay=0.1)
    trainer = Trainer(model=llama, args=args, optimizer_cls_and_kwargs=(frugal.FRUGAL, {"density": 0.25}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.create_optimizer()
    optimizer = trainer.optimizer
    assert isinstance(optimizer, frugal.FRUGAL)
    assert any("param groups" in str(w.message) for w in caught)
    exact = {id(p): (g["block"] if g["projectable"] else None) for g in frugal.param_groups(llama) for p in g["params"]}
    assert _split(optimizer) == exact
    names = {id(p): n for n, p in llama.named_parameters()}
    for group in optimizer.param_groups:  # Trainer's decay split survives on every part
        decayed = {not (names[id(p)].endswith("norm.weight")) for p in group["params"]}
        assert decayed == {group["weight_decay"] == 0.1}, group

    # The exact way: Trainer hands a "model" keyword over as the optimizer's first argument.
    trainer = Trainer(model=llama, args=args, optimizer_cls_and_kwargs=(frugal.FRUGAL, {"model": llama}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.create_optimizer()
    assert _split(trainer.optimizer) == exact and not [w for w in caught if "frugal" in str(w.message)]


def test_groups_with_frugal_keys_pass_through(llama):
    groups = frugal.param_groups(llama)
    optimizer, caught = _build(groups)
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(g["params"]) for g in groups]
    assert caught == []
    # a deliberate all-state-full FRUGAL (how the lion / sgdm entries build it) does not warn
    _, caught = _build([{"params": list(llama.parameters()), "projectable": False}])
    assert caught == []


@pytest.mark.parametrize("make", [
    lambda m: m, lambda m: m.parameters(), lambda m: m.named_parameters(),
    lambda m: [{"params": list(m.parameters()), "lr": 0.1}],
    lambda m: [{"params": list(m.parameters()), "always_state_free": False}],
], ids=["model", "parameters", "named", "plain_groups", "undeclared_groups"])
def test_no_projectable_parameters_warns_with_remedy(make):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer, caught = _build(make(model))
    assert not any(g["projectable"] for g in optimizer.param_groups)
    assert len(caught) == 1, caught
    assert "no projectable parameters" in caught[0] and "target_modules" in caught[0]


def test_torch_errors_are_left_to_torch(llama):
    with pytest.raises(TypeError):
        frugal.FRUGAL(llama.lm_head.weight)  # a lone tensor, as torch.optim.AdamW rejects it
    with pytest.raises(ValueError, match="empty parameter list"):
        frugal.FRUGAL([])


@pytest.mark.parametrize("shapes, expected", [
    ([(9, 4), (4, 4), (8, 4), (4, 4), (8, 4), (4, 4), (8, 4), (9, 4)], (1, 2, 3)),  # emb, 3 layers, head
    ([(4, 4)] * 5, (0, 1, 5)),  # identical shapes: one tensor per layer
    ([(9, 4), (4, 4), (2, 4)], None),  # nothing repeats
    ([(4, 4), (8, 4), (4, 4), (8, 4), (4, 4), (8, 4)], (0, 2, 3)),  # alternating: period 2
])
def test_repeating_run(shapes, expected):
    assert grouping._repeating_run(shapes) == expected


def test_group_keys_are_the_optimizers():
    """resolve_params passes groups with any FRUGAL key through: the list must be FRUGAL's own."""
    from frugal import optimizer

    assert set(grouping.FRUGAL_GROUP_KEYS) == set(optimizer.GROUP_KEYS)


def test_warning_points_at_the_caller_and_shows_once(llama):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: once per call site and message
        for _ in range(3):
            frugal.FRUGAL(llama.parameters())
    assert len(caught) == 1 and caught[0].filename == __file__
