"""The checks every part of the project shares (standard library only): the error a bad optimizer
hyperparameter raises and the one integer check (the training config, the data pipeline, the
memory planner and the model configs call it with their own error class)."""
from __future__ import annotations

import numbers


class HyperparameterError(ValueError):
    """A bad optimizer hyperparameter: the message names the key, the value and what is valid."""


def check_integer(name: str, value, minimum: int | None = None, *, error: type[Exception] = None,
                  integral_floats: bool = False, why: str = "") -> int:
    """The project's one integer check: ``value`` as an int, or ``error`` (default
    HyperparameterError) naming ``name``, the value and the valid range (``why`` says what the
    setting means). ``integral_floats``: 200.0 (a YAML/CLI float) is the integer 200."""
    if integral_floats and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # int, numpy integers (not tensors)
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise (error or HyperparameterError)(f"{name}={value!r} is invalid: expected an integer{bound}{why}")
    return value
