"""The optimizer registry: `build_optimizer(model, name, **hparams)` for every optimizer of the paper.

Most entries are presets of FRUGAL (`_ENTRIES`: a preset and a line each; docs/library.md, "Methods"):
a baseline then differs from FRUGAL only in its configuration, with one update rule per method, and
every FRUGAL hyperparameter may still be overridden (galore with state_full="lion": Table 12).
`adamw` is torch.optim.AdamW (fused where the device has the kernel); `apollo` and `adam_mini` wrap
their packages (frugal/external.py). signsgd, sgd, lion and sgdm put all parameters in one group, so
they work on any model.

`defaults(name)` lists every key entry `name` takes with its default, the one source the training
configs are generated from. A key that does not apply (`density` for adamw) is an error, so a sweep
cannot run something other than its config says; `lr`, `weight_decay` and `seed` are accepted by
every entry (`seed` is ignored where nothing is random).
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from . import external, hparams
from .grouping import TENSOR_ORDERS, param_groups
from .hparams import HyperparameterError
from .optimizer import FRUGAL
from .rules import STATE_FREE, STATE_FULL, option_defaults

COMMON_KEYS = ("lr", "weight_decay", "seed")
# FRUGAL-based entries with layout "blocks" also take the `param_groups` keys.
GROUPING_DEFAULTS = {"state_free_modules": (), "target_modules": None, "tensor_order": "module"}
# How FRUGAL runs and stores its state (not which algorithm): every FRUGAL-based entry takes these.
IMPLEMENTATION_KEYS = ("stochastic_rounding", "state_precision", "foreach")
_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "seed": 0}
# Modules imported before the keys are checked (`load_plugins`): every entry takes `plugins`.
PLUGINS = "plugins"


@dataclass(frozen=True)
class _Entry:
    """One registry entry. kind "frugal": a FRUGAL preset whose parameters are grouped by `layout`
    ("blocks": param_groups; "all_state_free" / "all_state_full": one group, any model) and which
    takes `keys` (None: every FRUGAL hyperparameter); "adamw": torch's; "external": a wrapper."""
    kind: str
    doc: str
    preset: dict = field(default_factory=dict)
    keys: tuple[str, ...] | None = None
    layout: str = "blocks"
    rest: dict = field(default_factory=dict)  # settings of the non-projectable group (layout "blocks")


_ENTRIES: dict[str, _Entry] = {
    "adamw": _Entry("adamw", "torch.optim.AdamW (fused/foreach)"),
    "frugal": _Entry("frugal", "FRUGAL, Algorithm 1"),
    "galore": _Entry("frugal", "GaLore: SVD projection, no state-free update",
                     {"projection": "svd", "state_free": "none", "reset_state": "keep",
                      "projectable_lr_scale": 0.25, "update_gap": 200, "svd_signs": "raw"}),
    "badam": _Entry("frugal", "BAdam: blockwise, inactive blocks frozen",
                    {"projection": "block", "state_free": "none", "block_order": "descending"}),
    # The pure baselines are FRUGAL with one group: every tensor state-free (no state at all) or
    # every tensor state-full and never reset (the state-full rule alone).
    "signsgd": _Entry("frugal", "signSGD on every parameter (no state)", {"state_free": "signsgd"},
                      IMPLEMENTATION_KEYS, "all_state_free"),
    "sgd": _Entry("frugal", "SGD on every parameter (no state)", {"state_free": "sgd"},
                  IMPLEMENTATION_KEYS, "all_state_free"),
    # Lion's authors run it 3-10x below AdamW's rate (Chen et al., 2023): 1e-4.
    "lion": _Entry("frugal", "Lion on every parameter", {"state_full": "lion", "betas": (0.9, 0.99), "lr": 1e-4},
                   ("betas",) + IMPLEMENTATION_KEYS, "all_state_full"),
    "sgdm": _Entry("frugal", "SGD with momentum on every parameter", {"state_full": "sgdm"},
                   ("momentum",) + IMPLEMENTATION_KEYS, "all_state_full"),
    # The concurrent methods (the paper's Appendix; docs/concurrent_methods.md). Fira as the `fira`
    # package runs it: its AdamW (Hugging Face's form, eps 1e-6) on every tensor, residual G - alpha * lift(R).
    "fira": _Entry("frugal", "Fira: SVD + AdamW, residual with norm-based scaling and the norm-growth limiter",
                   {"projection": "svd", "state_free": "fira", "reset_state": "keep", "state_full": "adamw_hf",
                    "eps": 1e-6, "projectable_lr_scale": 0.25, "update_gap": 200, "svd_signs": "raw",
                    "lr": 1e-2}),  # Fira's pre-training scripts (LLaMA 60M-1B on C4), alpha 0.25 as GaLore's
    "ldadam": _Entry("frugal", "LDAdam: power-iteration basis every step, moment transport, error feedback",
                     {"projection": "power", "update_gap": 1, "reset_state": "transport", "state_free": "none",
                      "error_feedback": True, "subspace_momentum": 0.908, "betas": (0.908, 0.99)}),
    "adamem": _Entry("frugal", "AdaMeM: SVD, Adafactor with momentum + one-sided Adafactor on the residual",
                     {"projection": "svd", "state_full": "adafactor_momentum",
                      "state_free": "one_sided_adafactor", "update_gap": 200},
                     rest={"state_full": "adamw"}),
    # Muon as the state-full rule (frugal/muon.py); the non-projectable tensors keep AdamW (StateFullRule.rest).
    "muon": _Entry("frugal", "Muon on the transformer blocks' Linear weights, AdamW on the rest",
                   {"state_full": "muon", "projection": "block", "density": 1.0, "momentum": 0.95},
                   ("betas", "eps", "momentum", "state_free_modules", "target_modules", "tensor_order")
                   + IMPLEMENTATION_KEYS),
    "frugal_muon": _Entry("frugal", "FRUGAL with Muon as the state-full rule (block projection)",
                          {"state_full": "muon", "momentum": 0.95}),
    "apollo": _Entry("external", external.DOCS["apollo"]),
    "adam_mini": _Entry("external", external.DOCS["adam_mini"]),
}


