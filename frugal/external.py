"""What users pick instead of FRUGAL today, as registry entries: APOLLO and Adam-mini.

`build_optimizer(model, "apollo" / "adam_mini")` wraps the reference packages (optional extras:
`pip install frugal-optim[apollo]` / `[adam-mini]`), imported only when an optimizer is built (the
analytic state sizes below need neither), to compare FRUGAL with them at equal memory.

apollo (Zhu et al. 2024, "APOLLO: SGD-like Memory, AdamW-level Performance", arXiv:2412.05270;
package apollo-torch). AdamW moments of a random projection of each projectable weight's gradient
set a per-channel (or per-tensor) scale for the raw gradient; Fira's norm-growth limiter is on. The
projectable weights are FRUGAL's (`param_groups`), the rest plain AdamW. Rank r = round(density *
min(m, n)) per matrix, as for `galore` (the same memory budget); `rank` fixes one for all (APOLLO-Mini:
rank=1, scale_type="tensor", scale=128). Defaults follow the authors' pre-training scripts
(lr 0.01, channel scaling, random projection refreshed every 200 steps, scale 1) and the package's
eps 1e-6. Per m x n matrix it holds the moments (max(m, n) x r each), the projection
(min(m, n) x r) and a scalar norm for the limiter: 2 r max(m, n) + r min(m, n) + 1 values.

adam_mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More",
arXiv:2406.16793; package adam-mini). Adam's first moment for every parameter, one second moment
per block: per head for queries and keys, per output row for embeddings, output, values, attention
output and MLP weights, one per tensor otherwise, and full Adam for biases. The blocks are chosen by
the package from parameter names (`_ADAM_MINI_NAMES` restates its partition so the estimate needs
no import; a test checks it against the package). `dim`, `n_heads`, `n_kv_heads` default to the
model's `config` (hidden size, attention heads, key/value heads). Defaults are the package's.

Both keep `state_dict()` loadable with `torch.load(weights_only=True)` (APOLLO's projector objects are
saved as dicts of their fields and rebuilt on load).
"""
from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from .hparams import HyperparameterError, _integer, _number

# entry -> (import name, pip package, extra)
PACKAGES = {"apollo": ("apollo_torch", "apollo-torch", "apollo"),
            "adam_mini": ("adam_mini", "adam-mini", "adam-mini")}

DEFAULTS = {
    "apollo": {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, "seed": 0,
               "density": 0.25, "rank": None, "scale": 1.0, "scale_type": "channel",
               "projection": "random", "update_gap": 200, "target_modules": None},
    "adam_mini": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "seed": 0,
                  "dim": None, "n_heads": None, "n_kv_heads": None},
}
CHOICES = {"scale_type": ("channel", "tensor"), "projection": ("random", "svd")}
_OPTIONAL_INTS = ("rank", "dim", "n_heads", "n_kv_heads")  # None, or an integer >= 1

DOCS = {"apollo": "APOLLO (apollo-torch): channel-wise gradient scaling from random-projection moments",
        "adam_mini": "Adam-mini (adam-mini): one second moment per head / row / tensor"}


def validate(name: str, settings: dict) -> dict:
    """Check the keys only these entries have (before the shared checks of frugal.hparams)."""
    out = dict(settings)
    for key, choices in CHOICES.items():
        if key in out and out[key] not in choices:
            raise HyperparameterError(f"Invalid {key} for {name}: {out[key]!r}; valid choices: {', '.join(choices)}")
    for key in _OPTIONAL_INTS:
        if out.get(key) is not None:
            out[key] = _integer(key, out[key], 1)
    if "scale" in out:
        out["scale"] = _number("scale", out["scale"], 0.0)
    return out


def _import(name: str):
    module, package, extra = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"Optimizer {name!r} needs the {package} package: pip install {package} "
                          f"(or pip install 'frugal-optim[{extra}]')") from err


def build(model: nn.Module, name: str, settings: dict) -> torch.optim.Optimizer:
    return _build_apollo(model, settings) if name == "apollo" else _build_adam_mini(model, settings)


def estimate_state_bytes(model: nn.Module, name: str, settings: dict) -> int:
    """Bytes the optimizer holds after its first step (every parameter with a gradient)."""
    return _apollo_bytes(model, settings) if name == "apollo" else _adam_mini_bytes(model, settings)


# ---- APOLLO ------------------------------------------------------------------------------------
def _apollo_rank(shape, settings: dict) -> int:
    if settings.get("rank") is not None:
        return settings["rank"]
    return max(1, math.floor(settings["density"] * min(shape) + 0.5))  # round half up, as galore's rank


def _apollo_groups(model: nn.Module, settings: dict) -> list[dict]:
    from .grouping import param_groups

    plain, by_rank = [], {}
    for group in param_groups(model, target_modules=settings.get("target_modules")):
        for p in group["params"]:
            if group["projectable"]:
                by_rank.setdefault(_apollo_rank(p.shape, settings), []).append(p)
            else:
                plain.append(p)
    groups = [{"params": plain}] if plain else []
    for rank, params in sorted(by_rank.items()):
        groups.append({"params": params, "rank": rank, "proj": settings["projection"], "proj_type": "std",
                       "scale_type": settings["scale_type"], "scale": settings["scale"],
                       "update_proj_gap": settings["update_gap"]})
    return groups


