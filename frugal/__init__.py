"""FRUGAL: Full-Rank Updates with GrAdient spLitting.

A torch-only optimizer library. The gradient of every projectable weight is split into a small
state-full subspace, updated with a stateful rule (AdamW, Lion, SGD with momentum), and its
complement, updated with a state-free rule (signSGD, SGD) that keeps no optimizer state.

    import frugal
    optimizer = frugal.FRUGAL(model, lr=1e-3, density=0.25)      # any transformers model, or your own
    print(frugal.describe(optimizer, model=model))                # which tensors are split, what it costs

    optimizer = frugal.build_optimizer(model, "frugal", lr=1e-3, density=0.25, update_gap=200)
    scheduler = frugal.build_scheduler(optimizer, "cosine_restarts", total_steps=200_000, cycle_length=10_000)

Modules (tests/test_extending.py keeps this list whole):

- optimizer: `FRUGAL`, the phased step; reference: Algorithm 1 for one tensor (the fast path's reference)
- rules: the paper's state-full and state-free rules, each declaring its facts (`register_state_full/free`
  adds one); muon, fira, factored: the rules of Muon, of Fira (and Hugging Face's AdamW) and of AdaMeM,
  which register themselves when imported here
- projections: how the state-full subspace is chosen; windows: which tensors are state-full in a
  step's window; state_management: a projected tensor's subspace and state, window by window;
  subspace: LDAdam's power iteration and error feedback
- state_precision: the moments in bf16 or 8 bits; kernels: the sign update and stochastic rounding
- in_backward: the step inside backward
- comm: the state-free part on the wire as a one-bit majority vote (a DDP communication hook, opt-in)
- grouping: which parameters are split, and their blocks; sharding: FSDP2 shards
- hparams: the hyperparameters' checks; checks: the shared error and integer check
- registry: `build_optimizer` for every optimizer of the paper; external: APOLLO and Adam-mini
- memory: optimizer-state bytes, measured and estimated; summary: `describe`; density: the realised
  density
- schedules: learning-rate schedules; adaptive: the opt-in density schedule and growing update gap
"""
from .optimizer import FRUGAL
from . import factored, fira, muon  # noqa: F401  (their rules register themselves)
from .grouping import param_groups, resolve_params
from .hparams import HyperparameterError
from .in_backward import NonFiniteGradientError, StepInBackward, grad_norm, step_in_backward
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
    "grad_norm",
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
