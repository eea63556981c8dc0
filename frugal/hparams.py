"""FRUGAL's hyperparameters: their valid choices and checks, declared once, so a bad value is reported
the same way wherever it enters (optimizer, registry, memory estimate, configs). The defaults are
`FRUGAL.__init__`'s keyword defaults and the rules' own options (each rule checks its own,
`validate_options`); `frugal.registry.defaults` lists them per entry.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from . import projections as proj
from . import state_precision
from .checks import HyperparameterError, check_integer
from .adaptive import DENSITY_KINDS, clocked
from .rules import CONTEXTUAL_PROJECTIONS, STATE_FREE, STATE_FULL
from .sharding import is_dtensor


RESET_MODES = ("reset", "reset_all", "reset_everything", "reproject", "keep", "transport")
GRANULARITIES = ("layer", "tensor", "layer_floor")

# Keys whose value is one of a fixed set of names (the rules: those registered when a value is checked,
# `choices()`; a rule's own keys are its own to check, `StateFullRule.validate_options`).
CHOICES: dict[str, tuple[str, ...]] = {
    "projection": proj.PROJECTIONS,
    "reset_state": RESET_MODES,
    "block_order": proj.BLOCK_ORDERS,
    "block_granularity": GRANULARITIES,
    "density_schedule": DENSITY_KINDS,
    "svd_signs": proj.SVD_SIGNS,
    "state_precision": state_precision.PRECISIONS,
}

# Switches: True or False (not 0/1 or "yes": a config typo must not silently flip them).
BOOLEANS = ("stochastic_rounding", "foreach", "error_feedback", "master_weights")

# Numeric keys: (low, high, high_open); None = unbounded on that side.
_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "lr": (0.0, None, False),
    "eps": (0.0, None, False),
    "weight_decay": (0.0, None, False),
    "density": (0.0, 1.0, False),
    "state_free_lr_scale": (0.0, None, False),
    "projectable_lr_scale": (0.0, None, False),
    "subspace_momentum": (0.0, 1.0, True),
    "density_end": (0.0, 1.0, False),
    "update_gap_growth": (1.0, None, False),
    "plateau_threshold": (0.0, 1.0, True),
}
# Numeric keys that may also be None, and what None means.
_OPTIONAL_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "momentum": (0.0, 1.0, True),
}
_NONE_MEANS = {"momentum": "the state-full rule's default (StateFullRule.default_momentum)"}
# Integer keys: lowest value, and whether None is allowed.
_INTEGERS: dict[str, tuple[int | None, bool]] = {
    "update_gap": (1, False),
    "window_offset": (0, False),
    "seed": (None, False),
    "density_steps": (1, True),
    "plateau_patience": (1, False),
    "max_update_gap": (1, True),
}


def _range_text(low, high, high_open) -> str:
    if low is not None and high is not None:
        return f"a number in [{low:g}, {high:g}{')' if high_open else ']'}"
    return f"a number >= {low:g}" if low is not None else "a finite number"


def _number(key: str, value, low=None, high=None, high_open=False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (low is None or value >= low)
    ok = ok and (high is None or value < high or (value == high and not high_open))
    if not ok:
        raise HyperparameterError(f"Invalid {key}: {value!r} (expected {_range_text(low, high, high_open)})")
    return float(value)


def _integer(key: str, value, low: int | None = None) -> int:
    return check_integer(key, value, low, integral_floats=True)


def validate(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Check and normalise the FRUGAL hyperparameters present in `hparams` (others pass through): a new
    dict, numbers as float/int, betas a tuple. Raises HyperparameterError naming the key, the value and
    the valid range or choices."""
    out = dict(hparams)
    for rule in (*STATE_FULL.values(), *STATE_FREE.values()):  # the rules' own options (Muon's ns_steps, ...)
        if rule.validate_options is not None:
            out = rule.validate_options(out)
    for key, choices in choices_now().items():
        if key in out and out[key] not in choices:
            raise HyperparameterError(f"Invalid {key}: {out[key]!r}; valid choices: {', '.join(choices)}")
    for key, (low, high, high_open) in _RANGES.items():
        if key in out:
            out[key] = _number(key, out[key], low, high, high_open)
    for key, (low, high, high_open) in _OPTIONAL_RANGES.items():
        if key in out and out[key] is not None:
            try:
                out[key] = _number(key, out[key], low, high, high_open)
            except HyperparameterError as err:
                raise HyperparameterError(f"{err} or None ({_NONE_MEANS[key]})") from None
    for key in BOOLEANS:
        if key in out and not isinstance(out[key], bool):
            raise HyperparameterError(f"Invalid {key}: {out[key]!r} (expected True or False)")
    for key, (low, optional) in _INTEGERS.items():
        if key in out and not (optional and out[key] is None):
            try:
                out[key] = _integer(key, out[key], low=low)
            except HyperparameterError as err:
                raise HyperparameterError(f"{err}{' or None' if optional else ''}") from None
    if "betas" in out:
        betas = out["betas"]
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise HyperparameterError(f"Invalid betas: {betas!r} (expected a pair (beta1, beta2), each in [0, 1))")
        out["betas"] = tuple(_number(f"beta parameter at index {i}", b, 0.0, 1.0, True) for i, b in enumerate(betas))
    return out