def frugal_defaults() -> dict:
    """Every FRUGAL hyperparameter with its default: the keyword defaults of `FRUGAL.__init__` and the
    registered rules' own options (`rules.option_defaults`)."""
    sig = inspect.signature(FRUGAL.__init__)
    own = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    return {**own, **option_defaults()}


def _entry(name: str) -> _Entry:
    if name not in _ENTRIES:
        raise HyperparameterError(f"Unknown optimizer {name!r}; valid choices: {sorted(_ENTRIES)}")
    return _ENTRIES[name]


def frugal_based() -> list[str]:
    """The entries built on ``FRUGAL`` (what ``frugal.step_in_backward`` can drive), sorted."""
    return sorted(name for name, entry in _ENTRIES.items() if entry.kind == "frugal")


def load_plugins(modules) -> None:
    """Import each module named in ``modules`` (a name or a list: an entry's ``plugins``, the configs'
    ``optimizer.plugins``), so that the rules it registers, with their options, are known to the checks
    that follow. A module that does not import is a HyperparameterError (one line)."""
    for module in [modules] if isinstance(modules, str) else list(modules or ()):
        try:
            importlib.import_module(module)
        except Exception as err:  # whatever the module raises, the run cannot start
            why = (str(err).strip().splitlines() or [""])[0]
            raise HyperparameterError(f"Invalid plugins: module {module!r} does not import ({type(err).__name__}: "
                                      f"{why}); valid choices: modules Python can import "
                                      "(on PYTHONPATH)") from None


def defaults(name: str) -> dict:
    """Every key entry `name` accepts, with its default: the one source of optimizer defaults
    (the training configs are generated from it). FRUGAL-based entries: FRUGAL's constructor
    defaults overlaid with the entry's preset; adamw: the paper's AdamW (weight decay 0, not
    torch's 1e-2); apollo, adam_mini: see frugal/external.py."""
    entry = _entry(name)
    if entry.kind == "adamw":
        return {**_ADAMW_DEFAULTS, PLUGINS: ()}
    if entry.kind == "external":
        return {**external.DEFAULTS[name], PLUGINS: ()}
    base = {**frugal_defaults(), **GROUPING_DEFAULTS, **entry.preset, PLUGINS: ()}
    # an entry that lists its keys also takes the options of the rules its preset names
    rules = [STATE_FULL.get(entry.preset.get("state_full")), STATE_FREE.get(entry.preset.get("state_free"))]
    own = {k for rule in rules if rule is not None for k in rule.options}
    keys = set(base) if entry.keys is None else set(entry.keys) | set(COMMON_KEYS) | own | {PLUGINS}
    if entry.layout != "blocks":
        keys -= set(GROUPING_DEFAULTS)
    return {k: base[k] for k in sorted(keys)}


