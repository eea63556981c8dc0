"""The optimizer registry: `build_optimizer(model, name, **hparams)` for every optimizer of the paper.

Most entries are presets of FRUGAL, because the paper's baselines are points of its design space:

    frugal   Algorithm 1 as configured (defaults: blockwise, density 0.25, AdamW + signSGD).
    galore   SVD projection of rank round(density * min(m, n)), no state-free update, state kept
             across projection changes, update scale 0.25 (the GaLore reference recipe).
    badam    blockwise, inactive blocks frozen (state_free="none"), order "descending".
    signsgd  every parameter state-free with signSGD (Table 16, "signSGD only"): no state.
    sgd      every parameter state-free with plain SGD: no state.
    lion     pure Lion (betas default (0.9, 0.99)): every parameter state-full, never reset (Table 12).
    sgdm     pure SGD with momentum (the paper's EMA form): every parameter state-full.
    adamw    torch.optim.AdamW, fused where the device has the fused kernel (CPU and CUDA do),
             otherwise foreach.

signsgd, sgd, lion and sgdm put all parameters in one group, so they work on any model, not only
on transformers whose blocks `param_groups` recognises.

Going through FRUGAL keeps one update rule per method (decoupled weight decay, the same Lion and
SGDM code whether a rule runs alone or inside FRUGAL), so a baseline differs from FRUGAL only in
its configuration. The presets of galore and badam are defaults: every FRUGAL hyperparameter may
still be overridden (e.g. galore with state_full="lion" for Table 12's GaLore+Lion).

Accepted keys, decided once here: each entry lists the keys that change what it does; a key that
does not apply (e.g. `density` for adamw) is a ValueError, so a sweep cannot silently run something
other than what its config says. `lr`, `weight_decay` and `seed` are accepted by every entry so a
training loop can forward them uniformly (`seed` is ignored where nothing is random).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from . import hparams
from .grouping import param_groups
from .hparams import HyperparameterError

COMMON_KEYS = ("lr", "weight_decay", "seed")
# Besides FRUGAL's own hyperparameters, FRUGAL-based entries take `state_free_modules` (param_groups).
GROUPING_KEYS = ("state_free_modules",)


def _frugal_keys() -> tuple[str, ...]:
    return tuple(hparams.defaults())


class _Spec:
    """One registry entry: the FRUGAL preset (None for torch AdamW), its accepted keys, and how
    its parameters are grouped: "blocks" (param_groups: projectable transformer-block weights),
    "all_state_free" or "all_state_full" (one group; needs no recognisable transformer blocks)."""

    def __init__(self, preset: dict | None, keys, doc: str, layout: str = "blocks"):
        self.preset = preset
        self._keys = keys  # a tuple, or "frugal": every FRUGAL hyperparameter (resolved lazily)
        self.doc = doc
        self.layout = layout

    @property
    def keys(self) -> tuple[str, ...]:
        keys = _frugal_keys() + GROUPING_KEYS if self._keys == "frugal" else self._keys
        return tuple(sorted(set(keys) | set(COMMON_KEYS)))


_SPECS: dict[str, _Spec] = {
    "adamw": _Spec(None, ("betas", "eps"), "torch.optim.AdamW (fused/foreach)"),
    "frugal": _Spec({}, "frugal", "FRUGAL, Algorithm 1"),
    "galore": _Spec(
        {"projection": "svd", "state_free": "none", "reset_state": "keep",
         "projectable_lr_scale": 0.25, "update_gap": 200},
        "frugal", "GaLore: SVD projection, no state-free update",
    ),
    "badam": _Spec(
        {"projection": "block", "state_free": "none", "block_order": "descending"},
        "frugal", "BAdam: blockwise, inactive blocks frozen",
    ),
    # The pure baselines are FRUGAL with one group: every tensor state-free (no state at all) or
    # every tensor state-full and never reset (the state-full rule alone).
    "signsgd": _Spec({"state_free": "signsgd"}, (), "signSGD on every parameter (no state)",
                     "all_state_free"),
    "sgd": _Spec({"state_free": "sgd"}, (), "SGD on every parameter (no state)", "all_state_free"),
    "lion": _Spec({"state_full": "lion", "betas": (0.9, 0.99)}, ("betas",),
                  "Lion on every parameter", "all_state_full"),
    "sgdm": _Spec({"state_full": "sgdm"}, ("momentum",), "SGD with momentum on every parameter",
                  "all_state_full"),
}


def _validate(hp: dict) -> dict:
    out = hparams.validate(hp)
    if "state_free_modules" in out:
        modules = out["state_free_modules"]
        modules = () if modules is None else (modules,) if isinstance(modules, str) else tuple(modules)
        out["state_free_modules"] = modules  # entries are checked by param_groups
    return out


_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "seed": 0}


def defaults(name: str) -> dict:
    """Every key entry `name` accepts, with its default: the one source of optimizer defaults
    (the training configs are generated from it). FRUGAL-based entries: FRUGAL's constructor
    defaults overlaid with the entry's preset; adamw: the paper's AdamW (weight decay 0, not
    torch's 1e-2)."""
    spec = _spec(name)
    if spec.preset is None:
        return {k: _ADAMW_DEFAULTS[k] for k in spec.keys}
    base = {**hparams.defaults(), "state_free_modules": (), **spec.preset}
    return {k: base[k] for k in spec.keys}


def accepted_keys(name: str) -> tuple[str, ...]:
    """The hyperparameters entry `name` takes (a key that does not apply is an error)."""
    return _spec(name).keys


def _spec(name: str) -> _Spec:
    if name not in _SPECS:
        raise HyperparameterError(f"Unknown optimizer {name!r}; valid choices: {sorted(_SPECS)}")
    return _SPECS[name]


def resolve(name: str, values: Mapping) -> tuple[str, dict]:
    """(name, merged hyperparameters) after checking `name`, the keys and the numeric values.

    The merged dict is the preset overlaid with the caller's values; for FRUGAL-based entries it
    may contain `state_free_modules` (for `param_groups`) besides FRUGAL constructor keywords.
    Shared by `build_optimizer` and `frugal.memory.estimate_state_bytes`.
    """
    spec = _spec(name)
    unknown = sorted(set(values) - set(spec.keys))
    if unknown:
        raise HyperparameterError(
            f"Optimizer {name!r} does not take {unknown}; valid keys for {name!r}: {list(spec.keys)}"
        )
    merged = dict(spec.preset or {})
    merged.update(values)
    return name, _validate(merged)


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]  # parameters() lists tied ones once


