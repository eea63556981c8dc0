"""frugal.param_groups on tiny transformers LLaMA and GPT-2 models (random init, no download)."""
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from frugal.grouping import classify, param_groups


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=3, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False,
    ))


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
    ))


def _named(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
            for g in groups]


def _all_params_once(model, groups):
    listed = [id(p) for g in groups for p in g["params"]]
    assert len(listed) == len(set(listed)), "a parameter is listed twice"
    assert set(listed) == {id(p) for p in model.parameters()}


def test_llama_projectable_blocks(llama):
    groups = param_groups(llama)
    _all_params_once(llama, groups)
    named = _named(llama, groups)
    projectable = [(meta, names) for meta, names in named if meta.get("projectable")]
    assert [meta["block"] for meta, _ in projectable] == [0, 1, 2]
    for meta, names in projectable:
        assert meta["transposed"] is False
        n = meta["block"]
        expected = [f"model.layers.{n}.self_attn.{x}_proj.weight" for x in "qkvo"]
        expected += [f"model.layers.{n}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        assert sorted(names) == sorted(expected)
    (rest_meta, rest), = [(m, n) for m, n in named if not m.get("projectable")]
    assert not rest_meta.get("always_state_free", False)
    assert "model.embed_tokens.weight" in rest and "lm_head.weight" in rest
    assert "model.norm.weight" in rest and "model.layers.0.input_layernorm.weight" in rest
    assert len(rest) == 2 + 2 * 3 + 1


def test_gpt2_conv1d_transposed_and_tied_once(gpt2):
    groups = param_groups(gpt2)
    _all_params_once(gpt2, groups)
    named = _named(gpt2, groups)
    projectable = [(meta, names) for meta, names in named if meta.get("projectable")]
    assert [meta["block"] for meta, _ in projectable] == [0, 1]
    for meta, names in projectable:
        assert meta["transposed"] is True
        n = meta["block"]
        assert sorted(names) == sorted(
            f"transformer.h.{n}.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    rest = [n for meta, names in named if not meta.get("projectable") for n in names]
    assert "transformer.wte.weight" in rest  # tied with lm_head: listed once
    assert all(n.endswith(".bias") or "ln_" in n or n.startswith("transformer.w") for n in rest)


@pytest.mark.parametrize("modules, moved", [
    (("norms",), {"model.norm.weight", "model.layers.0.input_layernorm.weight"}),
    (("embeddings",), {"model.embed_tokens.weight"}),
    (("output",), {"lm_head.weight"}),
    (("embeddings", "norms", "output"), {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}),
])
def test_table4_state_free_modules(llama, modules, moved):
    groups = param_groups(llama, state_free_modules=modules)
    _all_params_once(llama, groups)
    free = {n for meta, names in _named(llama, groups) if meta.get("always_state_free") for n in names}
    assert moved <= free
    kinds = {classify(n)[0] for n in free}
    assert kinds == set(modules)
    assert not any("_proj" in n for n in free)  # projectable weights are never always-state-free


def test_gpt2_tied_weight_moves_with_embeddings_or_output(gpt2):
    for modules in (("embeddings",), ("output",)):
        free = {n for meta, names in _named(gpt2, param_groups(gpt2, modules))
                if meta.get("always_state_free") for n in names}
        assert "transformer.wte.weight" in free


def test_unknown_state_free_module(llama):
    with pytest.raises(ValueError, match=r"linear.*embeddings.*norms.*output"):
        param_groups(llama, state_free_modules=["linear"])


def test_model_without_blocks_explains_how_to_pass_groups():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"projectable.*block"):
        param_groups(model)


def test_frozen_parameters_left_out(llama):
    llama.model.embed_tokens.weight.requires_grad_(False)
    try:
        listed = {id(p) for g in param_groups(llama) for p in g["params"]}
        assert id(llama.model.embed_tokens.weight) not in listed
    finally:
        llama.model.embed_tokens.weight.requires_grad_(True)


def test_classify_rules_first_match():
    assert classify("model.layers.11.mlp.down_proj.weight") == ("projectable", 11)
    assert classify("transformer.h.3.attn.c_attn.weight") == ("projectable", 3)
    assert classify("transformer.h.3.attn.c_attn.bias") == ("bias", None)
    assert classify("model.layers.2.post_attention_layernorm.weight") == ("norms", None)
    assert classify("_orig_mod.lm_head.weight") == ("output", None)
    assert classify("some.other.thing") == ("other", None)
