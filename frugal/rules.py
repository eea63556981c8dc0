"""The paper's update rules: state-full ``adamw``, ``lion``, ``sgdm`` and state-free ``signsgd``, ``sgd``,
``none``; what a rule declares (``StateFullRule``, ``StateFreeRule``) and how it registers.

Every rule has two forms over the same math (docs/library.md, "Writing a rule"): ``foreach``, in
place over tensor lists (the fast path; state-full: targets with decoupled weight decay, state-free:
``p <- p * decay - lr * d(g)``), and ``direction``, one tensor: returns ``d`` (``p <- p - lr * d``) and
advances the state (the single-tensor reference, ``FRUGAL(foreach=False)``). AdamW runs torch's fused
kernel where it exists (the step is memory-bound). State-free rules own no state by construction.
Other rules live in modules that register themselves at import (``frugal.muon``, ``frugal.fira``,
``frugal.factored``; ``frugal/__init__.py`` imports them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from . import kernels, state_precision
from .checks import HyperparameterError

_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _can_fuse(tensors: list[Tensor]) -> bool:
    t = tensors[0]
    return hasattr(torch, "_fused_adamw_") and t.device.type in _FUSED_DEVICES and t.dtype in _FUSED_DTYPES


# ---- state-full rules ----------------------------------------------------------------------------
def adamw_(targets, grads, states, steps, *, lr, betas, eps, weight_decay, momentum=0.0):
    """AdamW (torch's formulation): t *= 1 - lr*wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
    t -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps), with bc_i = 1 - b_i^step counted per tensor, so
    a freshly (re)initialised state restarts its bias correction."""
    if not targets:
        return
    exp_avgs, exp_avg_sqs = states
    beta1, beta2 = betas
    torch._foreach_add_(steps, 1.0)
    if _can_fuse(targets):
        torch._fused_adamw_(targets, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=False, grad_scale=None, found_inf=None)
        return
    # Devices/dtypes without the fused kernel: the same math, one tensor at a time.
    for t, g, m, v, s in zip(targets, grads, exp_avgs, exp_avg_sqs, steps):
        t.mul_(1.0 - lr * weight_decay)
        t.sub_(lr * _adamw_math(g, m, v, s, beta1, beta2, eps))


def _adamw_math(g, m, v, step, beta1, beta2, eps):
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step = step.double()  # a tensor (no host sync), in float64 like the fused kernel's scalars
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = (1.0 - beta2 ** step).sqrt()
    return (m / bc1) / (v.sqrt() / bc2_sqrt + eps)


def adamw_direction(grad, state, *, betas, eps, momentum=0.0):
    state["step"] += 1
    return _adamw_math(grad, state["exp_avg"], state["exp_avg_sq"], state["step"], *betas, eps)


def lion_(targets, grads, states, steps, *, lr, betas, eps, weight_decay, momentum=0.0):
    """Lion (Chen et al., 2023): t *= 1 - lr*wd;  t -= lr * sign(b1 m + (1-b1) g);
    m = b2 m + (1-b2) g. One state tensor."""
    if not targets:
        return
    (exp_avgs,) = states
    beta1, beta2 = betas
    if weight_decay:
        torch._foreach_mul_(targets, 1.0 - lr * weight_decay)
    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(direction)
    torch._foreach_add_(targets, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)


def lion_direction(grad, state, *, betas, eps, momentum=0.0):
    m = state["exp_avg"]
    direction = torch.sign(torch.lerp(m, grad, 1.0 - betas[0]))
    m.lerp_(grad, 1.0 - betas[1])
    return direction


def sgdm_(targets, grads, states, steps, *, lr, betas, eps, weight_decay, momentum=0.9):
    """SGD with momentum in the paper's exponential-average form (Algorithm 2):
    m = momentum * m + (1 - momentum) g;  t -= lr * m. No bias correction."""
    if not targets:
        return
    (bufs,) = states
    if weight_decay:
        torch._foreach_mul_(targets, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(bufs, grads, 1.0 - momentum)
    torch._foreach_add_(targets, bufs, alpha=-lr)


def sgdm_direction(grad, state, *, betas, eps, momentum=0.9):
    return state["momentum_buffer"].lerp_(grad, 1.0 - momentum).clone()


@dataclass(frozen=True)
class StateFullRule:
    foreach: Callable
    direction: Callable
    state_names: tuple[str, ...]
    counts_steps: bool
    shapes: Callable | None = None  # target shape -> {state name: shape}; None: all the target's
    matrix_only: bool = False  # needs 2-D targets (Adafactor's factors)
    decays_after: bool = False  # weight decay after the update (Hugging Face's AdamW), not before
    # Its own hyperparameters with defaults (Muon's ns_steps): keywords of FRUGAL, foreach and direction.
    options: dict[str, Any] = field(default_factory=dict, compare=False)
    group_keys: tuple[str, ...] = ()  # group keys it also reads as keywords (Muon: transposed)
    gathers: bool = False  # takes whole FSDP2 DTensors (not local shards) and gathers what it needs
    check: Callable | None = None  # group -> None, raises HyperparameterError for what it cannot update
    elementwise: bool = False  # its state may be updated a slice at a time (frugal.state_precision)
    nonnegative: tuple[str, ...] = ()  # moments that are never negative (8-bit: the unsigned map)
    default_momentum: float = 0.9  # what momentum=None means for it (the paper's SGDM 0.9; torch's Muon 0.95)
    bucket_temporaries: int = 0  # target-sized tensors foreach allocates per bucket (the planner): Lion's 1
    adam_moments: bool = False  # Adam's two moments (what LDAdam's transport and error feedback need)
    validate_options: Callable | None = None  # hparams -> hparams: checks and normalises its own options
    # (rule, why): what the non-projectable tensors of a model take instead (Muon's AdamW; frugal.describe)
    rest: tuple[str, str] | None = None

    def init_state(self, state: dict, like: Tensor, shape=None, group: dict | None = None) -> None:
        """Add the missing state tensors (zeros of ``shape``, default ``like``'s; DTensors for an FSDP2
        shard) to ``state``; a fresh moment restarts the step count. ``group``: a whole tensor's group,
        whose ``state_precision`` stores the moments; without it they take ``like``'s dtype."""
        shapes = None if self.shapes is None else self.shapes(like.shape if shape is None else shape)
        for name in self.state_names:
            if name not in state:
                if group is not None and state_precision.is_low(group):
                    state_precision.zeros(state, name, like.shape if shape is None else shape, like, group)
                elif shapes is not None:
                    state[name] = torch.zeros(shapes[name], dtype=like.dtype, device=like.device)
                else:
                    state[name] = (torch.zeros_like(like) if shape is None else
                                   torch.zeros(shape, dtype=like.dtype, device=like.device))
                state.pop("step", None)
        if self.counts_steps:
            step = state.get("step")
            if step is None:
                state["step"] = torch.zeros((), dtype=torch.float32, device=like.device)
            elif step.device != like.device:  # load_state_dict leaves 'step' where it was saved
                state["step"] = step.to(like.device)


