"""Optimizer-state memory: Table 2's memory column from shapes alone, and measured == estimated."""
import weakref

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from frugal import FRUGAL, build_optimizer, estimate_state_bytes, state_bytes

# The LLaMA shapes the paper trains (GaLore's configs; Appendix A.1: T5 vocabulary of 32k, untied
# embeddings) -> (hidden, intermediate, heads, layers)
SHAPES = {
    "60m": (512, 1376, 8, 8),
    "130m": (768, 2048, 12, 12),
    "350m": (1024, 2736, 16, 24),
    "1b": (2048, 5461, 32, 24),
}
# Total parameters and Linear-in-blocks parameters (Appendix D's P), millions
PARAMS_M = {"60m": (58.07, 25.3), "130m": (134.11, 84.9), "350m": (367.97, 302.4), "1b": (1339.08, 1207.9)}

# Table 2 of the paper, optimizer-state memory in GiB: method -> (build_optimizer name, hparams)
METHODS = {
    "AdamW": ("adamw", {}),
    "GaLore": ("galore", {"density": 0.25}),
    "BAdam": ("badam", {"density": 0.25}),
    "FRUGAL 0.25": ("frugal", {"density": 0.25}),
    "FRUGAL 0.0": ("frugal", {"density": 0.0}),
}
TABLE2_GIB = {
    "AdamW": (0.43, 1.00, 2.74, 9.98),
    "GaLore": (0.30, 0.54, 1.10, 3.41),
    "BAdam": (0.29, 0.52, 1.05, 3.23),
    "FRUGAL 0.25": (0.29, 0.52, 1.05, 3.23),
    "FRUGAL 0.0": (0.24, 0.37, 0.49, 0.98),
}


def llama_config(size):
    hidden, intermediate, heads, layers = SHAPES[size]
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                       num_key_value_heads=heads, num_hidden_layers=layers, vocab_size=32000,
                       max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6)


_META = {}


def meta_llama(size):
    if size not in _META:
        with torch.device("meta"):
            _META[size] = LlamaForCausalLM(llama_config(size))
    return _META[size]


@pytest.mark.parametrize("size", list(SHAPES))
def test_parameter_counts(size):
    model = meta_llama(size)
    total = sum(p.numel() for p in model.parameters())
    linear = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    assert round(total / 1e6, 2) == PARAMS_M[size][0]
    assert round(linear / 1e6, 1) == PARAMS_M[size][1]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("column, size", list(enumerate(SHAPES)))
def test_table2_memory_cells(method, column, size):
    name, hparams = METHODS[method]
    gib = estimate_state_bytes(meta_llama(size), name, **hparams) / 2**30
    assert round(gib, 2) == pytest.approx(TABLE2_GIB[method][column], abs=1e-9), (method, size, gib)


def test_svd_layouts_and_relation_to_coordinate_projections():
    """Appendix D: with M, V on the smaller side, svd costs 13/12 of column (up to the tiny index tensors) on the
    projectable part."""
    model = meta_llama("130m")
    base = estimate_state_bytes(model, "frugal", density=0.0)
    column = estimate_state_bytes(model, "frugal", density=0.25, projection="column", state_free="none")
    svd = estimate_state_bytes(model, "galore", density=0.25)
    assert (svd - base) / (column - base) == pytest.approx(13 / 12, rel=1e-3)
    impl = estimate_state_bytes(model, "galore", density=0.25, svd_layout="implementation")
    assert round(impl / 2**30, 2) == 0.57  # galore-torch's layout (moments on the larger side)


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="adam.*valid choices"):
        estimate_state_bytes(meta_llama("60m"), "adam")
    with pytest.raises(ValueError, match="svd_layout"):
        estimate_state_bytes(meta_llama("60m"), "galore", svd_layout="x")
    with pytest.raises(ValueError, match="'qr'.*block.*column"):
        estimate_state_bytes(meta_llama("60m"), "frugal", projection="qr")
    with pytest.raises(ValueError, match="'adam'.*adamw.*lion"):
        estimate_state_bytes(meta_llama("60m"), "frugal", state_full="adam")


@pytest.fixture(scope="module")
def llama_60m():
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config("60m"))
    model = model.to_empty(device="cpu")  # real CPU storage without the cost of random init
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 0.02, generator=generator)
    return model


@pytest.mark.parametrize("hparams", [
    {"projection": "block", "density": 0.25},
    {"projection": "column", "density": 0.25},
    {"projection": "randk", "density": 0.25},
    {"projection": "block", "density": 0.0},
], ids=["block", "column", "randk", "block0"])
@pytest.mark.slow
def test_measured_equals_estimate_on_llama_60m(llama_60m, hparams):
    optimizer = build_optimizer(llama_60m, "frugal", lr=1e-6, **hparams)
    generator = torch.Generator().manual_seed(1)
    for p in llama_60m.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    for p in llama_60m.parameters():
        p.grad = None
    assert state_bytes(optimizer) == estimate_state_bytes(llama_60m, "frugal", lr=1e-6, **hparams)


