r"""Fira's state-free rule: norm-based scaling of the residual and the norm-growth limiter.

Fira (Chen et al., "Fira: Can We Achieve Full-rank Training of LLMs Under Low-rank Constraint?",
arXiv:2410.01623, Section 4 and Algorithm 1) updates the residual :math:`G_{free} = G - \mathrm{lift}
(R)` of an SVD projection :math:`R = \mathrm{reduce}(G)` with the gradient itself, scaled per
index of the un-projected dimension by how much the state-full rule :math:`\psi` (AdamW) scaled the
projected gradient there:

.. math::
    \phi_j = \frac{\|\psi(R)_{\cdot j}\|}{\|R_{\cdot j}\|}, \qquad S = G_{free}\,\mathrm{diag}(\phi)
    \quad\text{(left projection; right projection: rows, } S = \mathrm{diag}(\phi) G_{free}\text{)}.

Then, instead of gradient clipping, the norm-growth limiter caps the growth of :math:`\|S\|`
between steps at :math:`\gamma` (1.01 in Fira's paper):

.. math::
    S_t \leftarrow S_t \cdot \frac{\gamma \|S_{t-1}\|}{\|S_t\|} \quad\text{if } \|S_t\| > \gamma \|S_{t-1}\|,

where :math:`\|S_{t-1}\|` is the norm *after* the previous limit (one scalar of state per matrix).
The step is :math:`\theta \leftarrow \theta - \eta (\mathrm{lift}(\psi(R)) + S)`.

What ``optimizer=fira`` runs is the ``fira`` package's step (``fira_step_``; the paper's Fira
numbers come from that code), which differs from the equations above in four places:

- the residual is ``G - alpha * lift(R)`` (``alpha`` = ``projectable_lr_scale``, 0.25 in Fira's scripts);
- :math:`\phi` and the limiter see the *uncorrected* Adam ratio ``m / (sqrt(v) + eps)``; Adam's
  step-size factor ``sqrt(1 - beta2^t) / (1 - beta1^t)`` multiplies the whole update afterwards;
- eps and weight decay where the state-full rule puts them (``adamw_hf``: eps on the uncorrected
  ``sqrt(v)``, decay after the update, as the package's AdamW).

The exact-residual reading (residual ``G - lift(R)``) is not kept (docs/concurrent_methods.md). The
scaling also works for ``column`` and ``row``, not for ``block`` (no projected part of the same
tensor). The norms are taken over the dimension the projection reduced (``reduced_dim``), one factor
per index of the other (``G Q`` of an ``m x n`` weight: ``reduced_dim=1``, one factor per row).
All functions here are tensor-only (no ``.item()``): the limiter decides with ``torch.where``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .checks import HyperparameterError
from .rules import SplitContext, StateFreeRule, StateFullRule, register_state_free, register_state_full

DEFAULT_GAMMA = 1.01  # Fira's paper, Section 4.3 (norm-growth limiter)
_NORM_EPS = 1e-8  # guards an all-zero slice of the projected gradient


def norm_scaling(psi: Tensor, g_red: Tensor, reduced_dim: int, eps: float = _NORM_EPS) -> Tensor:
    r"""Per-index factors :math:`\|\psi_{\cdot j}\| / (\|R_{\cdot j}\| + \epsilon)`, shaped to
    broadcast against the full-size residual (norms over ``reduced_dim``, kept as a size-1 dim)."""
    num = torch.linalg.vector_norm(psi, dim=reduced_dim, keepdim=True)
    den = torch.linalg.vector_norm(g_red, dim=reduced_dim, keepdim=True).add_(eps)
    return num.div_(den)


def scaled_residual(residual: Tensor, factors: Tensor) -> Tensor:
    """:math:`S`: the residual multiplied by the broadcast factors of :func:`norm_scaling`."""
    return residual * factors


def limit_norm_growth_(s: Tensor, prev_norm: Tensor, gamma: float = DEFAULT_GAMMA,
                       eps: float = _NORM_EPS) -> Tensor:
    r"""Apply the norm-growth limiter to ``s`` in place and update ``prev_norm`` (a 0-d tensor)
    to the norm after limiting. A negative ``prev_norm`` means "no previous step": nothing is
    limited, and the current norm is recorded. Returns ``s``.

    The ratio is :math:`\max(\|S_t\| / (\|S_{t-1}\| + \epsilon), \gamma) / \gamma`; dividing by it
    is the identity below the threshold and rescales to :math:`\gamma\|S_{t-1}\|` above it.
    """
    norm = torch.linalg.vector_norm(s)
    ratio = torch.clamp_min(norm / (prev_norm + eps), gamma) / gamma
    ratio = torch.where(prev_norm < 0, torch.ones_like(ratio), ratio)
    s.div_(ratio)
    prev_norm.copy_(norm / ratio)
    return s


def fira_residual_update(residual: Tensor, psi: Tensor, g_red: Tensor, reduced_dim: int,
                         prev_norm: Tensor | None, gamma: float | None = DEFAULT_GAMMA) -> Tensor:
    """:math:`S` for one matrix: norm-based scaling, then the limiter (skipped when ``gamma`` or
    ``prev_norm`` is None, i.e. when a run clips gradients instead)."""
    s = scaled_residual(residual, norm_scaling(psi, g_red, reduced_dim))
    if gamma is not None and prev_norm is not None:
        limit_norm_growth_(s, prev_norm, gamma)
    return s


def check_options(hparams: dict) -> dict:
    """``fira_gamma``: a number >= 1, or None (the limiter off, for runs that clip gradients)."""
    gamma = hparams.get("fira_gamma")
    if gamma is None:
        return hparams
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma < 1:
        raise HyperparameterError(f"Invalid fira_gamma: {gamma!r} (expected a number >= 1) or None (off)")
    return {**hparams, "fira_gamma": float(gamma)}


def new_limiter_state(like: Tensor) -> Tensor:
    """The limiter's state before the first step: a 0-d tensor holding -1 ("no previous norm")."""
    return torch.full((), -1.0, dtype=like.dtype, device=like.device)


