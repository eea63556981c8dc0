"""Model construction: transformers' LLaMA and GPT-2 built from a size config, randomly initialised.

Why transformers instead of a vendored copy: the reference code carried a 900-line LLaMA file that
drifted from upstream; the paper's LLaMA configs are exactly ``LlamaForCausalLM`` (SwiGLU, RMSNorm,
rotary embeddings, untied embeddings) and GPT-2 124M is ``GPT2LMHeadModel``. Nothing is downloaded:
the config node carries every shape, and weights come from the model's own ``_init_weights``.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["build_model", "FAMILIES", "count_parameters"]

FAMILIES = ("llama", "gpt2")


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    # Works for dict and OmegaConf DictConfig alike (both support .get).
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def _llama(cfg: Mapping[str, Any], vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = int(_get(cfg, "hidden_size"))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_get(cfg, "intermediate_size")),
        num_attention_heads=int(_get(cfg, "num_attention_heads")),
        num_key_value_heads=int(_get(cfg, "num_key_value_heads", _get(cfg, "num_attention_heads"))),
        num_hidden_layers=int(_get(cfg, "num_hidden_layers")),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 1024)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        initializer_range=float(_get(cfg, "initializer_range", 0.02)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        # The T5 ids (pad 0, eos 1) are what C4 batches carry; the model never generates in training,
        # but keeping them consistent avoids surprises in generate() for sanity checks.
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _gpt2(cfg: Mapping[str, Any], vocab_size: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=int(_get(cfg, "hidden_size")),
        n_layer=int(_get(cfg, "num_hidden_layers")),
        n_head=int(_get(cfg, "num_attention_heads")),
        n_positions=int(_get(cfg, "max_position_embeddings", 1024)),
        n_inner=_get(cfg, "intermediate_size"),  # None = 4 * hidden, GPT-2's own default
        layer_norm_epsilon=float(_get(cfg, "layer_norm_eps", _get(cfg, "rms_norm_eps", 1e-5))),
        initializer_range=float(_get(cfg, "initializer_range", 0.02)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        use_cache=False,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


_BUILDERS = {"llama": _llama, "gpt2": _gpt2}


def build_model(cfg: Mapping[str, Any], vocab_size: int | None = None) -> torch.nn.Module:
    """Build a randomly initialised causal LM from one ``configs/model/*.yaml`` node.

    ``vocab_size`` overrides ``cfg.vocab_size``: a data source with its own vocabulary (the synthetic
    language, token files made from it) decides how many ids the model embeds. Building under
    ``with torch.device("meta"):`` allocates nothing, so parameter counts and memory estimates of the
    7B config are free. ``gradient_checkpointing: true`` trades compute for activation memory
    (recomputes each block in backward), the usual way to fit the 1B-7B models.
    """
    family = _get(cfg, "family")
    if family not in _BUILDERS:
        raise ValueError(f"model.family={family!r} is not supported; valid choices: {list(FAMILIES)}")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        if _get(cfg, key) is None:
            raise ValueError(f"model config {(_get(cfg, 'name') or '?')!r} is missing the key {key!r}")
    if family == "llama" and _get(cfg, "intermediate_size") is None:
        raise ValueError("a llama model config needs 'intermediate_size'")
    if int(_get(cfg, "hidden_size")) % int(_get(cfg, "num_attention_heads")):
        raise ValueError(
            f"hidden_size={_get(cfg, 'hidden_size')} is not divisible by "
            f"num_attention_heads={_get(cfg, 'num_attention_heads')}"
        )
    vocab = int(vocab_size if vocab_size is not None else _get(cfg, "vocab_size"))
    if vocab < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab}")
    model = _BUILDERS[family](cfg, vocab)
    if _get(cfg, "gradient_checkpointing", False):
        # use_reentrant=False is the variant that works with autocast and unused parameters.
        # transformers 5 renamed the method (the old name warns); requirements allow 4.46+.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Total parameters and the 2-D weights inside transformer blocks (the paper's "Linear in blocks").

    Blocks are ``model.layers.N`` (LLaMA) or ``transformer.h.N`` (GPT-2, whose ``Conv1D`` weights are
    Linear layers stored transposed). Works on meta tensors.
    """
    total = sum(p.numel() for p in model.parameters())
    in_blocks = 0
    for name, p in model.named_parameters():
        if p.ndim == 2 and (".layers." in name or ".h." in name):
            in_blocks += p.numel()
    return {"total": total, "linear_in_blocks": in_blocks}