def choices_now() -> dict[str, tuple[str, ...]]:
    """CHOICES with the rules registered now (a rule in its own module registers itself at import)."""
    return {**CHOICES, "state_full": tuple(STATE_FULL), "state_free": tuple(STATE_FREE)}


def check_combination(group: Mapping[str, Any]) -> None:
    """Settings that are valid alone but not together (one param group's resolved values): the
    concurrent methods' rules need a split with a reduced dimension, LDAdam's pieces need a matrix
    basis and AdamW's moments. Raises HyperparameterError naming the keys and what would work."""
    projection, full, free = group["projection"], group["state_full"], group["state_free"]
    projectable = group.get("projectable", True) and not group.get("always_state_free", False)
    if STATE_FREE[free].reads_split:
        if group.get("always_state_free", False):
            raise HyperparameterError(
                f"state_free {free!r} updates the residual of a split tensor, but this group is always "
                "state-free (no split); valid choices there: " + ", ".join(_plain(STATE_FREE)))
        if projectable and projection not in CONTEXTUAL_PROJECTIONS:
            raise HyperparameterError(
                f"state_free {free!r} needs a projection with a reduced dimension (the paper: block "
                f"projection cannot carry norm-based scaling); got projection {projection!r}; valid "
                f"choices: {', '.join(CONTEXTUAL_PROJECTIONS)}")
    adam = ", ".join(name for name, rule in STATE_FULL.items() if rule.adam_moments)
    if group.get("error_feedback") and projectable:
        silent = ", ".join(name for name, rule in STATE_FREE.items() if rule.direction is None and not rule.reads_split)
        if projection not in proj.MATRIX or free not in silent.split(", ") or not STATE_FULL[full].adam_moments:
            raise HyperparameterError(
                "error_feedback=True (LDAdam) carries what the low-rank step leaves out to the next "
                f"step, so it needs a matrix projection ({', '.join(proj.MATRIX)}), a state_free rule "
                f"without an update of its own ({silent}) and a state_full rule with Adam's two moments "
                f"({adam}); got projection {projection!r}, state_free {free!r}, state_full {full!r}")
    if projectable and (group["reset_state"] == "transport" or projection == "power") and (
            projection not in proj.MATRIX or not STATE_FULL[full].adam_moments):
        raise HyperparameterError(
            f"reset_state {group['reset_state']!r} with projection {projection!r} and state_full "
            f"{full!r}: LDAdam's moment transport and power-iteration basis need a matrix projection "
            f"({', '.join(proj.MATRIX)}) and a state_full rule with Adam's two moments ({adam})")
    if group.get("window_offset", 0) and clocked(group):
        raise HyperparameterError(
            f"window_offset={group['window_offset']} shifts windows of a fixed update gap; with density_schedule "
            f"{group['density_schedule']!r} or update_gap_growth={group['update_gap_growth']:g} the windows follow a "
            "clock that starts at step 0; valid choices: window_offset=0 there")
    if group["density_schedule"] != "constant" and group["density_steps"] is None:
        raise HyperparameterError(
            f"density_schedule {group['density_schedule']!r} needs density_steps (the steps over which the "
            f"density goes from density={group['density']:g} to density_end={group['density_end']:g})")
    if STATE_FULL[full].matrix_only and projectable and (
            projection == "randk" or group["reset_state"] in ("reproject", "transport")):
        raise HyperparameterError(
            f"state_full {full!r} keeps factored moments of a matrix: it cannot run on projection "
            f"{projection!r} (1-D) or with reset_state {group['reset_state']!r}; valid choices: "
            "reset_state reset or keep, any projection but randk")


