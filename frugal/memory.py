"""Optimizer-state memory: measured (`state_bytes`) and predicted (`estimate_state_bytes`).

`state_bytes` counts every tensor in `optimizer.state` (moments, projection matrices, indices, step
counters). `estimate_state_bytes` is Appendix D's analytic count from parameter shapes alone (a model
on the `meta` device costs nothing):

- AdamW: two moments per state-full element; Lion, SGDM and Muon one buffer (Muon: no step counter).
- blockwise: the non-projectable tensors' moments plus those of round(density * L) whole layers.
- column / row / randk / randperm: the moments of the selected coordinates and their indices
  (randk's int32, half the moments' size: the paper counts a seed).
- concurrent methods: AdaMeM's factors replace the second moment and its residual rule keeps one
  vector per matrix; Fira one scalar per matrix; LDAdam's error buffer one value per weight entry.
- svd / random / power: Appendix D's layout, the projection on the larger side (max(m, n) x r) and the
  moments on the smaller (Table 2's GaLore column); `svd_layout="implementation"` counts GaLore's code
  and `frugal.FRUGAL` instead (projection on the smaller side: 0.57 GiB, not 0.54, on LLaMA-130M).

Everything is in the parameter dtype, except under ``master_weights`` with bf16/fp16 weights (a
float32 copy and float32 moments per whole state-full tensor). Bookkeeping tensors are counted
exactly, so `state_bytes(opt)` after the first step equals the estimate for every projection.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import external, state_precision
from .hparams import HyperparameterError
from . import projections as proj
from .registry import frugal_defaults, optimizer_groups, resolve
from .rules import STATE_FREE, STATE_FULL

_STEP_BYTES = 4  # a float32 scalar step counter, as torch.optim keeps it


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):  # an FSDP2 DTensor: this process holds its local shard only
            obj = obj.to_local()
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):  # e.g. APOLLO's projector objects
        return _tensor_bytes(vars(obj))
    return 0


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor held in `optimizer.state`, measured (any optimizer); per process for
    sharded (DTensor) state."""
    return sum(_tensor_bytes(state) for state in optimizer.state.values())


def _frugal_bytes(model: nn.Module, name: str, shared: dict, svd_layout: str) -> int:
    groups, shared = optimizer_groups(model, name, shared)  # shared is validated by resolve()
    shared = {**frugal_defaults(), **shared}
    if shared["density_schedule"] != "constant":  # the peak: the larger of the two ends
        shared["density"] = max(shared["density"], shared["density_end"])
    total = 0
    projectable: list[tuple[dict, torch.Tensor]] = []
    for group in groups:
        settings = {**shared, **{k: v for k, v in group.items() if k != "params"}}
        if settings.get("always_state_free"):
            continue
        if settings.get("projectable"):
            projectable += [(settings, p) for p in group["params"]]
        else:
            total += sum(_whole_bytes(settings, p) for p in group["params"])

    if shared["projection"] == "block":
        return total + sum(_whole_bytes(shared, p) for p in _active_block_tensors(projectable, shared))
    for settings, p in projectable:
        total += _split_bytes(settings, p, svd_layout)
    return total


def _whole_bytes(settings: dict, p: torch.Tensor) -> int:
    """A whole state-full tensor's state; with ``master_weights`` and bfloat16/float16 weights also
    its float32 copy, and float32 moments (``frugal.state_precision.master``)."""
    if settings["master_weights"] and p.dtype in state_precision.LOW_WEIGHTS:
        return p.numel() * 4 + _rule_bytes(settings["state_full"], p.shape, 4, settings["state_precision"])
    return _rule_bytes(settings["state_full"], p.shape, p.element_size(), settings["state_precision"])


def _rule_bytes(rule_name: str, shape, elem: int, precision: str = "param") -> int:
    """The state-full rule's state for a target of ``shape``: its tensors (stored as ``precision``,
    ``frugal.state_precision``) and a step counter."""
    rule = STATE_FULL[rule_name]
    shape = tuple(shape)
    if rule.shapes is not None:
        n = sum(math.prod(s) for s in rule.shapes(shape).values()) * elem
    else:
        n = len(rule.state_names) * state_precision.moment_bytes(precision, math.prod(shape), elem)
    return n + (_STEP_BYTES if rule.counts_steps else 0)


