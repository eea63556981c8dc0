"""Learning-rate schedules of the paper, as multipliers of the peak LR for `LambdaLR`.

The paper's pre-training default (Appendix A.1, GaLore's recipe) is cosine with restarts: each cycle
of `cycle_length` steps warms up linearly from 0 over `warmup_fraction` of it (the first step's
multiplier is 0), then decays along a cosine to `min_lr_ratio` of the peak. The re-warmup matters for
FRUGAL: a restart is a sudden LR jump for signSGD, whose step does not shrink with the gradient. Each
schedule is a pure `step -> multiplier`, a `functools.partial` of a module-level function, so it
pickles and `LambdaLR.state_dict()` holds plain numbers only.
"""
from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch

from .hparams import HyperparameterError, _integer, _number


def _warmup_steps(length: int, warmup_fraction, warmup_steps) -> int:
    """Warmup length within one cycle of `length` steps: explicit steps win over the fraction."""
    if warmup_steps is not None:
        steps = _integer("warmup_steps", warmup_steps, 0)
        if steps > length:
            raise HyperparameterError(f"warmup_steps={steps} is invalid: longer than the cycle of {length} steps")
        return steps
    return int(round(_number("warmup_fraction", warmup_fraction, 0.0, 1.0) * length))


def cosine_multiplier(step: int, *, cycle_length: int, warmup_steps: int, min_lr_ratio: float,
                      restart: bool) -> float:
    """Multiplier of the peak LR at `step` (0-based): warmup then cosine to `min_lr_ratio`.

    With `restart`, the step is taken modulo `cycle_length` (every cycle re-warms); without, the
    multiplier stays at `min_lr_ratio` after the single cycle ends.
    """
    if restart:
        t = step % cycle_length
    elif step >= cycle_length:
        return min_lr_ratio
    else:
        t = step
    if t < warmup_steps:
        return t / warmup_steps
    decay_steps = max(1, cycle_length - warmup_steps)
    progress = (t - warmup_steps) / decay_steps
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant_multiplier(step: int, *, warmup_steps: int) -> float:
    """Linear warmup to the peak, then the peak for ever."""
    if step < warmup_steps:
        return step / warmup_steps
    return 1.0


def _cosine(total_steps, cycle_length, warmup_fraction, min_lr_ratio, warmup_steps, restart):
    _integer("total_steps", total_steps, 1)
    cycle_length = total_steps if cycle_length is None else _integer("cycle_length", cycle_length, 1)
    return functools.partial(
        cosine_multiplier,
        cycle_length=cycle_length,
        warmup_steps=_warmup_steps(cycle_length, warmup_fraction, warmup_steps),
        min_lr_ratio=_number("min_lr_ratio", min_lr_ratio, 0.0, 1.0),
        restart=restart,
    )


def cosine_restarts(total_steps: int, cycle_length: int | None = None, warmup_fraction: float = 0.1,
                    min_lr_ratio: float = 0.1, warmup_steps: int | None = None) -> Callable[[int], float]:
    """The paper's default: cosine cycles of `cycle_length` steps (default: one cycle over
    `total_steps`), each with its own linear warmup, decaying to `min_lr_ratio` of the peak."""
    return _cosine(total_steps, cycle_length, warmup_fraction, min_lr_ratio, warmup_steps, restart=True)


def cosine(total_steps: int, warmup_fraction: float = 0.1, min_lr_ratio: float = 0.1,
           warmup_steps: int | None = None) -> Callable[[int], float]:
    """One cosine cycle over `total_steps` with linear warmup (Table 7 of the paper; 3B runs)."""
    return _cosine(total_steps, None, warmup_fraction, min_lr_ratio, warmup_steps, restart=False)


def constant(total_steps: int, warmup_fraction: float = 0.1,
             warmup_steps: int | None = None) -> Callable[[int], float]:
    """Constant LR after a linear warmup over `warmup_fraction` of `total_steps` (Table 6)."""
    _integer("total_steps", total_steps, 1)
    return functools.partial(
        constant_multiplier, warmup_steps=_warmup_steps(total_steps, warmup_fraction, warmup_steps)
    )


SCHEDULES: dict[str, Callable[..., Callable[[int], float]]] = {
    "constant": constant,
    "cosine": cosine,
    "cosine_restarts": cosine_restarts,
}


def build_lambda(name: str, total_steps: int, **kwargs) -> Callable[[int], float]:
    """The pure multiplier function of schedule `name` (validated)."""
    if name not in SCHEDULES:
        raise HyperparameterError(f"Unknown schedule {name!r}; valid choices: {sorted(SCHEDULES)}")
    factory = SCHEDULES[name]
    allowed = set(inspect.signature(factory).parameters) - {"total_steps"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise HyperparameterError(
            f"Schedule {name!r} does not take {unknown}; valid keyword arguments: {sorted(allowed)}"
        )
    return factory(total_steps, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, name: str, total_steps: int,
                    **kwargs) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` over every param group of `optimizer` following schedule `name`.

    Names: "cosine_restarts" (kwargs cycle_length, warmup_fraction=0.1, min_lr_ratio=0.1),
    "cosine" (warmup_fraction=0.1, min_lr_ratio=0.1), "constant" (warmup_fraction=0.1); all
    accept `warmup_steps` (overrides the fraction). Call `scheduler.step()` once per optimizer step.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, build_lambda(name, total_steps, **kwargs))
