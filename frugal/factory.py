"""`build_optimizer(model, name, **hparams)`: every optimizer of the paper behind one registry.

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

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from .grouping import STATE_FREE_MODULE_CHOICES, param_groups

# Hyperparameters of the FRUGAL constructor (the contract's signature).
FRUGAL_KEYS = (
    "lr", "betas", "eps", "weight_decay", "density", "update_gap", "projection", "state_full",
    "state_free", "state_free_lr_scale", "projectable_lr_scale", "reset_state", "block_order",
    "block_granularity", "momentum", "seed",
)
COMMON_KEYS = ("lr", "weight_decay", "seed")
ALL_STATE_FREE = tuple(STATE_FREE_MODULE_CHOICES)


class _Spec:
    """One registry entry: the FRUGAL preset (None for torch AdamW), its accepted keys, and how
    its parameters are grouped: "blocks" (param_groups: projectable transformer-block weights),
    "all_state_free" or "all_state_full" (one group; needs no recognisable transformer blocks)."""

    def __init__(self, preset: dict | None, keys: tuple[str, ...], doc: str, layout: str = "blocks"):
        self.preset = preset
        self.keys = tuple(sorted(set(keys) | set(COMMON_KEYS)))
        self.doc = doc
        self.layout = layout


_SPECS: dict[str, _Spec] = {
    "adamw": _Spec(None, ("betas", "eps"), "torch.optim.AdamW (fused/foreach)"),
    "frugal": _Spec({}, FRUGAL_KEYS + ("state_free_modules",), "FRUGAL, Algorithm 1"),
    "galore": _Spec(
        {"projection": "svd", "state_free": "none", "reset_state": "keep",
         "projectable_lr_scale": 0.25, "update_gap": 200},
        FRUGAL_KEYS + ("state_free_modules",), "GaLore: SVD projection, no state-free update",
    ),
    "badam": _Spec(
        {"projection": "block", "state_free": "none", "block_order": "descending"},
        FRUGAL_KEYS + ("state_free_modules",), "BAdam: blockwise, inactive blocks frozen",
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


def _number(name: str, value, *, low=None, high=None, high_open=False) -> float:
    """`value` as a finite number in [low, high] (or [low, high)); else a ValueError that names
    the value and the valid range."""
    if low is not None and high is not None:
        valid = f"a number in [{low:g}, {high:g}{')' if high_open else ']'}"
    else:
        valid = f"a number >= {low:g}" if low is not None else "a finite number"
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (low is None or value >= low)
    ok = ok and (high is None or value < high or (value == high and not high_open))
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (expected {valid})")
    return value


def _validate(hparams: dict) -> dict:
    """Check the numeric hyperparameters early, naming the bad value and the valid range.

    Names of projections, rules and orders are checked by FRUGAL itself, which knows its choices.
    """
    out = dict(hparams)
    if "lr" in out:
        out["lr"] = float(_number("lr", out["lr"], low=0))
    if "density" in out:
        out["density"] = float(_number("density", out["density"], low=0, high=1))
    if "update_gap" in out:
        gap = out["update_gap"]
        if isinstance(gap, float) and gap.is_integer():
            gap = int(gap)
        if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
            raise ValueError(f"Invalid update_gap: {gap!r} (expected an integer >= 1)")
        out["update_gap"] = gap
    for key in ("weight_decay", "eps", "state_free_lr_scale", "projectable_lr_scale"):
        if key in out:
            out[key] = float(_number(key, out[key], low=0))
    if "momentum" in out:
        out["momentum"] = float(_number("momentum", out["momentum"], low=0, high=1, high_open=True))
    if "betas" in out:
        betas = tuple(out["betas"])
        if len(betas) != 2:
            raise ValueError(f"Invalid betas: {out['betas']!r} (expected two numbers in [0, 1))")
        out["betas"] = tuple(
            float(_number(f"beta parameter at index {i}", b, low=0, high=1, high_open=True))
            for i, b in enumerate(betas)
        )
    if "seed" in out:
        seed = out["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"Invalid seed: {seed!r} (expected an integer)")
    if "state_free_modules" in out:
        modules = out["state_free_modules"]
        modules = () if modules is None else (modules,) if isinstance(modules, str) else tuple(modules)
        out["state_free_modules"] = modules  # entries are checked by param_groups
    return out


def resolve(name: str, hparams: Mapping) -> tuple[str, dict]:
    """(name, merged hyperparameters) after checking `name`, the keys and the numeric values.

    The merged dict is the preset overlaid with the caller's values; for FRUGAL-based entries it
    may contain `state_free_modules` (for `param_groups`) besides FRUGAL constructor keywords.
    Shared by `build_optimizer` and `frugal.memory.estimate_state_bytes`.
    """
    if name not in _SPECS:
        raise ValueError(f"Unknown optimizer {name!r}; valid choices: {sorted(_SPECS)}")
    spec = _SPECS[name]
    unknown = sorted(set(hparams) - set(spec.keys))
    if unknown:
        raise ValueError(
            f"Optimizer {name!r} does not take {unknown}; valid keys for {name!r}: {list(spec.keys)}"
        )
    merged = dict(spec.preset or {})
    merged.update(hparams)
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
    kwargs = {k: hp[k] for k in ("lr", "betas", "eps", "weight_decay") if k in hp}
    kwargs.setdefault("lr", 1e-3)
    kwargs.setdefault("weight_decay", 0.0)  # the paper's pre-training setting, not torch's 1e-2
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
    def build(model: nn.Module, **hparams) -> torch.optim.Optimizer:
        _, hp = resolve(name, hparams)
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
    if name not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {name!r}; valid choices: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name](model, **hparams)