def _free_rule_bytes(free: str, other_side: int, elem: int) -> int:
    """A contextual state-free rule's state for one split tensor (``StateFreeRule.state_bytes``)."""
    state_bytes = STATE_FREE[free].state_bytes
    return state_bytes(other_side, elem) if state_bytes is not None else 0


def _split_bytes(settings: dict, p: torch.Tensor, svd_layout: str) -> int:
    """One split tensor: the reduced state, the subspace, and what the methods add (the
    contextual state-free rule's state, LDAdam's error buffer of the tensor's size)."""
    projection, density, transposed = settings["projection"], settings["density"], settings.get("transposed", False)
    elem = p.element_size()
    extra = p.numel() * elem if settings["error_feedback"] and projection in proj.MATRIX else 0
    if projection in proj.COORDINATE:
        k = proj.coordinate_count(projection, p.shape, transposed, density)
        if k == 0:
            return 0
        reduced = proj.reduced_shape(projection, p.shape, transposed, density)
        dim, _ = proj.reduced_dim(projection, p.shape, transposed)
        other = p.shape[1 - dim] if dim is not None else 0
        return (_rule_bytes(settings["state_full"], reduced, elem) + _coordinate_index_bytes(projection, k, p.numel())
                + _free_rule_bytes(settings["state_free"], other, elem))
    if projection in proj.MATRIX:
        r = proj.matrix_rank(p.shape, density)
        if r == 0:
            return 0
        small, large = sorted(p.shape)
        # implementation: Q (small x r), state (large x r); paper (Appendix D): Q (large x r), state (small x r)
        basis, side = (large, small) if svd_layout == "paper" else (small, large)
        return (basis * r * elem + _rule_bytes(settings["state_full"], (side, r), elem)
                + _free_rule_bytes(settings["state_free"], side, elem) + extra)
    raise ValueError(f"Unknown projection {projection!r}; valid choices: {sorted(proj.PROJECTIONS)}")


def _coordinate_index_bytes(projection: str, k: int, numel: int) -> int:
    """The sorted indices a coordinate projection keeps (randk's int32: half its two moments; Appendix D
    counts a seed, but drawing them again every step costs more than the update)."""
    return k * torch.empty((), dtype=proj.index_dtype(projection, numel)).element_size()


def _active_block_tensors(projectable: list[tuple[dict, torch.Tensor]], shared: dict) -> list[torch.Tensor]:
    """Projectable tensors state-full in the first window (window 0), as the optimizer picks them."""
    if shared["block_granularity"] == "tensor":
        units = [[p] for _, p in projectable]
    else:
        by_block: dict = {}
        for group, p in projectable:
            by_block.setdefault(group.get("block"), []).append(p)
        units = [by_block[b] for b in sorted(by_block, key=lambda b: (b is None, b))]
    chosen = proj.select_blocks(shared["block_order"], len(units), shared["density"], 0, shared["seed"],
                                granularity=shared["block_granularity"])
    return [p for i in chosen for p in units[i]]


def estimate_state_bytes(model: nn.Module, name: str, svd_layout: str = "paper", **hparams) -> int:
    """Analytic optimizer-state bytes of `build_optimizer(model, name, **hparams)` (Appendix D), on
    `meta`-device models too; block projection: the first window's blocks. `svd_layout`: "paper" or
    "implementation" (module docstring)."""
    if svd_layout not in ("implementation", "paper"):
        raise HyperparameterError(f"Unknown svd_layout {svd_layout!r}; valid choices: ['implementation', 'paper']")
    name, shared = resolve(name, hparams)
    if name in external.PACKAGES:
        return external.estimate_state_bytes(model, name, shared)
    if name == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return sum(2 * p.numel() * p.element_size() + _STEP_BYTES for p in params)
    return _frugal_bytes(model, name, shared, svd_layout)
