"""models/: shapes and parameter counts of every config (on the meta device), and a real tiny model."""
import math
from pathlib import Path

import pytest
import torch
import yaml

from models import build_model, count_parameters

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
CONTRACT_KEYS = {"name", "family", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                 "max_position_embeddings", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
                 "initializer_range", "tokenizer", "gradient_checkpointing"}

# PAPER_NOTES.md: (total params, Linear-in-blocks params) in millions, at the table's precision.
PAPER = {
    "llama_20m": (19.5, 3.2), "llama_35m": (35.2, 10.6), "llama_60m": (58.07, 25.3),
    "llama_130m": (134.11, 84.9), "llama_350m": (367.97, 302.4), "llama_1b": (1339.08, 1207.9),
    "llama_3b": (2685.8, 2521.8), "llama_7b": (6738.4, 6476.0),
    # GPT-2 small: 124.44M with tied embeddings; 12 x (qkv + proj + fc + fc_proj) = 84.93M.
    "gpt2_124m": (124.44, 84.93),
}


def load(name):
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def decimals(x: float) -> int:
    s = repr(x)
    return len(s.split(".")[1]) if "." in s else 0


def test_every_config_has_the_contract_keys():
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert set(PAPER) | {"llama_tiny"} <= set(names)
    for name in names:
        cfg = load(name)
        assert CONTRACT_KEYS <= set(cfg), (name, CONTRACT_KEYS - set(cfg))
        assert cfg["name"] == name
        assert cfg["tokenizer"] == ("gpt2" if cfg["family"] == "gpt2" else "t5-base")


@pytest.mark.parametrize("name", sorted(PAPER))
def test_parameter_counts_match_the_paper(name):
    with torch.device("meta"):
        model = build_model(load(name))
    counts = count_parameters(model)
    total, linear = PAPER[name]
    assert round(counts["total"] / 1e6, decimals(total)) == total, counts
    assert round(counts["linear_in_blocks"] / 1e6, decimals(linear)) == linear, counts
    assert all(p.is_meta for p in model.parameters())


def test_llama_tiny_is_tiny_and_trains():
    cfg = load("llama_tiny")
    assert cfg["num_hidden_layers"] == 4 and cfg["max_position_embeddings"] >= 256
    assert round(0.25 * cfg["num_hidden_layers"]) == 1  # density 0.25 picks exactly one block
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=512)
    assert model.config.vocab_size == 512 and model.get_input_embeddings().weight.shape == (512, 128)
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()  # untied
    ids = torch.randint(0, 512, (2, 64))
    out = model(input_ids=ids, labels=ids)
    assert abs(out.loss.item() - math.log(512)) < 0.5  # random init predicts ~uniformly
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gradient_checkpointing_and_gpt2_build():
    cfg = dict(load("llama_tiny"), gradient_checkpointing=True)
    model = build_model(cfg, vocab_size=100)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    model.train()
    ids = torch.randint(0, 100, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    gpt = dict(load("gpt2_124m"), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)
    g = build_model(gpt, vocab_size=300)
    assert type(g).__name__ == "GPT2LMHeadModel"
    assert g.lm_head.weight.data_ptr() == g.transformer.wte.weight.data_ptr()  # tied, as GPT-2
    assert g(input_ids=ids % 300, labels=ids % 300).loss.isfinite()


def test_bad_model_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="family"):
        build_model(dict(load("llama_tiny"), family="mamba"))
    with pytest.raises(ValueError, match="divisible"):
        build_model(dict(load("llama_tiny"), num_attention_heads=3))
