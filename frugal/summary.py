"""`frugal.describe(model_or_optimizer)`: which tensors FRUGAL splits, and what that costs.

A table, one row per tensor (name, shape, parameters, role), then the projectable share, its
state-full share in the current window and the optimizer state this implies against AdamW's:

    >>> print(frugal.describe(model, density=0.25))       # what FRUGAL(model, density=0.25) will do
    >>> print(frugal.describe(optimizer, model=model))    # what an existing optimizer does now

The state figure counts the rule's moments as stored (``state_precision``); `frugal.state_bytes`
measures the real bytes after a step.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from . import grouping, state_precision
from .optimizer import FRUGAL
from .rules import STATE_FULL


@dataclass
class Description:
    """The rows and summary lines of `describe`; `str()` (and the REPL) show them as a table."""
    title: str
    rows: list[tuple[str, str, int, str]] = field(default_factory=list)  # name, shape, numel, role
    summary: list[str] = field(default_factory=list)
    projectable_fraction: float = 0.0  # of all trainable parameters
    state_full_fraction: float = 0.0  # of the projectable parameters, in the current window
    state_bytes: int = 0  # estimated: the state-full rule's moments
    adamw_bytes: int = 0

    def __str__(self) -> str:
        head = ("tensor", "shape", "params", "role")
        widths = [max(len(head[i]), *(len(f"{r[i]:,}" if i == 2 else r[i]) for r in self.rows)) if self.rows
                  else len(head[i]) for i in range(4)]
        lines = [self.title, "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
        for name, shape, numel, role in self.rows:
            lines.append(f"{name.ljust(widths[0])}  {shape.ljust(widths[1])}  {f'{numel:,}'.rjust(widths[2])}  {role}")
        return "\n".join(lines + self.summary)

    __repr__ = __str__


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def _other_rule_line(rule: str, default: str, tensors: list[tuple[str, int]]) -> str:
    """The summary line of the state-full tensors that take `rule` instead of the optimizer's `default`
    (Muon's AdamW tensors: StateFullRule.rest): which, and why. Names that differ only in layer
    numbers are shown once, with a star and a count."""
    seen: dict[str, int] = {}
    for name, _ in tensors:
        key = re.sub(r"(?<=\.)\d+(?=\.)", "*", name)
        seen[key] = seen.get(key, 0) + 1
    names = ", ".join(key if n == 1 else f"{key} (x{n})" for key, n in seen.items())
    not_matrices = sum(dim != 2 for _, dim in tensors)
    why = STATE_FULL[default].rest if default in STATE_FULL else None
    reason = why[1] if why and why[0] == rule else "as their param group sets"
    return (f"{rule} instead of {default} for {len(tensors)} state-full tensors ({not_matrices} not matrices, "
            f"{len(tensors) - not_matrices} matrices FRUGAL does not split): {names}; {reason}")


def describe(target, model: nn.Module | None = None, **hparams) -> Description:
    """Describe how FRUGAL splits `target`: a model (with FRUGAL's keyword arguments, plus
    `target_modules` / `state_free_modules` / `tensor_order` as in `frugal.param_groups`) or a FRUGAL optimizer
    (pass `model=` to see parameter names; wrappers such as accelerate's are looked through)."""
    if not isinstance(target, (nn.Module, FRUGAL)) and isinstance(getattr(target, "optimizer", None), FRUGAL):
        target = target.optimizer
    if isinstance(target, nn.Module):
        keys = {k: hparams.pop(k) for k in ("target_modules", "state_free_modules", "tensor_order") if k in hparams}
        roles = grouping.module_roles(target, keys.get("target_modules"))  # a model without blocks is described too
        groups = grouping._groups(roles, keys.get("state_free_modules", ()), keys.get("tensor_order", "module"),
                                  hparams.get("state_full"))  # muon: AdamW on the rest, as FRUGAL(model) does
        optimizer, model = FRUGAL(groups, **hparams), target
    elif isinstance(target, FRUGAL):
        if hparams:
            raise TypeError(f"describe(optimizer) takes no hyperparameters, got {sorted(hparams)}")
        optimizer = target
    else:
        raise TypeError(f"describe takes a model (nn.Module) or a frugal.FRUGAL optimizer, got {type(target).__name__}")
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return _describe(optimizer, names, type(model or optimizer).__name__)


def _describe(optimizer: FRUGAL, names: dict[int, str], what: str) -> Description:
    active = set(optimizer.active_blocks() or ())
    fraction = optimizer.state_full_fraction()
    d = optimizer.defaults
    other_rule: dict[str, list[tuple[str, int]]] = {}  # rule -> (name, dim) of state-full tensors not on d's rule
    rows, total, projectable, blocks = [], 0, 0, set()
    state_values, adamw_bytes, n_projectable = 0.0, 0, 0
    for gi, group in enumerate(optimizer.param_groups):
        moments = len(STATE_FULL[group["state_full"]].state_names)
        group_names = group.get("param_names", [])
        for pi, p in enumerate(group["params"]):
            name = names.get(id(p)) or (group_names[pi] if pi < len(group_names) else f"group {gi}, tensor {pi}")
            elem, numel = p.element_size(), p.numel()
            total += numel
            adamw_bytes += 2 * numel * elem
            moment_bytes = state_precision.moment_bytes(group["state_precision"], numel, elem)
            if group["always_state_free"]:
                role = "state-free"
            elif not group["projectable"]:
                role, state_values = "state-full", state_values + moments * moment_bytes
                if group["state_full"] != d["state_full"]:
                    role += f", {group['state_full']}"
                    other_rule.setdefault(group["state_full"], []).append((name, p.dim()))
            else:
                projectable, n_projectable = projectable + numel, n_projectable + 1
                blocks.add(group["block"])
                state_values += moments * moment_bytes * fraction
                layers = group["projection"] == "block" and group["block_granularity"] != "tensor"
                role = f"block {group['block']}"
                if layers and group["block"] in active:
                    role += " (state-full now)"
                elif not layers:
                    role = (f"layer {group['block']}, tensor blocks" if group["projection"] == "block"
                            else f"{role}, {group['projection']}")
            shape = "x".join(map(str, p.shape)) or "scalar"
            rows.append((name, shape, numel, role))

    order = {name: i for i, name in enumerate(names.values())}  # the model's parameter order
    rows.sort(key=lambda row: order.get(row[0], len(order)))
    desc = Description(f"FRUGAL split of {what}", rows, projectable_fraction=projectable / total if total else 0.0,
                       state_full_fraction=fraction, state_bytes=int(state_values), adamw_bytes=adamw_bytes)
    if not n_projectable:
        desc.summary.append("no projectable tensors: FRUGAL runs the state-full rule on every tensor (no "
                            "memory saved); see frugal.param_groups(model, target_modules=[...])")
    else:
        desc.summary.append(f"projectable: {n_projectable} tensors in {len(blocks)} blocks, {projectable:,} of "
                            f"{total:,} parameters ({desc.projectable_fraction:.1%})")
        if d["projection"] != "block":
            where = f"{d['projection']} projection"
        elif d["block_granularity"] == "tensor":
            where = f"{len(active)} of {n_projectable} tensors"
        else:
            where = f"blocks {sorted(active)} of {len(blocks)}"
        desc.summary.append(f"state-full now: {where}, {fraction:.1%} of the projectable parameters "
                            f"(density {d['density']:g}, {d['projection']}, update gap {d['update_gap']})")
    for rule, tensors in other_rule.items():
        desc.summary.append(_other_rule_line(rule, d["state_full"], tensors))
    ratio = desc.state_bytes / adamw_bytes if adamw_bytes else 0.0
    stored = "" if d["state_precision"] == "param" else f", stored as {d['state_precision']}"
    moments = " and ".join([d["state_full"], *other_rule])
    desc.summary.append(f"optimizer state ~ {_size(desc.state_bytes)} = {ratio:.1%} of AdamW's "
                        f"{_size(adamw_bytes)} ({moments} moments of the state-full values{stored})")
    if optimizer._in_backward is not None:
        desc.summary.append("the step runs inside backward (frugal.step_in_backward): no full set of gradients is held")
    return desc
