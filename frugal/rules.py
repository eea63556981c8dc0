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

import os
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


_compiled_sign = None


def _compiled_sign_enabled() -> bool:
    return os.environ.get("FRUGAL_COMPILED_SIGN", "0").lower() in ("1", "true", "yes")


def _sign_update(p, g, lr):
    # In lr's dtype (the op-math type of p: float32 for 16-bit floats), as eager add_ does.
    p.copy_(p.to(lr.dtype) - torch.sign(g).to(lr.dtype) * lr)


def signsgd_(params, grads, *, lr):
    """p -= lr * sign(g) (sign(0) = 0).

    Default (eager): two passes, ``sign_`` of the gradient in place, then ``add_``. It overwrites
    the gradients with their sign: an allocation per step costs more than the update itself (page
    faults), and the gradients are consumed by the step. Eager torch has no single kernel for
    this update, and cache blocking (chunked ``sign(out=buf)`` + ``add_``) measured no faster on
    CPU: each pass is bounded by its own stream of reads from memory, not by the bytes it moves.

    Opt-in (environment variable ``FRUGAL_COMPILED_SIGN=1``): one fused pass compiled by
    ``torch.compile`` (dynamic shapes, so one kernel serves every tensor size; ``lr`` passed as
    a 0-d tensor so a learning-rate schedule does not recompile). Needs a C++ compiler on CPU
    and costs a compile on first use (seconds to tens of seconds; cached afterwards). The
    gradients are left untouched on this path. Results are bitwise identical to the eager path.
    """
    if not params:
        return
    if _compiled_sign_enabled():
        global _compiled_sign
        if _compiled_sign is None:
            _compiled_sign = torch.compile(_sign_update, dynamic=True, fullgraph=True)
        # The optimizer buckets tensors by device and dtype: one lr tensor serves the list.
        p0 = params[0]
        # Eager add_ rounds alpha to the tensor's dtype, then computes in the op-math type.
        lr_t = torch.tensor(lr, dtype=p0.dtype, device=p0.device).to(
            torch.promote_types(p0.dtype, torch.float32))
        for p, g in zip(params, grads):
            if (p.is_contiguous() and g.is_contiguous() and p.dtype == g.dtype == p0.dtype
                    and p.device == p0.device and p.is_floating_point()):
                _compiled_sign(p.view(-1), g.view(-1), lr_t)
            else:
                p.add_(torch.sign(g), alpha=-lr)
        return
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
