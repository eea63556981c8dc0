"""frugal.describe: the table of which tensors are projectable and what the split costs."""
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import frugal


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=4, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False))


def test_describe_model_rows_and_fractions(llama):
    desc = frugal.describe(llama, density=0.25)
    names = [n for n, _ in llama.named_parameters()]
    assert [row[0] for row in desc.rows] == names  # one row per tensor, in the model's order
    roles = {row[0]: row[3] for row in desc.rows}
    assert roles["model.layers.3.mlp.down_proj.weight"] == "block 3 (state-full now)"  # descending
    assert roles["model.layers.0.self_attn.q_proj.weight"] == "block 0"
    assert roles["lm_head.weight"] == "state-full"
    projectable = sum(p.numel() for n, p in llama.named_parameters() if ".layers." in n and p.dim() == 2)
    total = sum(p.numel() for p in llama.parameters())
    assert desc.projectable_fraction == pytest.approx(projectable / total)
    assert desc.state_full_fraction == pytest.approx(0.25)
    assert desc.adamw_bytes == 8 * total
    text = str(desc)
    assert "model.layers.3.mlp.down_proj.weight" in text and "blocks [3] of 4" in text
    assert "28 tensors in 4 blocks" in text and "of AdamW's" in text


@pytest.mark.parametrize("hparams", [{"density": 0.25}, {"density": 0.5, "projection": "column"},
                                     {"density": 0.25, "state_precision": "8bit"}])
def test_describe_state_estimate_matches_measured_moments(llama, hparams):
    """The estimate counts AdamW's two moments of every state-full value; what the optimizer holds
    on top of that is one 4-byte step counter per state-full tensor and, for column, int64 indices."""
    optimizer = frugal.FRUGAL(llama, **hparams)
    for p in llama.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in llama.parameters():
        p.grad = None
    desc = frugal.describe(optimizer, model=llama)
    bookkeeping = sum(s["step"].numel() * 4 + (s["index"].numel() * 8 if "index" in s else 0)
                      for s in optimizer.state.values())
    assert desc.state_bytes == frugal.state_bytes(optimizer) - bookkeeping
    assert [row[0] for row in desc.rows] == [n for n, _ in llama.named_parameters()]
    unnamed = frugal.describe(optimizer)
    assert unnamed.rows[0][0] == "group 0, tensor 0" and unnamed.state_bytes == desc.state_bytes
    assert ("stored as 8bit" in str(desc)) == ("state_precision" in hparams)
    assert "inside backward" not in str(desc)
    stepper = frugal.step_in_backward(optimizer)
    assert "the step runs inside backward" in str(frugal.describe(optimizer))
    stepper.remove()


def test_describe_target_modules_state_free_and_no_blocks(llama):
    desc = frugal.describe(llama, target_modules=["mlp"], state_free_modules=["norms"])
    roles = {row[0]: row[3] for row in desc.rows}
    assert roles["model.layers.0.self_attn.q_proj.weight"] == "state-full"
    assert roles["model.layers.0.mlp.up_proj.weight"].startswith("block 0")
    assert roles["model.norm.weight"] == "state-free"
    flat = frugal.describe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert "no projectable tensors" in str(flat) and flat.state_bytes == flat.adamw_bytes


def test_describe_rejects_other_objects(llama):
    with pytest.raises(TypeError, match="model .*or a frugal.FRUGAL optimizer, got AdamW"):
        frugal.describe(torch.optim.AdamW(llama.parameters()))
    with pytest.raises(TypeError, match="takes no hyperparameters"):
        frugal.describe(frugal.FRUGAL(llama), density=0.5)


def test_describe_looks_through_optimizer_wrappers(llama):
    class Wrapped:  # how accelerate's AcceleratedOptimizer holds the optimizer it wraps
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert frugal.describe(Wrapped(frugal.FRUGAL(llama)), model=llama).state_full_fraction == pytest.approx(0.25)