def accepted_keys(name: str) -> tuple[str, ...]:
    """The hyperparameters entry `name` takes (a key that does not apply is an error)."""
    return tuple(sorted(defaults(name)))


def _validate(name: str, settings: dict) -> dict:
    if _ENTRIES[name].kind == "external":
        settings = external.validate(name, settings)  # first: its choices differ from FRUGAL's
    out = hparams.validate(settings)
    if out.get("tensor_order", "module") not in TENSOR_ORDERS:
        raise HyperparameterError(f"Invalid tensor_order {out['tensor_order']!r}; valid choices: "
                                  f"{', '.join(TENSOR_ORDERS)}")
    if "state_free_modules" in out:
        modules = out["state_free_modules"]
        modules = () if modules is None else (modules,) if isinstance(modules, str) else tuple(modules)
        out["state_free_modules"] = modules  # entries are checked by param_groups
    return out


def resolve(name: str, values: Mapping) -> tuple[str, dict]:
    """(name, merged hyperparameters) after checking `name`, the keys and the values.

    The merged dict is the preset overlaid with the caller's values; for FRUGAL-based entries it
    may contain `state_free_modules` / `target_modules` (for `param_groups`) besides FRUGAL
    constructor keywords. The modules in `plugins` are imported first (`load_plugins`), and the key
    is consumed. Shared by `build_optimizer` and `frugal.memory.estimate_state_bytes`.
    """
    entry = _entry(name)
    values = dict(values)
    load_plugins(values.pop(PLUGINS, ()))
    keys = accepted_keys(name)
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise HyperparameterError(
            f"Optimizer {name!r} does not take {unknown}; valid keys for {name!r}: {list(keys)}"
        )
    return name, _validate(name, {**entry.preset, **values})


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


def _build_adamw(model: nn.Module, settings: dict) -> torch.optim.Optimizer:
    params = _trainable(model)
    kwargs = {k: settings.get(k, _ADAMW_DEFAULTS[k]) for k in ("lr", "betas", "eps", "weight_decay")}
    return torch.optim.AdamW(params, **kwargs, **_adamw_kernel(params))


def optimizer_groups(model: nn.Module, name: str, settings: dict) -> tuple[list[dict], dict]:
    """(param groups, FRUGAL keyword arguments) for FRUGAL-based entry `name` with resolved `settings`."""
    settings = dict(settings)
    grouping = {k: settings.pop(k, v) for k, v in GROUPING_DEFAULTS.items()}
    entry = _ENTRIES[name]
    if entry.layout == "blocks":
        full = settings.get("state_full", frugal_defaults()["state_full"])
        groups = param_groups(model, **grouping, state_full=full)  # muon: AdamW on the rest (StateFullRule.rest)
        free = settings.get("state_free", frugal_defaults()["state_free"])
        for group in groups:
            if group.get("always_state_free"):
                # A module moved to the state-free set (state_free_modules) has no split for Fira's or
                # AdaMeM's rule to read: it takes FRUGAL's signSGD.
                if STATE_FREE[free].reads_split:
                    group["state_free"] = "signsgd"
            elif not group.get("projectable"):
                group.update(entry.rest)
        return groups, settings
    layout = entry.layout
    params = _trainable(model)
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    return [{"params": params, "projectable": False, "always_state_free": layout == "all_state_free"}], settings


def _builder(name: str) -> Callable[..., torch.optim.Optimizer]:
    kind = _ENTRIES[name].kind

    def build(model: nn.Module, **values) -> torch.optim.Optimizer:
        _, settings = resolve(name, values)
        if kind == "adamw":
            return _build_adamw(model, settings)
        if kind == "external":
            return external.build(model, name, settings)
        groups, kwargs = optimizer_groups(model, name, settings)
        return FRUGAL(groups, **kwargs)

    build.__name__ = f"build_{name}"
    build.__doc__ = f"{_ENTRIES[name].doc}. Keys: {', '.join(accepted_keys(name))}."
    return build


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {name: _builder(name) for name in _ENTRIES}


def build_optimizer(model: nn.Module, name: str, **hparams) -> torch.optim.Optimizer:
    """Build optimizer `name` (see `OPTIMIZERS`) for `model`'s trainable parameters.

    `accepted_keys(name)` / `defaults(name)` list the hyperparameters each entry takes; a bad
    name, key or value is a `HyperparameterError` (a ValueError) naming it and what is valid.
    """
    _entry(name)
    return OPTIMIZERS[name](model, **hparams)
