"""Update rules: state-full (``adamw``, ``lion``, ``sgdm``) and state-free (``signsgd``, ``sgd``, ``none``).

Every rule has two forms over the same math:

- ``foreach``: in place over parallel tensor lists, the fast path. State-full rules update their
  ``targets`` (the parameter itself for block projection and non-projectable tensors, or a reduced
  tensor the optimizer writes back afterwards) with decoupled weight decay
  ``t <- t * (1 - lr * weight_decay)``. State-free rules update whole parameters,
  ``p <- p * decay - lr * d(g)``, with the decay factor given by the optimizer.
- ``direction``: one tensor, returns the update direction ``d`` (``p <- p - lr * d``) and advances
  the state in place. This is the readable single-tensor reference (``FRUGAL(foreach=False)``) the
  fast path is tested against, and the path of bf16 weights with stochastic rounding.

The AdamW rule runs torch's fused multi-tensor kernel where it exists (about 5x faster than the
foreach path on CPU, at memory speed): the step is memory-bound, so passes over memory count.

State-free rules own no state by construction. signSGD is the state-free rule of choice because
its update has Adam's magnitude (Section 4 of the paper).

A new state-full rule (e.g. Adafactor-style factored moments, as AdaMeM needs) gives its
``init_state``; a new state-free rule, its two forms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import kernels

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

    def init_state(self, state: dict, like: Tensor, shape=None) -> None:
        """Add the missing state tensors (zeros of ``shape``, default ``like``'s) to ``state``.
        A fresh moment restarts the step count. ``like`` may be a DTensor (FSDP2 shard): the
        moments are then DTensors too, so torch.distributed.checkpoint can save and reshard them."""
        for name in self.state_names:
            if name not in state:
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
    "adamw": StateFullRule(adamw_, adamw_direction, ("exp_avg", "exp_avg_sq"), True),
    "lion": StateFullRule(lion_, lion_direction, ("exp_avg",), False),
    "sgdm": StateFullRule(sgdm_, sgdm_direction, ("momentum_buffer",), False),
}


# ---- state-free rules ----------------------------------------------------------------------------
def signsgd_(params, grads, *, lr, decay=1.0, sign_update="auto"):
    """p <- p * decay - lr * sign(g), sign(0) = 0; one pass where it compiles (frugal.kernels)."""
    kernels.sign_update_(params, grads, lr=lr, decay=decay, mode=sign_update)


def sgd_(params, grads, *, lr, decay=1.0, sign_update=None):
    """p <- p * decay - lr * g."""
    if params and decay != 1.0:
        torch._foreach_mul_(params, decay)
    if params:
        torch._foreach_add_(params, grads, alpha=-lr)


def none_(params, grads, *, lr, decay=1.0, sign_update=None):
    """No gradient step on the complement: it is frozen (BAdam) or dropped (GaLore); decoupled
    weight decay still applies to every weight."""
    if params and decay != 1.0:
        torch._foreach_mul_(params, decay)


@dataclass(frozen=True)
class StateFreeRule:
    foreach: Callable
    direction: Callable[[Tensor], Tensor] | None  # None: no update besides weight decay


STATE_FREE = {
    "signsgd": StateFreeRule(signsgd_, torch.sign),
    "sgd": StateFreeRule(sgd_, lambda g: g),
    "none": StateFreeRule(none_, None),
}