def fira_step_(p: Tensor, state: dict, grad: Tensor, full_grad: Tensor, lift, rule, *, lr: float,
               alpha: float, free_scale: float, weight_decay: float, gamma: float | None, reduced_dim: int,
               transposed: bool, rule_kwargs: dict) -> None:
    r"""One Fira step of one split tensor ``p`` (in place), as the ``fira`` package takes it.

    ``grad`` is the gradient that was projected, ``full_grad`` its reduction R (in the orientation
    of ``p``'s transpose when ``transposed``), ``lift`` maps a reduced tensor to ``p``'s shape, and
    ``rule`` is the state-full rule whose moments live in ``state``. With ``d = rule.direction(R)``
    (AdamW: ``c * n``, ``n = m / (sqrt(v) + eps)``, ``c = sqrt(1 - beta2^t) / (1 - beta1^t)``)::

        S = limit((G - alpha lift(R)) * ||n|| / (||R|| + 1e-8))      # per index of the other side
        p <- p - lr * (alpha * lift(d) + free_scale * c * S)
        p <- p * (1 - lr * weight_decay)                            # after, for rules that decay after

    (decay before the update for rules that decay before, such as torch's AdamW).
    """
    d = rule.direction(full_grad, state, **rule_kwargs)
    c = _step_size(state, rule, rule_kwargs["betas"])
    n = d if c is None else d / c
    residual = grad - alpha * lift(full_grad)
    s = scaled_residual(residual.t() if transposed else residual, norm_scaling(n, full_grad, reduced_dim))
    if gamma is not None:
        limit_norm_growth_(s, state["fira_norm"], gamma)
    if c is not None:
        s.mul_(c)
    update = lift(d).mul_(alpha).add_(s.t() if transposed else s, alpha=free_scale)
    if weight_decay and not rule.decays_after:
        p.mul_(1.0 - lr * weight_decay)
    p.sub_(update.mul_(lr))
    if weight_decay and rule.decays_after:
        p.mul_(1.0 - lr * weight_decay)


