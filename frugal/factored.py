r"""Factored second moments (Adafactor) and the rules AdaMeM builds from them.

Adafactor (Shazeer & Stern, ICML 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost", Section 3 and Algorithm 4) keeps, for an ``m x n`` gradient :math:`G`, only the running means
of :math:`G^{\odot 2}` over rows and over columns,

.. math::
    r_t = \hat\beta_{2,t} r_{t-1} + (1 - \hat\beta_{2,t})\,\mathrm{mean}_j(G^{\odot 2})_{:,j}
    \in \mathbb{R}^m, \qquad
    c_t = \hat\beta_{2,t} c_{t-1} + (1 - \hat\beta_{2,t})\,\mathrm{mean}_i(G^{\odot 2})_{i,:}
    \in \mathbb{R}^n,

and reconstructs the second moment as :math:`\hat V_t = r_t c_t^\top / \mathrm{mean}(r_t)` (means
instead of the paper's sums give the same :math:`\hat V`): ``m + n`` floats replace ``m n``.

One-sided Adafactor keeps only one of the two vectors: :math:`\hat V_{ij} = s_i` with
:math:`s = \mathrm{EMA}(\mathrm{mean}_j G^{\odot 2}_{ij})` along the kept side. AdaMeM (Vyas,
Morwani & Kakade, "AdaMeM: Memory Efficient Momentum for Adafactor", WANT@ICML 2024) is, in the
FRUGAL paper's reading (Appendix "Comparison with Concurrent Methods", paragraph "Adamem"),
FRUGAL with an SVD subspace, Adafactor with momentum as the state-full rule (momentum of the
projected gradient, preconditioned by the factored second moment of the projected gradient) and
one-sided Adafactor as the rule of the residual:

.. math::
    u_{full} = \frac{\hat m_t}{\sqrt{\hat V_t} + \epsilon}, \qquad
    u_{free} = \frac{G_{free}}{\sqrt{\hat s_t} + \epsilon}.

Decision (ours): the one-sided statistic of the residual is kept along the side that is *not*
projected, so the residual stays orthogonal to the state-full subspace, :math:`D (G - G Q Q^\top) Q = 0`.
Decay: a constant :math:`\beta_2` with Adam's bias correction (``beta2_decay=None``, the FRUGAL
setup) or Adafactor's :math:`\hat\beta_{2,t} = 1 - t^{c}` (``c = beta2_decay``, -0.8 in its paper).
Every function updates its state in place and never reads the host (no ``.item()``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .rules import FreeContext, StateFreeRule, StateFullRule, register_state_free, register_state_full


def decay_weight(step, beta2: float, beta2_decay: float | None):
    r"""Weight of the new sample in the running mean at ``step`` (1-based; an int or a 0-d tensor,
    as the optimizer keeps it, so no value is read back to the host): :math:`1 - \beta_2` for a
    constant :math:`\beta_2`, or :math:`t^{c}` for Adafactor's schedule."""
    if beta2_decay is None:
        return 1.0 - beta2
    return step ** beta2_decay if torch.is_tensor(step) else float(step) ** beta2_decay


def second_moment_correction(step, beta2: float, beta2_decay: float | None):
    """Adam's bias correction ``1 - beta2**step`` of a running mean started at zero (1 for
    Adafactor's schedule, whose first weight is 1)."""
    return 1.0 if beta2_decay is not None else 1.0 - beta2 ** step


def update_factors_(row: Tensor, col: Tensor, grad: Tensor, weight: float) -> None:
    """Running means of ``grad**2`` over each row (into ``row``, shape (m,)) and each column
    (into ``col``, shape (n,)): ``x = (1 - weight) x + weight * mean(grad**2)``."""
    n_rows, n_cols = grad.shape
    weight = _as_weight(weight, row)
    # norm(.)**2 / count is the mean of squares without an m x n temporary.
    row.lerp_(torch.linalg.vector_norm(grad, dim=1).square_().div_(n_cols), weight)
    col.lerp_(torch.linalg.vector_norm(grad, dim=0).square_().div_(n_rows), weight)


def _as_weight(weight, like: Tensor):
    """lerp_ takes a tensor weight only in the tensor's own dtype."""
    return weight.to(like.dtype) if torch.is_tensor(weight) else weight


