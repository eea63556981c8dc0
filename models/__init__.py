"""Model construction: transformers' LLaMA and GPT-2 built from a size config, randomly initialised.

The paper's LLaMA configs are exactly ``LlamaForCausalLM`` and GPT-2 124M is ``GPT2LMHeadModel`` (no
vendored copy to drift from upstream). Nothing is downloaded: the config node carries every shape and
the weights come from the model's ``_init_weights``, its normals drawn in float64 (``_Float64Normals``)
so that a seed builds the same weights on every CPU kind. A config has exactly the keys of
``CONFIG_KEYS`` (else ``ModelConfigError``); a family is one ``FAMILY`` entry (its builder and the block
facts the memory planner counts) and a ``configs/model`` file.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from frugal.checks import check_integer
from frugal.grouping import module_roles

__all__ = ["build_model", "count_parameters", "ModelConfigError", "FAMILIES", "FAMILY", "Family", "Activations",
           "BlockSizes", "CONFIG_KEYS"]

# Every key of a model config, with what it means (the YAML files carry the values).
CONFIG_KEYS = {
    "name": "the config's name (logs, tables, per-model preset lookups)",
    "family": "the model family: a key of FAMILY (its builder and block facts)",
    "hidden_size": "width of the residual stream",
    "intermediate_size": "MLP width (llama: required; gpt2: null = 4 x hidden_size)",
    "num_attention_heads": "attention heads (hidden_size must be divisible by it)",
    "num_hidden_layers": "transformer blocks",
    "max_position_embeddings": "longest sequence the model accepts",
    "vocab_size": "embedding rows (a data source with its own vocabulary overrides it)",
    "tie_word_embeddings": "share the input embedding with the output layer",
    "rms_norm_eps": "epsilon of the norms (RMSNorm for llama, LayerNorm for gpt2)",
    "initializer_range": "std of the normal weight initialisation",
    "dropout": "dropout probability (gpt2: residual, embedding and attention; llama: attention)",
    "tokenizer": "the tokenizer the data pipeline uses for this model (${model.tokenizer})",
}


class ModelConfigError(ValueError):
    """A bad model config value: the message names the key, the value and what is valid."""


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def _check(cfg: Mapping[str, Any], vocab_size: int | None) -> dict[str, Any]:
    """The config as plain values, every one checked; raises ModelConfigError."""
    name = _get(cfg, "name") or "?"
    unknown = sorted(set(cfg.keys()) - set(CONFIG_KEYS)) if hasattr(cfg, "keys") else []
    if unknown:
        raise ModelConfigError(f"model config {name!r}: unknown key(s) {unknown}; valid keys: {list(CONFIG_KEYS)}")
    family = _get(cfg, "family")
    if family not in FAMILY:
        raise ModelConfigError(f"model.family={family!r} is not supported; valid choices: {list(FAMILY)}")

    def integer(key: str, value: Any = None, optional: bool = False) -> int | None:
        value = _get(cfg, key) if value is None else value
        if value is None and optional:
            return None
        return check_integer(f"model.{key}", value, 1, error=ModelConfigError, why=f" in model config {name!r}")

    def number(key: str, low: float, high: float | None = None) -> float:
        value = _get(cfg, key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and value >= low and (high is None or value < high)
        if not ok:
            span = f"a number in [{low:g}, {high:g})" if high is not None else f"a number >= {low:g}"
            raise ModelConfigError(f"model.{key}={value!r} in model config {name!r} is invalid: expected {span}")
        return float(value)

    out = {
        "hidden_size": integer("hidden_size"),
        "intermediate_size": integer("intermediate_size", optional=FAMILY[family].default_intermediate),
        "num_attention_heads": integer("num_attention_heads"),
        "num_hidden_layers": integer("num_hidden_layers"),
        "max_position_embeddings": integer("max_position_embeddings"),
        "vocab_size": integer("vocab_size", vocab_size),
        "rms_norm_eps": number("rms_norm_eps", 1e-12),
        "initializer_range": number("initializer_range", 1e-12),
        "dropout": number("dropout", 0.0, 1.0),
        "tie_word_embeddings": _get(cfg, "tie_word_embeddings"),
    }
    if not isinstance(out["tie_word_embeddings"], bool):
        raise ModelConfigError(f"model.tie_word_embeddings={out['tie_word_embeddings']!r} in model config "
                               f"{name!r} is invalid: expected true or false")
    if out["hidden_size"] % out["num_attention_heads"]:
        raise ModelConfigError(f"model.hidden_size={out['hidden_size']} is not divisible by "
                               f"model.num_attention_heads={out['num_attention_heads']} (model config {name!r})")
    return out


def _llama(c: dict[str, Any]):
    from transformers import LlamaConfig, LlamaForCausalLM

    same = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
            "max_position_embeddings", "rms_norm_eps", "initializer_range", "tie_word_embeddings")
    config = LlamaConfig(
        **{k: c[k] for k in same},
        num_key_value_heads=c["num_attention_heads"],  # the paper's models use full multi-head attention
        attention_dropout=c["dropout"],  # LLaMA has no other dropout
        # the T5 ids C4 batches carry (pad 0, eos 1): no surprises in generate() for sanity checks
        pad_token_id=0, eos_token_id=1, bos_token_id=None, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _gpt2(c: dict[str, Any]):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=c["vocab_size"], n_embd=c["hidden_size"], n_layer=c["num_hidden_layers"],
        n_head=c["num_attention_heads"], n_positions=c["max_position_embeddings"],
        n_inner=c["intermediate_size"],  # None = 4 * hidden, GPT-2's own default
        layer_norm_epsilon=c["rms_norm_eps"], initializer_range=c["initializer_range"],
        tie_word_embeddings=c["tie_word_embeddings"],
        # transformers' GPT2Config defaults all three to 0.1; the config decides (gpt2_124m.yaml: 0).
        resid_pdrop=c["dropout"], embd_pdrop=c["dropout"], attn_pdrop=c["dropout"],
        use_cache=False, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


DRAW_CHUNK = 1 << 20  # elements per float64 draw: the temporaries stay small at any model size


class _Float64Normals(TorchFunctionMode):
    """Every ``normal_`` on a CPU tensor, drawn in float64 from the same generator and rounded to the
    tensor's dtype through fp32: torch's fp32 ``normal_`` differs between CPU kinds (a vectorised
    approximate path on some), the float64 draw does not. ~25 ns a number (minutes for 7B) instead of ~5.
    The initialiser still decides what is drawn with which std; other devices draw as before."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.normal_, torch.nn.init.normal_):
            return _draw_normal(*args, **(kwargs or {}), draw=func)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def _draw_normal(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, generator=None, *,
                 draw) -> torch.Tensor:
    if tensor.device.type != "cpu":
        return draw(tensor, mean, std, generator=generator)
    target = tensor if tensor.is_contiguous() else torch.empty(tensor.shape, dtype=tensor.dtype)
    flat, size = target.view(-1), min(DRAW_CHUNK, target.numel())
    drawn = torch.empty(size, dtype=torch.float64)
    rounded = None if target.dtype == torch.float32 else torch.empty(size)  # a bf16 build = fp32 build cast
    for start in range(0, flat.numel(), DRAW_CHUNK):
        part = flat[start:start + DRAW_CHUNK]
        chunk = drawn[:part.numel()].normal_(mean, std, generator=generator)
        part.copy_(chunk if rounded is None else rounded[:part.numel()].copy_(chunk))
    return tensor if target is tensor else tensor.copy_(target)


