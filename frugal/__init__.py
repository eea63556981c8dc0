"""FRUGAL: Full-Rank Updates with GrAdient spLitting.

A torch-only optimizer library. The gradient of every projectable weight is split into a small
state-full subspace, updated with a stateful rule (AdamW, Lion, SGD with momentum), and its
complement, updated with a state-free rule (signSGD, SGD) that keeps no optimizer state.

    import frugal
    optimizer = frugal.FRUGAL(model, lr=1e-3, density=0.25)      # any transformers model, or your own
    print(frugal.describe(optimizer, model=model))                # which tensors are split, what it costs

    optimizer = frugal.build_optimizer(model, "frugal", lr=1e-3, density=0.25, update_gap=200)
    scheduler = frugal.build_scheduler(optimizer, "cosine_restarts", total_steps=200_000, cycle_length=10_000)
"""
from .optimizer import FRUGAL
from .grouping import param_groups, resolve_params
from .hparams import HyperparameterError
from .in_backward import NonFiniteGradientError, StepInBackward, step_in_backward
from .registry import OPTIMIZERS, build_optimizer
from .memory import estimate_state_bytes, state_bytes
from .schedules import build_scheduler
from .summary import describe



def unwrap(optimizer):
    """The optimizer inside wrappers that keep it as `.optimizer` (accelerate's AcceleratedOptimizer,
    which HF Trainer's `trainer.optimizer` is after `train()`); the optimizer itself otherwise."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def density_report(optimizer) -> dict:
    """`FRUGAL.density_report()` of `optimizer`, through wrappers (see `unwrap`)."""
    return unwrap(optimizer).density_report()


def state_full_fraction(optimizer) -> float:
    """`FRUGAL.state_full_fraction()` of `optimizer`, through wrappers (see `unwrap`)."""
    return unwrap(optimizer).state_full_fraction()


__all__ = [
    "FRUGAL",
    "density_report",
    "state_full_fraction",
    "unwrap",
    "HyperparameterError",
    "NonFiniteGradientError",
    "StepInBackward",
    "step_in_backward",
    "OPTIMIZERS",
    "build_optimizer",
    "build_scheduler",
    "describe",
    "estimate_state_bytes",
    "param_groups",
    "resolve_params",
    "state_bytes",
]
__version__ = "0.1.0"