def factored_variance(row: Tensor, col: Tensor, correction: float = 1.0, eps1: float = 0.0) -> Tensor:
    r""":math:`\hat V = r c^\top / \mathrm{mean}(r)`, divided by ``correction`` and floored at
    ``eps1**2`` (Adafactor's :math:`\epsilon_1` acts on :math:`\sqrt{\hat V}`). A zero row
    factor (an all-zero gradient so far) gives a zero estimate, not NaN."""
    tiny = torch.finfo(row.dtype).tiny
    scale = row.mean().clamp_min(tiny) * correction
    v = torch.outer(row, col).div_(scale)
    return v.clamp_min_(eps1 * eps1) if eps1 else v


def update_one_sided_(stat: Tensor, grad: Tensor, weight: float, dim: int) -> None:
    """Running mean of ``grad**2`` averaged over ``dim`` (the statistic lives on the other side:
    ``dim=1`` gives one value per row)."""
    stat.lerp_(torch.linalg.vector_norm(grad, dim=dim).square_().div_(grad.shape[dim]), _as_weight(weight, stat))


def one_sided_variance(stat: Tensor, dim: int, correction: float = 1.0) -> Tensor:
    """The one-sided estimate as a tensor that broadcasts against the gradient."""
    v = stat / correction
    return v.unsqueeze(dim)


def rms_clip_(update: Tensor, threshold: float | None) -> Tensor:
    r"""Adafactor's update clipping :math:`U / \max(1, \mathrm{RMS}(U)/d)` (Section 6), done with
    tensor ops so no value is read back to the host. ``threshold=None`` leaves ``update`` as is."""
    if threshold is None:
        return update
    rms = torch.linalg.vector_norm(update) / update.numel() ** 0.5
    return update.div_(torch.clamp_min(rms / threshold, 1.0))


def adafactor_momentum_direction(grad: Tensor, exp_avg: Tensor, row: Tensor, col: Tensor, step, *,
                                 beta1: float, beta2: float, eps: float, beta2_decay: float | None = None,
                                 clip_threshold: float | None = None) -> Tensor:
    r"""AdaMeM's state-full rule on one (reduced) tensor: Adafactor with momentum, as a direction.
    :math:`m \leftarrow \beta_1 m + (1-\beta_1) g`; the factors :math:`r, c` take :math:`g^{\odot 2}`;
    returns ``clip((m / (1 - beta1**step)) / (sqrt(V_hat) + eps))`` (the step is ``-lr`` times it).
    ``step`` (int or 0-d tensor) counts from 1 since the state was (re)initialised. State: ``exp_avg``
    (shape of ``grad``), ``row``, ``col``."""
    exp_avg.lerp_(grad, 1.0 - beta1)
    update_factors_(row, col, grad, decay_weight(step, beta2, beta2_decay))
    v = factored_variance(row, col, second_moment_correction(step, beta2, beta2_decay))
    u = (exp_avg / (1.0 - beta1 ** step)).div_(v.sqrt_().add_(eps))
    return rms_clip_(u, clip_threshold)


def adafactor_momentum_(target: Tensor, grad: Tensor, exp_avg: Tensor, row: Tensor, col: Tensor,
                        step, *, lr: float, beta1: float, beta2: float, eps: float,
                        beta2_decay: float | None = None, clip_threshold: float | None = None) -> None:
    """``target -= lr * adafactor_momentum_direction(...)`` (see there)."""
    target.sub_(adafactor_momentum_direction(grad, exp_avg, row, col, step, beta1=beta1, beta2=beta2,
                                             eps=eps, beta2_decay=beta2_decay, clip_threshold=clip_threshold),
                alpha=lr)


def one_sided_direction(residual: Tensor, stat: Tensor, step, *, beta2: float, eps: float, dim: int,
                        beta2_decay: float | None = None, clip_threshold: float | None = None) -> Tensor:
    r"""AdaMeM's residual rule on one tensor, as a direction: ``residual / (sqrt(s_hat) + eps)``
    with the one-sided statistic ``stat`` averaged over ``dim`` (so it has one value per index of
    the other dimension). Not state-free in FRUGAL's strict sense: it owns ``stat`` (one vector per
    matrix, e.g. ``m`` floats for an ``m x n`` weight), which the memory count includes."""
    update_one_sided_(stat, residual, decay_weight(step, beta2, beta2_decay), dim)
    v = one_sided_variance(stat, dim, second_moment_correction(step, beta2, beta2_decay))
    return rms_clip_(residual / v.sqrt().add_(eps), clip_threshold)


