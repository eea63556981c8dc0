"""Update rules as small functions over parallel tensor lists.

State-full rules (``adamw``, ``lion``, ``sgdm``) update ``targets`` in place from ``grads`` and
their state. A target is the parameter itself (block projection, non-projectable tensors) or a
reduced tensor the optimizer scatters or projects back afterwards, so one rule serves every
projection. Decoupled weight decay ``t *= 1 - lr * weight_decay`` happens inside the rule only
when the target is the parameter; the optimizer passes ``weight_decay=0`` for reduced targets
and decays the full parameter itself.

State-free rules (``signsgd``, ``sgd``, ``none``) own no state by construction: signSGD is the
state-free rule of choice because its update has Adam's magnitude (Section 4 of the paper).

The AdamW rule runs torch's fused multi-tensor kernel where it exists (about 5x faster than the
foreach path on CPU, at memory speed): the optimizer step is memory-bound, so the number of
passes over memory is what counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _can_fuse(tensors: list[Tensor]) -> bool:
    t = tensors[0]
    return hasattr(torch, "_fused_adamw_") and t.device.type in _FUSED_DEVICES and t.dtype in _FUSED_DTYPES


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
    # Fallback for devices/dtypes without the fused kernel: same math with foreach ops.
    if weight_decay:
        torch._foreach_mul_(targets, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    for t, m, v, s in zip(targets, exp_avgs, exp_avg_sqs, steps):
        step = float(s)
        bc1 = 1.0 - beta1 ** step
        bc2_sqrt = (1.0 - beta2 ** step) ** 0.5
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        t.addcdiv_(m, denom, value=-lr / bc1)


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


def signsgd_(params, grads, *, lr):
    """p -= lr * sign(g). Overwrites the gradients with their sign: an allocation per step costs
    more than the update itself (page faults), and the gradients are consumed by the step."""
    if params:
        torch._foreach_sign_(grads)
        torch._foreach_add_(params, grads, alpha=-lr)


def sgd_(params, grads, *, lr):
    """p -= lr * g."""
    if params:
        torch._foreach_add_(params, grads, alpha=-lr)


def none_(params, grads, *, lr):
    """No state-free update: the complement is frozen (BAdam) or dropped (GaLore)."""


@dataclass(frozen=True)
class StateFullRule:
    fn: Callable
    state_names: tuple[str, ...]
    counts_steps: bool


STATE_FULL = {
    "adamw": StateFullRule(adamw_, ("exp_avg", "exp_avg_sq"), True),
    "lion": StateFullRule(lion_, ("exp_avg",), False),
    "sgdm": StateFullRule(sgdm_, ("momentum_buffer",), False),
}
STATE_FREE = {"signsgd": signsgd_, "sgd": sgd_, "none": none_}
