"""models/: shapes and parameter counts of every config (on the meta device), and a real tiny model."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import models
from models import CONFIG_KEYS, ModelConfigError, build_model, count_parameters

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "model"
GIB = 2 ** 30

# (total params, Linear-in-blocks params) in millions, computed from the shapes in configs/model and kept
# as regression values; for 60M-1B they are checked against the paper below (Table 2's memory column).
COUNTS = {
    "llama_20m": (19.5, 3.2), "llama_35m": (35.2, 10.6), "llama_60m": (58.07, 25.3),
    "llama_130m": (134.11, 84.9), "llama_350m": (367.97, 302.4), "llama_1b": (1339.08, 1207.9),
    "llama_3b": (2685.8, 2521.8), "llama_7b": (6738.4, 6476.0),
    # GPT-2 small: 124.44M with tied embeddings; 12 x (qkv + proj + fc + fc_proj) = 84.93M.
    "gpt2_124m": (124.44, 84.93),
}
# Paper, Table 2, memory column (GiB of fp32 optimizer state): AdamW holds 8 bytes per parameter;
# FRUGAL rho=0.0 holds them only for what is not a Linear weight in a block (Appendix D).
TABLE2_MEMORY = {"llama_60m": (0.43, 0.24), "llama_130m": (1.00, 0.37), "llama_350m": (2.74, 0.49),
                 "llama_1b": (9.98, 0.98)}


def load(name):
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def decimals(x: float) -> int:
    s = repr(x)
    return len(s.split(".")[1]) if "." in s else 0


def meta_counts(name):
    with torch.device("meta"):
        model = build_model(load(name))
    assert all(p.is_meta for p in model.parameters())
    return count_parameters(model)


def test_every_config_has_exactly_the_model_keys():
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert set(COUNTS) | {"llama_tiny"} <= set(names)
    for name in names:
        cfg = load(name)
        assert set(cfg) == set(CONFIG_KEYS), (name, set(cfg) ^ set(CONFIG_KEYS))
        assert cfg["name"] == name
        assert cfg["tokenizer"] == ("gpt2" if cfg["family"] == "gpt2" else "t5-base")
        assert cfg["dropout"] == 0.0  # pre-training without dropout (gpt2_124m.yaml cites the sources)


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_parameter_counts(name):
    counts = meta_counts(name)
    total, linear = COUNTS[name]
    assert round(counts["total"] / 1e6, decimals(total)) == total, counts
    assert round(counts["linear_in_blocks"] / 1e6, decimals(linear)) == linear, counts


@pytest.mark.parametrize("name", sorted(TABLE2_MEMORY))
def test_shapes_reproduce_table2_memory(name):
    counts = meta_counts(name)
    adamw, rho0 = TABLE2_MEMORY[name]
    assert round(8 * counts["total"] / GIB, 2) == adamw
    assert round(8 * (counts["total"] - counts["linear_in_blocks"]) / GIB, 2) == rho0


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


def small_gpt2(**changes):
    return dict(load("gpt2_124m"), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, **changes)


def test_gpt2_builds_tied_and_without_dropout():
    torch.manual_seed(0)
    g = build_model(small_gpt2(), vocab_size=300)
    assert type(g).__name__ == "GPT2LMHeadModel"
    assert g.lm_head.weight.data_ptr() == g.transformer.wte.weight.data_ptr()  # tied, as GPT-2
    assert (g.config.resid_pdrop, g.config.embd_pdrop, g.config.attn_pdrop) == (0.0, 0.0, 0.0)
    g.train()
    ids = torch.randint(0, 300, (2, 16))
    # No dropout: two training-mode forwards agree (transformers' default 0.1 would make them differ).
    assert torch.equal(g(input_ids=ids).logits, g(input_ids=ids).logits)
    assert g(input_ids=ids, labels=ids).loss.isfinite()


def test_dropout_is_the_configs():
    g = build_model(small_gpt2(dropout=0.1), vocab_size=300)
    assert g.config.resid_pdrop == g.config.embd_pdrop == g.config.attn_pdrop == 0.1
    llama = build_model(dict(load("llama_tiny"), dropout=0.2), vocab_size=100)
    assert llama.config.attention_dropout == 0.2


@pytest.mark.parametrize("change, match", [
    ({"family": "mamba"}, r"model.family='mamba'.*valid choices: \['llama', 'gpt2'\]"),
    ({"num_attention_heads": 3}, "not divisible"),
    ({"hidden_size": 0}, r"model.hidden_size=0 .*integer >= 1"),
    ({"num_hidden_layers": 2.5}, r"model.num_hidden_layers=2.5"),
    ({"intermediate_size": None}, r"model.intermediate_size=None"),
    ({"dropout": 1.0}, r"model.dropout=1.0 .*\[0, 1\)"),
    ({"tie_word_embeddings": "no"}, r"tie_word_embeddings='no'"),
    ({"gradient_checkpointing": True}, r"unknown key\(s\) \['gradient_checkpointing'\].*valid keys"),
])
def test_bad_model_configs_raise_clear_errors(change, match):
    with pytest.raises(ModelConfigError, match=match):
        build_model(dict(load("llama_tiny"), **change))
    assert issubclass(ModelConfigError, ValueError)


def test_a_bf16_build_never_creates_fp32_weights_and_equals_a_cast_build(monkeypatch):
    """models.build_model(dtype=bf16): what pure bf16 training builds (LLaMA-7B: 13.5 GB instead of
    an fp32 27 GB first). Every tensor the build creates is recorded: none is an fp32 weight. The
    normals are drawn DRAW_CHUNK at a time in float64 and rounded through an fp32 chunk: made smaller
    than any weight here, so that a weight made in fp32 would still show."""
    monkeypatch.setattr(models, "DRAW_CHUNK", 4096)  # llama_tiny's smallest weight: 128 x 128
    from torch.utils._python_dispatch import TorchDispatchMode

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.fp32 = max(self.fp32, t.numel())
            return out

    cfg = load("llama_tiny")
    created = Created()
    with created:
        torch.manual_seed(0)
        model = build_model(cfg, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32  # restored
    # only small fp32 temporaries: rotary frequencies, one chunk of drawn normals
    assert created.fp32 <= max(cfg["hidden_size"], models.DRAW_CHUNK)
    torch.manual_seed(0)
    cast = build_model(cfg).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for (name, a), b in zip(cast.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(torch.equal(a, b) for a, b in zip(cast.buffers(), model.buffers()))


def seeded_builds() -> dict:
    """What the CPU-kind test compares: fp32 draws of torch itself (the control) and three builds from
    seed 0 (LLaMA in fp32 and bf16, a tied GPT-2)."""
    torch.manual_seed(0)
    out = {"torch normal_": torch.empty(4096).normal_()}
    for name, cfg, dtype in [("llama", dict(load("llama_tiny"), vocab_size=512), None),
                             ("llama bf16", dict(load("llama_tiny"), vocab_size=512), torch.bfloat16),
                             ("gpt2", small_gpt2(vocab_size=300), None)]:
        torch.manual_seed(0)
        out[name] = build_model(cfg, dtype=dtype).state_dict()
    return out


@pytest.mark.slow
def test_the_same_seed_builds_the_same_weights_on_every_cpu_kind(tmp_path):
    """torch's fp32 normal_ depends on ATen's CPU capability (vectorised on some kinds), so before
    build_model drew its normals in float64 a seed built other weights under ATEN_CPU_CAPABILITY=default
    than under this CPU's own kind (llama_tiny: 36% of its 9.0M numbers, by up to 5e-8). Now the two
    are bitwise equal, while torch's own fp32 draws (the control) still differ."""
    native = torch.backends.cpu.get_cpu_capability()
    if native == "DEFAULT":
        pytest.skip("this process already runs ATen's default kernels: no second kind to compare")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = ("import sys, torch, test_models; assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'; "
              "torch.save(test_models.seeded_builds(), sys.argv[1])")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "default.pt")], env=env, cwd=ROOT, check=True)
    default, here = torch.load(tmp_path / "default.pt"), seeded_builds()
    assert not torch.equal(default.pop("torch normal_"), here.pop("torch normal_")), \
        f"torch's fp32 normal_ draws alike under DEFAULT and {native}: the control no longer tells them apart"
    assert default.keys() == here.keys()
    for name, weights in here.items():
        assert default[name].keys() == weights.keys()
        differ = sum(int((default[name][k] != w).sum()) for k, w in weights.items())
        assert differ == 0, f"{name}: {differ} of {sum(w.numel() for w in weights.values())} numbers differ " \
                            f"between DEFAULT and {native}"