def one_sided_adafactor_(param: Tensor, residual: Tensor, stat: Tensor, step, *, lr: float,
                         beta2: float, eps: float, dim: int, beta2_decay: float | None = None,
                         clip_threshold: float | None = None) -> None:
    """``param -= lr * one_sided_direction(...)`` (see there)."""
    param.sub_(one_sided_direction(residual, stat, step, beta2=beta2, eps=eps, dim=dim,
                                   beta2_decay=beta2_decay, clip_threshold=clip_threshold), alpha=lr)


def adafactor_(param: Tensor, grad: Tensor, row: Tensor, col: Tensor, step: int, *, lr: float,
               beta2_decay: float = -0.8, eps1: float = 1e-30, clip_threshold: float | None = 1.0) -> None:
    r"""Plain Adafactor without momentum on a matrix, with a given step size ``lr`` (no relative
    step, no parameter scaling): :math:`U = G / \sqrt{\max(\hat V, \epsilon_1^2)}`, clipped, then
    ``param -= lr * U``. The building block checked against ``torch.optim.Adafactor``."""
    update_factors_(row, col, grad, decay_weight(step, 0.0, beta2_decay))
    u = grad * factored_variance(row, col, 1.0, eps1).rsqrt_()
    param.sub_(rms_clip_(u, clip_threshold), alpha=lr)


# ---- the rules, registered: AdaMeM's state-full rule and its residual rule -------------------------------
def _momentum_foreach(targets, grads, states, steps, *, lr, betas, eps, weight_decay, momentum=0.0):
    """AdaMeM's state-full rule (``adafactor_momentum_direction``): t *= 1 - lr*wd;
    t -= lr * (m_hat / (sqrt(V_hat) + eps)), V_hat the factored second moment of the (reduced)
    gradient, with Adam's bias corrections counted per tensor. One tensor at a time."""
    if not targets:
        return
    exp_avgs, rows, cols = states
    torch._foreach_add_(steps, 1.0)
    for t, g, m, r, c, step in zip(targets, grads, exp_avgs, rows, cols, steps):
        if weight_decay:
            t.mul_(1.0 - lr * weight_decay)
        t.sub_(_adafactor_math(g, m, r, c, step, betas, eps), alpha=lr)


def _adafactor_math(g, m, row, col, step, betas, eps):
    # bias corrections in float64 from the float32 counter, as the AdamW rule computes them
    return adafactor_momentum_direction(g, m, row, col, step.double(), beta1=betas[0], beta2=betas[1], eps=eps)


def _momentum_direction(grad, state, *, betas, eps, momentum=0.0):
    state["step"] += 1
    return _adafactor_math(grad, state["exp_avg"], state["row"], state["col"], state["step"], betas, eps)


def _factored_shapes(shape) -> dict:
    if len(shape) != 2:
        raise ValueError(f"state_full 'adafactor_momentum' factors a matrix; got a tensor of shape {tuple(shape)}")
    return {"exp_avg": tuple(shape), "row": (shape[0],), "col": (shape[1],)}


def _one_sided_rule(residual: Tensor, state: dict, ctx: FreeContext) -> Tensor:
    """AdaMeM's residual rule: ``residual / (sqrt(s_hat) + eps)``, ``s`` the running mean of the
    residual's squares over the reduced dimension (one value per index of the other one, so the
    update stays orthogonal to the state-full subspace), Adam's correction counted since the start."""
    state["free_step"] += 1
    beta2 = ctx.group["betas"][1]
    return one_sided_direction(residual, state["free_stat"], state["free_step"].double(),
                               beta2=beta2, eps=ctx.group["eps"], dim=ctx.reduced_dim)


def _one_sided_state(state: dict, like: Tensor, reduced_dim: int) -> None:
    if "free_stat" not in state:  # never reset, like Fira's norm; an integer counter: exact on reload
        state["free_stat"] = torch.zeros(like.shape[1 - reduced_dim], dtype=like.dtype, device=like.device)
        state["free_step"] = torch.zeros((), dtype=torch.int64, device=like.device)


register_state_full("adafactor_momentum", StateFullRule(_momentum_foreach, _momentum_direction,
                                                        ("exp_avg", "row", "col"), True, _factored_shapes, True))
# its one-sided statistic (a value per index of the side not reduced) and its int64 counter
register_state_free("one_sided_adafactor", StateFreeRule(contextual=_one_sided_rule, init_state=_one_sided_state,
                                                         state_bytes=lambda other_side, elem: other_side * elem + 8))
