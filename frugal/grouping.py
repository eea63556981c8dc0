"""Which parameters FRUGAL may split, and which layer (block) each belongs to.

The paper (Section 5, Appendix D) splits only the 2-D weights of the attention and MLP projections
inside transformer blocks ("Linear layers"). Embeddings, norms and the output head stay state-full
with the state-full rule and are never reset: the paper found them to be the parameters that suffer
most from a state-free update (Table 4: moving the output layer to signSGD costs 14 perplexity
points). Biases are tiny and stay state-full too.

Classification is an ordered list of regular expressions over full parameter names (first match
wins), so adding a model family means adding rows to `_RULES`, not editing logic. The module class
is looked up only to tell transformers' GPT-2 `Conv1D` (weight stored as (in, out)) from
`nn.Linear` (out, in); it is matched by class name so this module never imports transformers.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

# The kinds a caller may move wholly to the state-free rule (Table 4 of the paper).
STATE_FREE_MODULE_CHOICES = ("embeddings", "norms", "output")

# Ordered (pattern, kind) rules; the first pattern that matches a full parameter name decides.
# "projectable" patterns capture the layer index as group 1. The optional prefix lets wrapped
# models (e.g. `base_model.model.` or `_orig_mod.`) keep working.
_PREFIX = r"(?:^|.*\.)"
_RULES: list[tuple[re.Pattern, str]] = [
    # LLaMA-style (transformers LlamaForCausalLM and relatives: Mistral, Qwen2, ...).
    (re.compile(_PREFIX + r"layers\.(\d+)\.self_attn\.[qkvo]_proj\.weight$"), "projectable"),
    (re.compile(_PREFIX + r"layers\.(\d+)\.mlp\.(?:gate|up|down)_proj\.weight$"), "projectable"),
    # GPT-2 (transformers GPT2LMHeadModel; Conv1D modules).
    (re.compile(_PREFIX + r"h\.(\d+)\.attn\.(?:c_attn|c_proj)\.weight$"), "projectable"),
    (re.compile(_PREFIX + r"h\.(\d+)\.mlp\.(?:c_fc|c_proj)\.weight$"), "projectable"),
    # Non-projectable kinds.
    (re.compile(_PREFIX + r"(?:embed_tokens|wte|wpe|embed_positions)\.weight$"), "embeddings"),
    (re.compile(_PREFIX + r"(?:[A-Za-z_]*norm|ln_\w+)\.(?:weight|bias)$"), "norms"),
    (re.compile(_PREFIX + r"lm_head\.weight$"), "output"),
    (re.compile(r".*\.bias$|^bias$"), "bias"),
]

_LINEAR_CLASS_NAMES = ("Linear",)
_TRANSPOSED_CLASS_NAMES = ("Conv1D",)


def classify(name: str) -> tuple[str, int | None]:
    """Return (kind, block) of a full parameter name; kind "other" when no rule matches."""
    for pattern, kind in _RULES:
        match = pattern.match(name)
        if match:
            block = int(match.group(1)) if kind == "projectable" else None
            return kind, block
    return "other", None


def _owner_class_name(model: nn.Module, name: str) -> str:
    module_name = name.rsplit(".", 1)[0] if "." in name else ""
    return type(model.get_submodule(module_name)).__name__


def _normalise_state_free_modules(state_free_modules) -> tuple[str, ...]:
    if state_free_modules is None:
        return ()
    if isinstance(state_free_modules, str):
        state_free_modules = (state_free_modules,)
    chosen = tuple(str(m) for m in state_free_modules)
    for module in chosen:
        if module not in STATE_FREE_MODULE_CHOICES:
            raise ValueError(
                f"Unknown state_free_modules entry {module!r}; valid choices: "
                f"{sorted(STATE_FREE_MODULE_CHOICES)}"
            )
    return chosen


def param_groups(model: nn.Module, state_free_modules: Iterable[str] = ()) -> list[dict]:
    """Split `model`'s trainable parameters into FRUGAL param groups.

    Returns, in this order (empty groups omitted):
      - one group of non-projectable tensors (embeddings, norms, output head, biases, anything
        unrecognised): state-full with the state-full rule, never reset;
      - one group per transformer layer N with `projectable=True, block=N` and
        `transposed=True` for GPT-2's Conv1D weights (stored (in, out)), so that orientation-
        dependent projections treat every weight as (out, in);
      - one group `always_state_free=True` with the kinds listed in `state_free_modules`
        (any of "embeddings", "norms", "output"; the paper's Table 4).

    Tied parameters (GPT-2's wte = lm_head) are listed once; a tied tensor has every kind of the
    names it is reachable by, and moves to the state-free set if any of those kinds is listed.
    Parameters with `requires_grad=False` are left out (an optimizer has nothing to do for them).

    Raises ValueError for unknown `state_free_modules` entries, and for a model in which no
    transformer-block projection is recognised (pass your own groups to FRUGAL then).
    """
    chosen = set(_normalise_state_free_modules(state_free_modules))

    kinds: dict[int, set[str]] = {}  # id(param) -> kinds over all its names
    blocks: dict[int, int] = {}
    transposed: dict[int, bool] = {}
    order: list[torch.Tensor] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        key = id(param)
        if key not in kinds:
            kinds[key] = set()
            order.append(param)
        kind, block = classify(name)
        if kind == "projectable":
            owner = _owner_class_name(model, name)
            is_matrix_module = owner in _LINEAR_CLASS_NAMES or owner in _TRANSPOSED_CLASS_NAMES
            if param.dim() != 2 or not is_matrix_module:
                kind, block = "other", None  # e.g. a LoRA-wrapped or quantised module: keep it safe
            else:
                blocks[key] = block
                transposed[key] = owner in _TRANSPOSED_CLASS_NAMES
        kinds[key].add(kind)

    state_full: list[torch.Tensor] = []
    state_free: list[torch.Tensor] = []
    by_block: dict[tuple[int, bool], list[torch.Tensor]] = {}
    for param in order:
        key = id(param)
        param_kinds = kinds[key]
        if "projectable" in param_kinds and len(param_kinds) == 1:
            by_block.setdefault((blocks[key], transposed[key]), []).append(param)
        elif param_kinds & chosen:
            state_free.append(param)
        else:
            state_full.append(param)

    if not by_block:
        raise ValueError(
            f"No transformer-block projection weights recognised in {type(model).__name__}: "
            "frugal.param_groups knows transformers' LLaMA-style (`model.layers.N.self_attn.q_proj`, "
            "`mlp.gate_proj`, ...) and GPT-2 (`transformer.h.N.attn.c_attn`, `mlp.c_fc`, ...) names. "
            "For another model pass the groups yourself, e.g. FRUGAL(params=[{'params': [...], "
            "'projectable': True, 'block': i}, ..., {'params': [embeddings, norms, head]}])."
        )

    groups: list[dict] = []
    if state_full:
        groups.append({"params": state_full, "projectable": False})
    for (block, is_transposed), params in sorted(by_block.items(), key=lambda kv: kv[0]):
        groups.append(
            {"params": params, "projectable": True, "block": block, "transposed": is_transposed}
        )
    if state_free:
        groups.append({"params": state_free, "projectable": False, "always_state_free": True})
    return groups