def check_group(group: dict) -> None:
    """What one param group's settings and tensors must satisfy together (raised when the group is
    added, naming the value and what would work): the combination of rules (``check_combination``), 2-D
    tensors for projections that need them, whole matrices where a rule or a basis needs them (no
    FSDP2 shards), a layer index for layer blocks, 2-D tensors for a state-full rule of matrices."""
    check_combination(group)
    full_rule, free_rule = STATE_FULL[group["state_full"]], STATE_FREE[group["state_free"]]
    if full_rule.check is not None:  # the rule's own refusals (Muon: frugal/muon.py)
        full_rule.check(group)
    split = group["projectable"] and not group["always_state_free"]
    state_precision.check(group, full_rule, split, any(is_dtensor(p) for p in group["params"]), STATE_FULL)
    projection = group["projection"]
    for p in group["params"]:
        if full_rule.matrix_only and not group["always_state_free"] and (
                is_dtensor(p) or ((not split or projection == "block") and p.dim() != 2)):
            raise HyperparameterError(
                f"state_full {group['state_full']!r} factors the second moment of a matrix; it cannot "
                f"update the {'FSDP2 shard' if is_dtensor(p) else 'tensor'} of shape {tuple(p.shape)} "
                "in this group; give the group state_full='adamw' (as the 'adamem' registry entry "
                "does for embeddings, norms and the output layer)")
        if is_dtensor(p) and (group["projectable"] or group["always_state_free"]) and not free_rule.elementwise:
            raise HyperparameterError(
                f"state_free {group['state_free']!r} is not elementwise (it reads the whole tensor: a norm, a "
                f"statistic), but the parameter of shape {tuple(p.shape)} is an FSDP2 shard; valid choices for "
                f"sharded parameters: {', '.join(n for n, r in STATE_FREE.items() if r.elementwise)}")
        if not split:
            continue
        if projection not in ("block", "randk") and p.dim() != 2:
            raise HyperparameterError(
                f"projection {projection!r} needs 2-D tensors, got shape {tuple(p.shape)}; "
                "valid choices for other shapes: block, randk")
        if projection in proj.MATRIX and is_dtensor(p):
            raise HyperparameterError(
                f"projection {projection!r} needs each whole weight matrix (for its basis), "
                f"but the parameter of shape {tuple(p.shape)} is an FSDP2 shard; valid "
                "choices for sharded parameters: block, column, row, randk, randperm")
    if split and projection == "block" and group["block_granularity"] != "tensor" and group["block"] is None:
        raise HyperparameterError(
            f"A projectable group with projection 'block' and block_granularity {group['block_granularity']!r} needs "
            "its layer index as group key 'block' (or use block_granularity='tensor')")


def resolve_momentum(group: dict) -> None:
    """``momentum=None``: the state-full rule's own default (``StateFullRule.default_momentum``: the
    paper's SGDM 0.9, torch's Muon 0.95)."""
    if group["momentum"] is None:
        group["momentum"] = STATE_FULL[group["state_full"]].default_momentum


def _plain(rules) -> list[str]:
    return [name for name, rule in rules.items() if not rule.reads_split]