def test_measured_equals_estimate_for_torch_adamw():
    model = torch.nn.Linear(8, 4)
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    optimizer = build_optimizer(model, "adamw")
    optimizer.step()
    # adamw needs no transformer blocks, so the estimate works on any model
    assert state_bytes(optimizer) == estimate_state_bytes(model, "adamw") == 2 * 4 * 36 + 2 * 4


_TINY = {}


def _tiny(family):
    if family not in _TINY:
        _TINY[family] = _build_tiny(family)  # parameter values do not matter here: reuse the model
    return _TINY[family]


def _build_tiny(family):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=24, n_layer=3, n_head=4, vocab_size=50, n_positions=16,
                                          bos_token_id=0, eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4,
                                        num_key_value_heads=4, num_hidden_layers=3, vocab_size=50,
                                        max_position_embeddings=16))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name, hparams", [
    ("frugal", {"projection": "column", "density": 0.3}),
    ("frugal", {"projection": "row", "density": 0.3}),
    ("frugal", {"projection": "randk", "density": 0.3, "state_full": "lion"}),
    ("frugal", {"projection": "randperm", "density": 0.5}),
    ("frugal", {"projection": "block", "density": 0.5, "block_granularity": "tensor", "block_order": "random"}),
    ("frugal", {"density": 0.34, "state_full": "sgdm", "state_free_modules": ["embeddings", "norms"]}),
    ("galore", {"density": 0.25, "svd_layout": "implementation"}),
    ("frugal", {"projection": "random", "density": 0.5, "svd_layout": "implementation"}),
    ("badam", {"density": 0.5}),
    ("signsgd", {}),
    ("lion", {}),
    ("sgdm", {}),
    ("adamw", {}),
])
def test_measured_equals_estimate_on_tiny_models(family, name, hparams):
    """The estimate mirrors the implementation for every projection, rule and model family."""
    model = _tiny(family)
    build_hp = {k: v for k, v in hparams.items() if k != "svd_layout"}
    optimizer = build_optimizer(model, name, **build_hp)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert state_bytes(optimizer) == estimate_state_bytes(model, name, **hparams)


# ---- peak memory inside a step -------------------------------------------------------------------
class _PeakBytes(TorchDispatchMode):
    """Peak, over every aten op dispatched inside the block, of (a) the optimizer state bytes
    (`state_bytes`, read after each op) and (b) the bytes of the tensors created inside the block
    that are still alive (op outputs with fresh storage, tracked by weak reference).

    (a) is invariant 9's "resting state plus at most one block"; (b) are the step's temporaries."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer, self.fresh = optimizer, {}
        self.state_peak = state_bytes(optimizer)
        self.temp_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs and ptr not in self.fresh:
                    self.fresh[ptr] = (weakref.ref(t), t.untyped_storage().nbytes())
        self.fresh = {k: v for k, v in self.fresh.items() if v[0]() is not None}
        self.temp_peak = max(self.temp_peak, sum(n for _, n in self.fresh.values()))
        self.state_peak = max(self.state_peak, state_bytes(self.optimizer))
        return out


def _layered(num_layers, shape=(32, 48)):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for _ in range(2 * num_layers + 1)]
    groups = [{"params": params[2 * i:2 * i + 2], "projectable": True, "block": i} for i in range(num_layers)]
    return params, groups + [{"params": params[-1:]}]


def _set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_block_switch_frees_before_it_allocates():
    """8 layers, density 0.5, descending: the switch at step 2 replaces 4 state-full layers by 4
    others. Freeing the leaving ones first keeps the state at rest (the old order peaked at rest
    plus 4 layers)."""
    params, groups = _layered(8)
    optimizer = FRUGAL(groups, density=0.5, update_gap=2, sign_update="eager")
    for seed in (0, 1):
        _set_grads(params, seed)
        optimizer.step()
    at_rest = state_bytes(optimizer)
    one_layer = 2 * 2 * params[0].numel() * 4 + 2 * 4  # two tensors' moments and step counters
    assert optimizer.active_blocks() == [0, 1, 2, 3]  # the next step switches from [4, 5, 6, 7]
    _set_grads(params, 2)
    with _PeakBytes(optimizer) as peak:
        optimizer.step()
    assert state_bytes(optimizer) == at_rest
    assert peak.state_peak <= at_rest + one_layer, (peak.state_peak, at_rest, one_layer)


@pytest.mark.parametrize("projection", ["column", "randk", "svd"])
def test_split_temporaries_stay_well_below_the_moments(projection):
    """Gathered copies and residuals exist for about one layer at a time, not for all tensors."""
    params, groups = _layered(8)
    optimizer = FRUGAL(groups, density=0.25, projection=projection, sign_update="eager")
    _set_grads(params, 0)
    optimizer.step()
    moments = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                  for k, v in s.items() if k.startswith("exp_avg"))
    _set_grads(params, 1)
    with _PeakBytes(optimizer) as peak:
        optimizer.step()
    assert peak.temp_peak <= 0.5 * moments, (peak.temp_peak, moments)