def _apollo_bytes(model: nn.Module, settings: dict) -> int:
    total = 0
    for group in _apollo_groups(model, {**DEFAULTS["apollo"], **settings}):
        for p in group["params"]:
            if "rank" in group:
                r, (small, large) = group["rank"], sorted(p.shape)
                total += (2 * r * large + r * small + 1) * p.element_size()
            else:
                total += 2 * p.numel() * p.element_size()
    return total


_APOLLO_CLASSES: dict[type, type] = {}


def _projector_fields(projector) -> dict:
    # Strings (the projection type) come back from the param group; torch's load_state_dict would
    # mangle them anyway (it casts every iterable in the state element by element).
    return {k: v for k, v in vars(projector).items() if not isinstance(v, str)}


def _apollo_class():
    """APOLLO's AdamW with a state_dict of tensors and plain values (no pickled projector)."""
    base = _import("apollo").APOLLOAdamW
    if base not in _APOLLO_CLASSES:
        class APOLLO(base):
            def state_dict(self):
                out = super().state_dict()
                out["state"] = {k: {**s, "projector": _projector_fields(s["projector"])} if "projector" in s else s
                                for k, s in out["state"].items()}
                return out

            def load_state_dict(self, state_dict):
                super().load_state_dict(state_dict)
                for group in self.param_groups:
                    for p in group["params"]:
                        state = self.state.get(p, {})
                        if isinstance(state.get("projector"), dict):
                            fields = state["projector"]
                            state["projector"] = self._initialize_projector(group, state)
                            vars(state["projector"]).update(fields)

        _APOLLO_CLASSES[base] = APOLLO
    return _APOLLO_CLASSES[base]


def _build_apollo(model: nn.Module, settings: dict) -> torch.optim.Optimizer:
    settings = {**DEFAULTS["apollo"], **settings}
    return _apollo_class()(_apollo_groups(model, settings), lr=settings["lr"], betas=tuple(settings["betas"]),
                           eps=settings["eps"], weight_decay=settings["weight_decay"])


# ---- Adam-mini ---------------------------------------------------------------------------------
# adam-mini 1.1.1's partition by (lower-cased) parameter name, checked in this order.
_ADAM_MINI_NAMES = {
    "adam": ("bias",),
    "head": ("k_proj", "q_proj", "wq", "wk", "query", "key"),
    "row": ("embed", "embd", "wte", "lm_head", "output", "final_layer", "v_proj", "wv", "value",
            "feed_forward", "linear", "mlp", "o_proj", "wo", "attn.proj"),
}


def _adam_mini_shape(model: nn.Module, settings: dict) -> tuple[int, int, int]:
    config = getattr(model, "config", None)

    def pick(key, *attrs):
        if settings.get(key) is not None:
            return settings[key]
        for attr in attrs:
            if isinstance(getattr(config, attr, None), int):
                return getattr(config, attr)
        return None

    dim = pick("dim", "hidden_size", "n_embd", "d_model")
    heads = pick("n_heads", "num_attention_heads", "n_head", "num_heads")
    if dim is None or heads is None:
        raise HyperparameterError(f"adam_mini needs the model's hidden size and head count: pass dim=... and "
                                  f"n_heads=... ({type(model).__name__} has no config giving them)")
    return dim, heads, pick("n_kv_heads", "num_key_value_heads") or heads


def _adam_mini_kind(name: str) -> str:
    name = name.lower()
    return next((kind for kind, keys in _ADAM_MINI_NAMES.items() if any(k in name for k in keys)), "tensor")


def _adam_mini_bytes(model: nn.Module, settings: dict) -> int:
    dim, heads, _ = _adam_mini_shape(model, settings)
    head_numel = dim * dim // heads
    total = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        second = {"adam": p.numel(), "head": p.numel() // head_numel, "row": p.shape[0] if p.dim() else 1,
                  "tensor": 1}[_adam_mini_kind(name)]
        total += (p.numel() + second) * p.element_size()
    return total


def _build_adam_mini(model: nn.Module, settings: dict) -> torch.optim.Optimizer:
    settings = {**DEFAULTS["adam_mini"], **settings}
    dim, heads, kv_heads = _adam_mini_shape(model, settings)
    module = _import("adam_mini")
    # A list, not the generator: the optimizer keeps it, and deepcopy cannot copy a generator.
    return module.Adam_mini(list(model.named_parameters()), lr=settings["lr"], betas=tuple(settings["betas"]),
                            eps=settings["eps"], weight_decay=settings["weight_decay"], dim=dim, n_heads=heads,
                            n_kv_heads=kv_heads, verbose=False)
