r"""Subspace tracking for LDAdam: block power iteration, projection-aware moments, error feedback.

LDAdam (Robert, Safaryan, Modoranu & Alistarh, "LDAdam: Adaptive Optimization from
Low-Dimensional Gradient Statistics", ICLR 2025, arXiv:2410.16103, Algorithm 1 and Section 3)
refreshes the rank-``r`` basis of every matrix at *every* step and keeps Adam's moments in it.
Notation of this library (:mod:`frugal.projections`): the basis :math:`Q` (``s x r``, orthonormal
columns) acts on the smaller side ``s`` of the ``m x n`` weight: ``side="right"`` (``m >= n``)
reduces :math:`G` to :math:`G Q` (``m x r``), ``side="left"`` to :math:`Q^\top G` (``r x n``).
With :math:`a_t` the gradient plus the error buffer, one step is

.. math::
    a_t &= g_t + e_t \\
    b_t &= \rho\, Q_{t-1}\text{-lift of } \hat m_{t-1} + (1-\rho)\, a_t
        &&\text{(what the new subspace should capture)}\\
    Q_t &= \mathrm{orth}(b_t^\top b_t\, Q_{t-1}) \text{ (right) or } \mathrm{orth}(b_t b_t^\top Q_{t-1})
        \text{ (left)} &&\text{(one block power iteration, warm start)}\\
    R_t &= Q_{t-1}^\top Q_t \text{ (right) or } Q_t^\top Q_{t-1} \text{ (left)}
        &&\text{(change of basis)}\\
    \tilde m_{t-1} &= m_{t-1} R_t, \quad
    \tilde v_{t-1} = (1-\beta_2^{t-1}) \big| (\hat v_{t-1} - \hat m_{t-1}^{2}) (R_t \odot R_t)
        + (\hat m_{t-1} R_t)^{2} \big| &&\text{(projection-aware update; left: } R_t \cdot\text{)}\\
    \tilde g_t &= \text{reduce}(a_t), \quad m_t = \beta_1 \tilde m_{t-1} + (1-\beta_1) \tilde g_t,
        \quad v_t = \beta_2 \tilde v_{t-1} + (1-\beta_2) \tilde g_t^{2}\\
    \theta_{t+1} &= (1 - \eta\lambda)\theta_t - \eta\, \text{lift}_{Q_t}\big(\hat m_t / (\sqrt{\hat v_t}
        + \epsilon)\big)\\
    e_{t+1} &= a_t - \text{lift}_{Q_t}(\tilde g_t) + \tfrac{\beta_1}{1-\beta_1}
        \big(\text{lift}_{Q_{t-1}}(m_{t-1}) - \text{lift}_{Q_t}(\tilde m_{t-1})\big)
        &&\text{(generalized error feedback)}

with hats the bias-corrected moments; :math:`v` moves as :math:`\mathrm{Var} + \mathrm{mean}^2`
(variance through :math:`R \odot R`, the absolute value keeps it non-negative). The first basis is
the top-``r`` singular subspace of :math:`a_1`. Defaults: :math:`\beta_1 = \rho = 0.908`,
:math:`\beta_2 = 0.99`, :math:`\epsilon = 10^{-8}`. :func:`reproject_momentum` (``preserve_norm=True``)
is Appendix C's first-moment re-projection (Flora's Algorithm 2 plus a norm rescale; Figure 3's toy).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .projections import canonical_signs  # noqa: F401  (re-exported: the sign convention of every SVD basis)


def reduce(x: Tensor, q: Tensor, side: str) -> Tensor:
    """The coordinates of ``x`` in the basis ``q``: ``x @ q`` (right) or ``q.T @ x`` (left)."""
    return x @ q if side == "right" else q.t() @ x


def lift(x: Tensor, q: Tensor, side: str) -> Tensor:
    """The full-shape tensor whose coordinates in ``q`` are ``x``: ``x @ q.T`` or ``q @ x``."""
    return x @ q.t() if side == "right" else q @ x


def top_singular_basis(b: Tensor, rank: int, side: str, fix_signs: bool = True) -> Tensor:
    """Top-``rank`` right (``side="right"``) or left singular vectors of ``b`` as columns; the SVD
    runs in at least float32 (bf16 has none) and the result has ``b``'s dtype. ``fix_signs``:
    see :func:`canonical_signs` (off only to mimic a reference that uses the raw SVD)."""
    work = b.to(torch.promote_types(b.dtype, torch.float32))
    u, _, vh = torch.linalg.svd(work, full_matrices=False)
    q = vh[:rank].t() if side == "right" else u[:, :rank]
    if fix_signs:
        q = canonical_signs(q)
    return q.contiguous().to(b.dtype)


def orthonormalize(y: Tensor) -> Tensor:
    """Orthonormal basis of the columns of ``y`` (reduced QR, in at least float32)."""
    work = y.to(torch.promote_types(y.dtype, torch.float32))
    return torch.linalg.qr(work).Q.to(y.dtype)


def block_power_iteration(b: Tensor, q_prev: Tensor, side: str, iterations: int = 1) -> Tensor:
    r"""Warm-started block power iteration towards the top singular subspace of ``b`` on ``side``:
    :math:`Q \leftarrow \mathrm{orth}(b^\top b\, Q)` (right) or :math:`\mathrm{orth}(b b^\top Q)`
    (left), ``iterations`` times from ``q_prev``. One iteration per step is LDAdam's choice: the
    subspace moves slowly between steps, so the previous basis is already a good start."""
    q = q_prev
    for _ in range(iterations):
        q = orthonormalize(b.t() @ (b @ q)) if side == "right" else orthonormalize(b @ (b.t() @ q))
    return q


def change_of_basis(q_old: Tensor, q_new: Tensor, side: str) -> Tensor:
    """``R`` with ``reduce(lift(x, q_old), q_new) == x @ R`` (right) or ``R @ x`` (left)."""
    return q_old.t() @ q_new if side == "right" else q_new.t() @ q_old


def _apply(r: Tensor, x: Tensor, side: str) -> Tensor:
    return x @ r if side == "right" else r @ x


def reproject_momentum(m: Tensor, r: Tensor, side: str, preserve_norm: bool = False) -> Tensor:
    """A first moment moved into the new basis (Flora, Hao et al. 2024, Algorithm 2). With
    ``preserve_norm`` it is rescaled to its old norm (the FRUGAL paper's Appendix C: the part of the
    momentum outside the new subspace is lost, the rescale keeps the momentum's mass)."""
    new = _apply(r, m, side)
    if preserve_norm:
        new.mul_(torch.linalg.vector_norm(m) / torch.linalg.vector_norm(new).clamp_min(
            torch.finfo(new.dtype).tiny))
    return new


def reproject_moments(m: Tensor, v: Tensor, r: Tensor, side: str, *, beta1: float, beta2: float,
                      step) -> tuple[Tensor, Tensor]:
    r"""LDAdam's projection-aware transport of Adam's moments after ``step`` updates (:math:`t-1` in the
    module docstring; the int 0 returns zeros, a 0-d tensor must be >= 1): :math:`(\tilde m, \tilde v)`
    in the new basis, without bias correction."""
    if isinstance(step, int) and step == 0:
        return torch.zeros_like(m), torch.zeros_like(v)
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    m_new = _apply(r, m, side)
    variance = v / bc2 - (m / bc1).square()
    v_new = _apply(r * r, variance, side).add_((m_new / bc1).square()).abs_().mul_(bc2)
    return m_new, v_new


def subspace_target(a: Tensor, m: Tensor, q_prev: Tensor, side: str, *, rho: float, beta1: float,
                    step) -> Tensor:
    r""":math:`b_t = \rho\,\mathrm{lift}(\hat m_{t-1}) + (1-\rho) a_t`: the matrix whose top
    subspace the new basis tracks (``step`` = updates made so far, an int or a 0-d tensor >= 1;
    at the int 0, or with ``rho`` 0, it is ``a``)."""
    if (isinstance(step, int) and step == 0) or rho == 0:
        return a
    return lift(m, q_prev, side).mul_(rho / (1.0 - beta1 ** step)).add_(a, alpha=1.0 - rho)


def error_feedback(a: Tensor, g_red: Tensor, m_old: Tensor, m_moved: Tensor, q_old: Tensor,
                   q_new: Tensor, side: str, beta1: float) -> Tensor:
    r"""LDAdam's generalized error feedback :math:`e_{t+1}`: what the rank-``r`` step left out of
    :math:`a_t`, plus what moving the momentum between bases lost, weighted by
    :math:`\beta_1/(1-\beta_1)` (the momentum's total weight in future updates)."""
    e = a - lift(g_red, q_new, side)
    if beta1:
        lost = lift(m_old, q_old, side).sub_(lift(m_moved, q_new, side))
        e.add_(lost, alpha=beta1 / (1.0 - beta1))
    return e


def adam_direction(m: Tensor, v: Tensor, step: int, *, beta1: float, beta2: float, eps: float) -> Tensor:
    """Adam's bias-corrected direction ``m_hat / (sqrt(v_hat) + eps)`` after ``step`` updates."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return (m / bc1).div_((v / bc2).sqrt_().add_(eps))