class BlockSizes(NamedTuple):
    """The sizes of a transformer block, read from the built model's config."""
    intermediate: int  # MLP width
    heads: int
    kv_heads: int
    dropout: tuple[float, float, float]  # embeddings, attention, residual (0 where the family has none)


@dataclass(frozen=True)
class Activations:
    """What autograd saves in a forward pass of the family, as the memory planner counts it
    (``train_utils/memory_plan.py``, ``_layer_terms``): the kind of each part of a block and of the
    embeddings, and where the built model's config keeps the sizes."""
    norm: str  # "rmsnorm" (computes in fp32) or "layernorm"
    mlp: str  # "swiglu" (gate, up, down) or "gelu_new" (GPT-2's tanh approximation of GELU)
    positions: str  # "rotary" (cos and sin per position) or "learned" (a position embedding)
    qkv_matmuls: int  # matmuls that read the attention's input: 3 (q, k, v) or 1 (one fused projection)
    mlp_matmuls: int  # matmuls that read the MLP's input: 2 (gate, up) or 1
    sizes: Callable[[Any], BlockSizes]  # the built model's config -> its block sizes


@dataclass(frozen=True)
class Family:
    """One model family: how to build it from a checked config, and what its blocks are."""
    build: Callable[[dict[str, Any]], torch.nn.Module]
    activations: Activations | None = None  # None: the memory planner cannot plan it
    default_intermediate: bool = False  # intermediate_size may be null: the family's own default


def _llama_sizes(c) -> BlockSizes:
    return BlockSizes(c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                      (0.0, float(c.attention_dropout), 0.0))


def _gpt2_sizes(c) -> BlockSizes:
    return BlockSizes(c.n_inner or 4 * c.hidden_size, c.num_attention_heads, c.num_attention_heads,
                      (float(c.embd_pdrop), float(c.attn_pdrop), float(c.resid_pdrop)))


FAMILY = {
    "llama": Family(_llama, Activations(norm="rmsnorm", mlp="swiglu", positions="rotary", qkv_matmuls=3,
                                        mlp_matmuls=2, sizes=_llama_sizes)),
    "gpt2": Family(_gpt2, Activations(norm="layernorm", mlp="gelu_new", positions="learned", qkv_matmuls=1,
                                      mlp_matmuls=1, sizes=_gpt2_sizes), default_intermediate=True),
}
FAMILIES = tuple(FAMILY)


def build_model(cfg: Mapping[str, Any], vocab_size: int | None = None,
                dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Build a randomly initialised causal LM from one ``configs/model/*.yaml`` node (or a dict).

    ``vocab_size`` overrides ``cfg.vocab_size`` (a data source with its own vocabulary). Under
    ``torch.device("meta")`` nothing is allocated. ``dtype`` (pure bf16): every tensor is created in it
    (LLaMA-7B never exists in fp32), the weights equal to an fp32 build cast to it. Raises
    ModelConfigError for a missing, unknown or invalid key.
    """
    checked = _check(cfg, vocab_size)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or previous)
    try:
        with _Float64Normals():
            model = FAMILY[_get(cfg, "family")].build(checked)
    finally:
        torch.set_default_dtype(previous)
    if dtype is None:
        return model
    return model.to(dtype)  # buffers computed in fp32 on purpose (rotary frequencies) too, as a cast build


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Total parameters and the 2-D weights inside transformer blocks (the paper's "Linear in blocks"):
    the weights FRUGAL may split, found by frugal.grouping's one rule (GPT-2's ``Conv1D`` weights are
    Linear layers stored transposed). Works on meta tensors."""
    total = sum(p.numel() for p in model.parameters())
    in_blocks = sum(role.param.numel() for role in module_roles(model) if role.block is not None)
    return {"total": total, "linear_in_blocks": in_blocks}