STATE_FULL = {
    "adamw": StateFullRule(adamw_, adamw_direction, ("exp_avg", "exp_avg_sq"), True, elementwise=True,
                           nonnegative=("exp_avg_sq",), adam_moments=True),
    "lion": StateFullRule(lion_, lion_direction, ("exp_avg",), False, elementwise=True, bucket_temporaries=1),
    "sgdm": StateFullRule(sgdm_, sgdm_direction, ("momentum_buffer",), False, elementwise=True),
}


# ---- state-free rules ----------------------------------------------------------------------------
def signsgd_(params, grads, *, lr, decay=1.0, sign_update="auto"):
    """p <- p * decay - lr * sign(g), sign(0) = 0; one pass where it compiles (frugal.kernels)."""
    kernels.sign_update_(params, grads, lr=lr, decay=decay, mode=sign_update)


def signsgd_direction(g, sign_update="auto"):
    return torch.sign(g)


def _check_sign_update(hparams: dict) -> dict:
    if "sign_update" in hparams and hparams["sign_update"] not in kernels.SIGN_UPDATES:
        raise HyperparameterError(f"Invalid sign_update: {hparams['sign_update']!r}; valid choices: "
                                  f"{', '.join(kernels.SIGN_UPDATES)}")
    return hparams


def none_(params, grads, *, lr, decay=1.0):
    """No gradient step on the complement: it is frozen (BAdam) or dropped (GaLore); decoupled
    weight decay still applies to every weight."""
    if params and decay != 1.0:
        torch._foreach_mul_(params, decay)


def sgd_(params, grads, *, lr, decay=1.0):
    """p <- p * decay - lr * g."""
    none_(params, grads, lr=lr, decay=decay)
    if params:
        torch._foreach_add_(params, grads, alpha=-lr)


class FreeContext(NamedTuple):
    """What a contextual state-free rule reads besides the residual: the split of one tensor, in
    the orientation of the reduced gradient (a GPT-2 ``Conv1D`` weight under a matrix projection:
    its transpose)."""
    full_grad: Tensor  # the reduced gradient R
    reduced_dim: int  # the dimension of R (and of the residual) that the projection reduced
    group: dict  # the tensor's hyperparameters


class SplitContext(NamedTuple):
    """What a rule that takes a split tensor's whole step (``StateFreeRule.split_step``) reads."""
    grad: Tensor  # the gradient that was projected (stored orientation)
    full_grad: Tensor  # the reduced gradient R
    lift: Callable[[Tensor], Tensor]  # a reduced tensor to the full (stored) shape: P^{-1}
    reduced_dim: int  # the dimension of R that the projection reduced
    transposed: bool  # R is in the orientation of the stored tensor's transpose
    rule: "StateFullRule"  # the group's state-full rule (its moments are in ``state``)
    group: dict


