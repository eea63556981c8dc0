"""Registry entries apollo and adam_mini: the reference packages behind build_optimizer, their state
measured == estimated, weights-only state dicts that resume bit-for-bit, and clear errors."""
import copy
import io

import adam_mini  # the reference packages themselves (test requirements, requirements.txt)
import apollo_torch
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import frugal
from frugal import external


def _llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False))


def _gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _run(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        _grads(model, step)
        optimizer.step()


CASES = [
    ("apollo", {}),
    ("apollo", {"rank": 1, "scale_type": "tensor", "scale": 128.0}),  # APOLLO-Mini
    ("apollo", {"projection": "svd", "density": 0.5}),
    ("adam_mini", {}),
]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name, hparams", CASES)
def test_measured_equals_estimate(family, name, hparams):
    model = _llama() if family == "llama" else _gpt2()
    optimizer = frugal.build_optimizer(model, name, **hparams)
    _run(model, optimizer, 2)
    assert frugal.state_bytes(optimizer) == frugal.estimate_state_bytes(model, name, **hparams) > 0
    if name == "apollo":  # the projection matrices live in projector objects: they are counted
        projectors = [s["projector"] for s in optimizer.state.values() if "projector" in s]
        assert projectors and all(p.ortho_matrix is not None for p in projectors)


def test_apollo_entry_is_the_package_with_frugal_projectable_weights():
    model, reference_model = _llama(), _llama()
    optimizer = frugal.build_optimizer(model, "apollo", lr=0.01, update_gap=2)
    names = dict(reference_model.named_parameters())
    projected = [p for n, p in names.items() if ".layers." in n and p.dim() == 2]
    by_rank = {}
    for p in projected:
        by_rank.setdefault(round(0.25 * min(p.shape)), []).append(p)
    groups = [{"params": [p for p in reference_model.parameters() if all(p is not q for q in projected)]}]
    groups += [{"params": ps, "rank": r, "proj": "random", "scale_type": "channel", "update_proj_gap": 2,
                "scale": 1.0, "proj_type": "std"} for r, ps in sorted(by_rank.items())]
    reference = apollo_torch.APOLLOAdamW(groups, lr=0.01, eps=1e-6)
    _run(model, optimizer, 5)
    _run(reference_model, reference, 5)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_adam_mini_entry_is_the_package():
    model, reference_model = _llama(), _llama()
    optimizer = frugal.build_optimizer(model, "adam_mini", lr=0.01, weight_decay=0.1)
    reference = adam_mini.Adam_mini(reference_model.named_parameters(), lr=0.01, weight_decay=0.1, dim=32,
                                    n_heads=4, n_kv_heads=2, verbose=False)
    _run(model, optimizer, 3)
    _run(reference_model, reference, 3)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("name, hparams", [("apollo", {"update_gap": 2}), ("adam_mini", {})])
def test_weights_only_state_dict_resumes_bit_for_bit(name, hparams):
    model = _llama()
    optimizer = frugal.build_optimizer(model, name, **hparams)
    _run(model, optimizer, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed_model = _llama(seed=1)
    resumed_model.load_state_dict(saved["model"])
    resumed = frugal.build_optimizer(resumed_model, name, **hparams)
    resumed.load_state_dict(saved["optimizer"])
    _run(model, optimizer, 4, start=3)  # crosses a projection refresh (step 4) for apollo
    _run(resumed_model, resumed, 4, start=3)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    copy.deepcopy(resumed)  # the trainer and torch's schedulers may copy an optimizer


def test_missing_package_names_the_pip_package(monkeypatch):
    def unavailable(module):
        raise ModuleNotFoundError(f"No module named {module!r}")

    monkeypatch.setattr(external.importlib, "import_module", unavailable)
    model = _llama()
    with pytest.raises(ImportError, match=r"'apollo' needs the apollo-torch package: pip install apollo-torch"):
        frugal.build_optimizer(model, "apollo")
    with pytest.raises(ImportError, match=r"pip install adam-mini .*frugal-optim\[adam-mini\]"):
        frugal.build_optimizer(model, "adam_mini")
    # the memory estimate is analytic: it needs neither package
    assert frugal.estimate_state_bytes(model, "apollo") > 0 and frugal.estimate_state_bytes(model, "adam_mini") > 0


@pytest.mark.parametrize("name, hparams, match", [
    ("apollo", {"projection": "block"}, r"projection for apollo: 'block'; valid choices: random, svd"),
    ("apollo", {"projection": "qr"}, r"valid choices: random, svd"),
    ("apollo", {"scale_type": "row"}, r"scale_type.*'row'.*channel, tensor"),
    ("apollo", {"rank": 0}, r"rank=0 is invalid"),
    ("apollo", {"scale": -1}, r"Invalid scale: -1"),
    ("apollo", {"density": 2.0}, r"Invalid density: 2.0"),
    ("apollo", {"state_full": "lion"}, r"'apollo' does not take \['state_full'\]"),
    ("adam_mini", {"n_heads": 2.5}, r"n_heads=2.5 is invalid"),
    ("adam_mini", {"density": 0.25}, r"'adam_mini' does not take \['density'\]"),
])
def test_bad_input(name, hparams, match):
    with pytest.raises(frugal.HyperparameterError, match=match):
        frugal.build_optimizer(_llama(), name, **hparams)


def test_adam_mini_needs_head_shape_without_a_config():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(frugal.HyperparameterError, match=r"pass dim=\.\.\. and n_heads=\.\.\."):
        frugal.build_optimizer(model, "adam_mini")
    frugal.build_optimizer(model, "adam_mini", dim=4, n_heads=1)