def _step_size(state: dict, rule, betas):
    """Adam's step-size factor for rules with Adam's two moments (None for the others)."""
    if not (rule.counts_steps and "exp_avg_sq" in rule.state_names):
        return None
    return adam_step_size(state["step"], betas).to(state["exp_avg"].dtype)


# ---- the rules, registered: Hugging Face's AdamW (state-full) and Fira's step of a split tensor --------
def adam_step_size(step, betas):
    """``sqrt(1 - beta2^t) / (1 - beta1^t)``, Adam's two bias corrections as one step-size factor
    (a 0-d float64 tensor from the tensor count ``step``: no host sync)."""
    step = step.double()
    return (1.0 - betas[1] ** step).sqrt() / (1.0 - betas[0] ** step)


def _adamw_hf_math(g, m, v, step, beta1, beta2, eps):
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    return (m / (v.sqrt().add_(eps))).mul_(adam_step_size(step, (beta1, beta2)))


def adamw_hf_(targets, grads, states, steps, *, lr, betas, eps, weight_decay, momentum=0.0):
    """AdamW as Hugging Face's ``transformers.AdamW`` has it (and the ``fira`` package, which
    copies it): ``t -= lr * sqrt(bc2)/bc1 * m / (sqrt(v) + eps)``, eps added to the *uncorrected*
    ``sqrt(v)``; then ``t *= 1 - lr*wd``, the decay *after* the update. One tensor at a time."""
    if not targets:
        return
    exp_avgs, exp_avg_sqs = states
    torch._foreach_add_(steps, 1.0)
    for t, g, m, v, s in zip(targets, grads, exp_avgs, exp_avg_sqs, steps):
        t.sub_(_adamw_hf_math(g, m, v, s, betas[0], betas[1], eps).mul_(lr))
        if weight_decay:
            t.mul_(1.0 - lr * weight_decay)


def adamw_hf_direction(grad, state, *, betas, eps, momentum=0.0):
    state["step"] += 1
    return _adamw_hf_math(grad, state["exp_avg"], state["exp_avg_sq"], state["step"], *betas, eps)


def fira_split_step(p: Tensor, state: dict, ctx: SplitContext) -> None:
    """Fira's whole step of one split tensor, as the ``fira`` package computes it (``frugal.fira``)."""
    g = ctx.group
    fira_step_(p, state, ctx.grad, ctx.full_grad, ctx.lift, ctx.rule, lr=g["lr"],
               alpha=g["projectable_lr_scale"], free_scale=g["state_free_lr_scale"],
               weight_decay=g["weight_decay"], gamma=g["fira_gamma"], reduced_dim=ctx.reduced_dim,
               transposed=ctx.transposed, rule_kwargs={"betas": tuple(g["betas"]), "eps": g["eps"],
                                                       "momentum": g["momentum"]})


def _fira_state(state: dict, like: Tensor, reduced_dim: int) -> None:
    if "fira_norm" not in state:  # never reset: it measures the residual update, whatever the basis
        state["fira_norm"] = new_limiter_state(like)


register_state_full("adamw_hf", StateFullRule(adamw_hf_, adamw_hf_direction, ("exp_avg", "exp_avg_sq"), True,
                                              decays_after=True, elementwise=True, nonnegative=("exp_avg_sq",)))
# Fira's previous norm: one value per matrix
register_state_free("fira", StateFreeRule(init_state=_fira_state, split_step=fira_split_step,
                                          state_bytes=lambda other_side, elem: elem, options={"fira_gamma": 1.01},
                                          validate_options=check_options))