@dataclass(frozen=True)
class StateFreeRule:
    # foreach(params, grads, *, lr, decay, ...): p <- p * decay - lr * d(g); None: direction per tensor.
    foreach: Callable | None = None
    direction: Callable[[Tensor], Tensor] | None = None  # None: no update besides weight decay
    # Rules that read the split, per tensor, with state from init_state(state, residual-like, reduced_dim):
    # contextual (AdaMeM): (residual, state, FreeContext) -> direction; split_step (Fira): (param, state,
    # SplitContext) -> None, the tensor's whole step (no other phase runs on it).
    contextual: Callable | None = None
    init_state: Callable | None = None
    split_step: Callable | None = None
    # d(c g) = d(g) for c > 0: clipping cannot change it (frugal.in_backward steps it early).
    scale_invariant: bool = False
    # (elements of the side the projection did not reduce, element size) -> bytes of init_state's state.
    state_bytes: Callable[[int, int], int] | None = None
    # (param group, elements, element size) -> bytes its update allocates per tensor (the planner).
    temporary_bytes: Callable[[dict, int, int], int] | None = None
    options: dict[str, Any] = field(default_factory=dict, compare=False)  # as StateFullRule's
    validate_options: Callable | None = None
    # d(g) of each element depends on that element alone (docs/library.md, "Writing a rule"); not
    # declared: it gets the residual of every split tensor, and whole tensors at once.
    elementwise: bool = False

    @property
    def reads_split(self) -> bool:
        """It needs a split tensor (a reduced gradient with a reduced dimension): not block, not randk."""
        return self.contextual is not None or self.split_step is not None

    @property
    def reads_residual(self) -> bool:
        """Its update reads the residual ``g - P^{-1}(P(g))`` of a split tensor (``none`` reads nothing;
        a ``split_step`` rule computes what it reads itself)."""
        return self.split_step is None and (self.direction is not None or self.contextual is not None
                                            or not self.elementwise)

    def step_(self, params: list[Tensor], grads: list[Tensor], *, lr: float, decay: float, **options) -> None:
        """p <- p * decay - lr * d(g) for each pair: its ``foreach`` where it declares one."""
        if self.foreach is not None:
            self.foreach(params, grads, lr=lr, decay=decay, **options)
            return
        for p, g in zip(params, grads):
            if decay != 1.0:
                p.mul_(decay)
            if self.direction is not None:
                p.sub_(self.direction(g, **options), alpha=lr)


def _eager_sign_bytes(group: dict, numel: int, elem: int) -> int:
    """signSGD's one sign(g) temporary, where the compiled single pass (frugal.kernels) does not run."""
    if group["sign_update"] == "compiled":
        return 0
    return numel * elem if group["sign_update"] == "eager" or numel < kernels.AUTO_MIN_NUMEL else 0


STATE_FREE = {
    "signsgd": StateFreeRule(signsgd_, signsgd_direction, scale_invariant=True,  # sign(c g) = sign(g)
                             temporary_bytes=_eager_sign_bytes, elementwise=True,
                             options={"sign_update": "auto"}, validate_options=_check_sign_update),
    "sgd": StateFreeRule(sgd_, lambda g: g, elementwise=True),
    "none": StateFreeRule(none_, None, scale_invariant=True, elementwise=True),  # weight decay only
}


def keywords(rule, group: dict) -> dict[str, Any]:
    """What ``rule`` takes from ``group`` as keywords: its options and the group keys it reads (lists,
    as a config gives them, as tuples)."""
    names = (*rule.options, *getattr(rule, "group_keys", ()))
    return {k: tuple(group[k]) if isinstance(group[k], list) else group[k] for k in names}


def option_defaults() -> dict[str, Any]:
    """Every registered rule's own options with their defaults: the keywords of ``FRUGAL(...)`` beyond its
    signature (a rule in its own module adds its options when it registers)."""
    return {k: v for rule in (*STATE_FULL.values(), *STATE_FREE.values()) for k, v in rule.options.items()}


def register_state_full(name: str, rule: StateFullRule) -> None:
    """Make ``rule`` the state-full rule ``name`` (``FRUGAL(state_full=name)``, the registry, the configs):
    what it declares is all the optimizer, its checks, the estimate and the planner read."""
    _register(STATE_FULL, "state_full", name, rule, StateFullRule)


def register_state_free(name: str, rule: StateFreeRule) -> None:
    """Make ``rule`` the state-free rule ``name`` (``FRUGAL(state_free=name)``); see ``register_state_full``."""
    _register(STATE_FREE, "state_free", name, rule, StateFreeRule)


def _register(table: dict, key: str, name: str, rule, kind: type) -> None:
    if not isinstance(rule, kind):
        raise TypeError(f"register a {kind.__name__} as {key} {name!r}, got {type(rule).__name__}")
    if name in table and table[name] is not rule:
        raise ValueError(f"{key} {name!r} is taken (by {table[name]!r}); registered: {', '.join(table)}")
    taken = option_defaults()
    clash = sorted(k for k, v in rule.options.items() if k in taken and taken[k] != v)
    if clash:
        raise ValueError(f"{key} {name!r} declares options {clash} that another rule declares with another "
                         f"default; registered options: {', '.join(sorted(taken))}")
    table[name] = rule


# Projections a contextual rule can run on: a reduced gradient with a reduced dimension, so that a
# norm or a statistic along the other dimension exists (not block, not randk).
CONTEXTUAL_PROJECTIONS = ("svd", "random", "power", "column", "row", "randperm")