def _adamw_kernel(params: list[torch.Tensor]) -> dict:
    """fused=True where every parameter's device has torch's fused AdamW, else foreach."""
    try:
        from torch.utils._foreach_utils import (
            _get_foreach_kernels_supported_devices,
            _get_fused_kernels_supported_devices,
        )
        fused_devices = set(_get_fused_kernels_supported_devices())
        foreach_devices = set(_get_foreach_kernels_supported_devices())
    except ImportError:  # private helpers; fall back to what torch >= 2.4 is known to support
        fused_devices, foreach_devices = {"cpu", "cuda"}, {"cuda"}
    devices = {p.device.type for p in params}
    if devices and devices <= fused_devices and all(p.is_floating_point() for p in params):
        return {"fused": True}
    if devices and devices <= foreach_devices:
        return {"foreach": True}
    return {}


def _build_adamw(model: nn.Module, hp: dict) -> torch.optim.Optimizer:
    params = _trainable(model)
    kwargs = {k: hp.get(k, _ADAMW_DEFAULTS[k]) for k in ("lr", "betas", "eps", "weight_decay")}
    return torch.optim.AdamW(params, **kwargs, **_adamw_kernel(params))


def optimizer_groups(model: nn.Module, name: str, hp: dict) -> tuple[list[dict], dict]:
    """(param groups, FRUGAL keyword arguments) for FRUGAL-based entry `name` with resolved `hp`."""
    hp = dict(hp)
    modules = hp.pop("state_free_modules", ())
    layout = _SPECS[name].layout
    if layout == "blocks":
        return param_groups(model, state_free_modules=modules), hp
    params = _trainable(model)
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    return [{"params": params, "always_state_free": layout == "all_state_free"}], hp


def _build_frugal(model: nn.Module, name: str, hp: dict) -> torch.optim.Optimizer:
    from .optimizer import FRUGAL  # imported here so grouping/factory load without the optimizer

    groups, kwargs = optimizer_groups(model, name, hp)
    return FRUGAL(groups, **kwargs)


def _builder(name: str) -> Callable[..., torch.optim.Optimizer]:
    def build(model: nn.Module, **values) -> torch.optim.Optimizer:
        _, hp = resolve(name, values)
        return _build_adamw(model, hp) if _SPECS[name].preset is None else _build_frugal(model, name, hp)

    build.__name__ = f"build_{name}"
    build.__doc__ = f"{_SPECS[name].doc}. Keys: {', '.join(_SPECS[name].keys)}."
    return build


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {name: _builder(name) for name in _SPECS}


def build_optimizer(model: nn.Module, name: str, **hparams) -> torch.optim.Optimizer:
    """Build optimizer `name` (see `OPTIMIZERS`) for `model`'s trainable parameters.

    Hyperparameters: lr, betas, eps, weight_decay, density, update_gap, projection, state_full,
    state_free, state_free_lr_scale, projectable_lr_scale, reset_state, block_order,
    block_granularity, state_free_modules, seed, momentum; each entry takes the subset that applies
    to it (see the module docstring). Raises ValueError naming a bad name or value and the choices.
    """
    _spec(name)
    return OPTIMIZERS[name](model, **hparams)
