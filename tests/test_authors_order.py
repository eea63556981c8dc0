"""setup/algorithm=authors walks LLaMA's weight tensors in the order of the FRUGAL authors' own model
(their utils/modeling_llama.py: q, k, v, o, gate, down, up per layer), not transformers' registration
order (gate, up, down): checked against a transcription of their selection on a model where the two
orders pick different tensors."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import frugal
from _train_helpers import compose_cfg
from omegaconf import OmegaConf

LAYERS = 2
AUTHORS_LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.down_proj", "mlp.up_proj"]


def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=LAYERS,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))


def authors_selection(density: float, window: int) -> set[str]:
    """Their walk, transcribed: the list of weight tensors in their model's order, k = Python's
    round(density x n), and window w holding the k tensors counted down from the last one, starting
    w x k places further down, wrapping around (their default order, 'descending')."""
    names = [f"model.layers.{i}.{t}.weight" for i in range(LAYERS) for t in AUTHORS_LAYER]
    n, k = len(names), round(density * len(names))
    return {names[n - 1 - (window * k + j) % n] for j in range(k)}


def selections(tensor_order: str, density: float, windows: int) -> list[set[str]]:
    """The projectable tensors that hold state after each step (update gap 1: a window per step)."""
    model = tiny()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = frugal.build_optimizer(model, "frugal", density=density, update_gap=1, reset_state="reset_all",
                                 block_granularity="tensor", tensor_order=tensor_order)
    projectable = [p for g in opt.param_groups if g["projectable"] for p in g["params"]]
    out = []
    for _ in range(windows):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        out.append({names[id(p)] for p in projectable if p in opt.state})
    return out


@pytest.mark.parametrize("density", [1 / 14, 3 / 14])
def test_the_authors_order_is_their_walk(density):
    windows = 14
    expected = [authors_selection(density, w) for w in range(windows)]
    assert selections("authors", density, windows) == expected
    # transformers' order differs in the windows whose edge falls inside an MLP: the test can tell
    assert selections("module", density, windows) != expected


def test_the_paper_presets_walk_the_authors_order():
    for option in ("frugal", "frugal_rho0", "badam", "frugal_lion", "frugal_sgd", "frugal_muon"):
        cfg = compose_cfg("setup/algorithm=authors", f"optimizer={option}")
        assert OmegaConf.select(cfg, "optimizer.tensor_order") == "authors", option
    assert compose_cfg("optimizer=frugal").optimizer.tensor_order == "module"  # the library's default


def test_a_bad_tensor_order_names_the_choices():
    with pytest.raises(frugal.HyperparameterError, match="tensor_order 'reversed'; valid choices: module, authors"):
        frugal.build_optimizer(tiny(), "frugal", tensor_order="reversed")
