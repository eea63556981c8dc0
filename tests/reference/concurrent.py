r"""Fira, LDAdam and AdaMeM on one matrix, composed from the pure functions of the frugal package.

A test reference, not library code (no training run reaches it): the tests run these one-matrix
compositions against the float64 references beside this file and the original packages, and the
phased FRUGAL step against them.

Each ``*_step_`` function advances one ``m x n`` weight by one optimizer step, given its gradient
and a dict of state tensors (created on the first call). They are the executable specification
of how each method maps onto FRUGAL's split (state-full part in a subspace, state-free rule on the
residual) and what state it holds; the phased :class:`frugal.FRUGAL` step runs the same pieces
on buckets of tensors. Conventions shared with FRUGAL's AdamW rule: torch's AdamW (``eps`` added to
the bias-corrected :math:`\sqrt{\hat v}`), decoupled weight decay applied before the update,
``step`` is the 0-based index of the step being taken, subspaces on GaLore's smaller side.

State held per matrix (``m x n``, ``s = min(m, n)``, ``L = max(m, n)``, rank ``r``):

=========  ===========================================================================
Fira       ``proj`` (s x r), ``exp_avg``, ``exp_avg_sq`` (L x r each), ``limiter`` (scalar)
LDAdam     ``proj`` (s x r), ``exp_avg``, ``exp_avg_sq`` (L x r each), ``error`` (m x n)
AdaMeM     ``proj`` (s x r), ``exp_avg`` (L x r), ``row`` (L), ``col`` (r), ``free_stat`` (L)
=========  ===========================================================================

plus an integer ``count`` (steps since the state-full state was (re)initialised) each.
"""
from __future__ import annotations

import torch
from torch import Tensor

from frugal import fira as _fira
from frugal import projections as _proj
from frugal import subspace as sub
from frugal.factored import adafactor_momentum_, one_sided_adafactor_

STATE_MODES = ("reset", "keep")


def side_of(shape) -> str:
    """GaLore's rule: the basis acts on the smaller side (``right`` = columns when m >= n)."""
    return "right" if shape[0] >= shape[1] else "left"


def reduced_dim(side: str) -> int:
    """The dimension of the reduced tensor that the basis spans (1 for ``G Q``, 0 for ``Q^T G``)."""
    return 1 if side == "right" else 0


def _check_mode(mode: str) -> None:
    if mode not in STATE_MODES:
        raise ValueError(f"Invalid reset_state: {mode!r}; valid choices: {', '.join(STATE_MODES)}")


def _check_rank(rank: int, shape) -> None:
    if not 1 <= rank <= min(shape):
        raise ValueError(f"Invalid rank: {rank!r} for a weight of shape {tuple(shape)} "
                         f"(must be in [1, {min(shape)}])")


def _adamw_(m: Tensor, v: Tensor, g: Tensor, count: int, beta1: float, beta2: float, eps: float) -> Tensor:
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    return sub.adam_direction(m, v, count, beta1=beta1, beta2=beta2, eps=eps)


def fira_basis(grad: Tensor, rank: int, projection: str, window: int, seed: int) -> tuple[Tensor, str]:
    """(basis, side) of Fira's state-full subspace: the top-``rank`` SVD basis on GaLore's side, or
    ``rank`` columns drawn from the seeded generator of :mod:`frugal.projections` (FRUGAL's column
    projection, written as a coordinate basis ``I[:, idx]`` so the same algebra serves both)."""
    if projection == "svd":
        side = side_of(grad.shape)
        return sub.top_singular_basis(grad, rank, side), side
    if projection == "column":
        n = grad.shape[1]
        idx = _proj.coordinate_indices("column", grad.shape, False, rank / n, seed, window, 0)
        eye = torch.eye(n, dtype=grad.dtype, device=grad.device)
        return eye[:, idx.to(grad.device)].contiguous(), "right"
    raise ValueError(f"Invalid projection for Fira: {projection!r}; valid choices: svd, column "
                     "(block projection has no projected part in the same tensor to scale by)")


def fira_step_(param: Tensor, grad: Tensor, state: dict, step: int, *, lr: float, rank: int,
               update_gap: int = 200, betas=(0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.0, scale: float = 1.0, gamma: float | None = 1.01,
               reset_state: str = "keep", projection: str = "svd", seed: int = 0) -> None:
    r"""Fira: SVD subspace every ``update_gap`` steps, AdamW on :math:`R = \mathrm{reduce}(G)`,
    the residual updated with norm-based scaling and the norm-growth limiter (:mod:`frugal.fira`):

    .. math:: \theta \leftarrow (1-\eta\lambda)\theta - \eta\,(\kappa\,\mathrm{lift}(\psi(R)) + S)

    with :math:`\kappa` = ``scale`` (GaLore's/Fira's :math:`\alpha`; it scales the state-full part
    only, so the residual is exactly :math:`G - \mathrm{lift}(R)`). ``reset_state="keep"`` is
    Fira's own (GaLore-like) behaviour on a projection change; ``"reset"`` is FRUGAL's.
    ``gamma=None`` turns the limiter off (for runs that clip gradients instead).
    ``projection="column"``: ``rank`` random columns (new ones every ``update_gap`` steps) instead
    of the SVD subspace; the scaling then runs per row over the selected columns.
    """
    _check_mode(reset_state)
    _check_rank(rank, param.shape)
    beta1, beta2 = betas
    if step % update_gap == 0 or "proj" not in state:
        state["proj"], side = fira_basis(grad, rank, projection, step // update_gap, seed)
        if reset_state == "reset" or "exp_avg" not in state:
            shape = sub.reduce(grad, state["proj"], side).shape
            state["exp_avg"] = grad.new_zeros(shape)
            state["exp_avg_sq"] = grad.new_zeros(shape)
            state["count"] = 0
    if "limiter" not in state:
        state["limiter"] = _fira.new_limiter_state(grad)
    q, side = state["proj"], ("right" if projection == "column" else side_of(grad.shape))
    g_red = sub.reduce(grad, q, side)
    state["count"] += 1
    psi = _adamw_(state["exp_avg"], state["exp_avg_sq"], g_red, state["count"], beta1, beta2, eps)
    residual = grad - sub.lift(g_red, q, side)
    s = _fira.fira_residual_update(residual, psi, g_red, reduced_dim(side), state["limiter"], gamma)
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    param.sub_(sub.lift(psi, q, side).mul_(scale).add_(s), alpha=lr)


def ldadam_step_(param: Tensor, grad: Tensor, state: dict, step: int, *, lr: float, rank: int,
                 betas=(0.908, 0.99), rho: float = 0.908, eps: float = 1e-8,
                 weight_decay: float = 0.0, error_feedback: bool = True) -> None:
    r"""LDAdam (:mod:`frugal.subspace`): a basis refreshed every step by one warm-started block power
    iteration, Adam's moments transported into it, and the generalized error-feedback buffer
    ``error`` added to the next gradient. The step itself is rank ``r``; in FRUGAL's terms the
    state-free rule is ``none`` and the residual goes into ``error`` instead. Defaults are
    LDAdam's published ones (:math:`\beta_1 = \rho = 0.908`, :math:`\beta_2 = 0.99`). ``step``
    is not used (the basis changes at every step); it keeps the signature of the other methods."""
    _check_rank(rank, param.shape)
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"Invalid rho (subspace momentum): {rho!r} (must be in [0, 1))")
    side = side_of(param.shape)
    beta1, beta2 = betas
    a = grad + state["error"] if "error" in state else grad.clone()
    q_old = state.get("proj")
    count = state.get("count", 0)
    if q_old is None:
        # First step: nothing to warm-start from, so the basis is the top singular subspace.
        q = sub.top_singular_basis(a, rank, side)
        m_moved = a.new_zeros(sub.reduce(a, q, side).shape)
        v_moved = torch.zeros_like(m_moved)
    else:
        m_old, v_old = state["exp_avg"], state["exp_avg_sq"]
        b = sub.subspace_target(a, m_old, q_old, side, rho=rho, beta1=beta1, step=count)
        q = sub.block_power_iteration(b, q_old, side)
        r = sub.change_of_basis(q_old, q, side)
        m_moved, v_moved = sub.reproject_moments(m_old, v_old, r, side, beta1=beta1, beta2=beta2,
                                                 step=count)
    g_red = sub.reduce(a, q, side)
    if error_feedback:
        if q_old is None:
            state["error"] = a - sub.lift(g_red, q, side)
        else:
            state["error"] = sub.error_feedback(a, g_red, m_old, m_moved, q_old, q, side, beta1)
    count += 1
    direction = _adamw_(m_moved, v_moved, g_red, count, beta1, beta2, eps)
    state.update(proj=q, exp_avg=m_moved, exp_avg_sq=v_moved, count=count)
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    param.sub_(sub.lift(direction, q, side), alpha=lr)


def adamem_step_(param: Tensor, grad: Tensor, state: dict, step: int, *, lr: float, rank: int,
                 update_gap: int = 200, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, scale: float = 1.0, free_lr_scale: float = 1.0,
                 beta2_decay: float | None = None, clip_threshold: float | None = None,
                 reset_state: str = "reset") -> None:
    r"""AdaMeM as FRUGAL reads it: SVD subspace every ``update_gap`` steps; Adafactor with
    momentum (:func:`frugal.factored.adafactor_momentum_`) on :math:`R = \mathrm{reduce}(G)`; one-sided
    Adafactor (:func:`frugal.factored.one_sided_adafactor_`) on :math:`G - \mathrm{lift}(R)`, its
    statistic along the un-projected side (one value per row of ``G Q``), never reset.

    .. math:: \theta \leftarrow (1-\eta\lambda)\theta - \eta\kappa\,\mathrm{lift}(u_{full})
              - \eta\gamma\,u_{free}

    with :math:`\kappa` = ``scale``, :math:`\gamma` = ``free_lr_scale``. ``reset_state`` applies to
    the state-full part on a projection change (FRUGAL's ``reset`` by default).
    """
    _check_mode(reset_state)
    _check_rank(rank, param.shape)
    side = side_of(param.shape)
    beta1, beta2 = betas
    dim = reduced_dim(side)
    if step % update_gap == 0 or "proj" not in state:
        state["proj"] = sub.top_singular_basis(grad, rank, side)
        if reset_state == "reset" or "exp_avg" not in state:
            shape = sub.reduce(grad, state["proj"], side).shape
            state["exp_avg"] = grad.new_zeros(shape)
            state["row"] = grad.new_zeros(shape[0])
            state["col"] = grad.new_zeros(shape[1])
            state["count"] = 0
    if "free_stat" not in state:
        state["free_stat"] = grad.new_zeros(param.shape[1 - dim])
        state["free_count"] = 0
    q = state["proj"]
    g_red = sub.reduce(grad, q, side)
    residual = grad - sub.lift(g_red, q, side)
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    state["count"] += 1
    delta = torch.zeros_like(g_red)
    adafactor_momentum_(delta, g_red, state["exp_avg"], state["row"], state["col"], state["count"],
                        lr=lr * scale, beta1=beta1, beta2=beta2, eps=eps, beta2_decay=beta2_decay,
                        clip_threshold=clip_threshold)
    param.add_(sub.lift(delta, q, side))
    state["free_count"] += 1
    one_sided_adafactor_(param, residual, state["free_stat"], state["free_count"],
                         lr=lr * free_lr_scale, beta2=beta2, eps=eps, dim=dim,
                         beta2_decay=beta2_decay, clip_threshold=clip_threshold)


def state_floats(method: str, shape, rank: int) -> int:
    """Floats of optimizer state one matrix holds under ``method`` (the table in the module
    docstring), for memory estimates. LDAdam's ``error`` buffer is counted: keeping it in the
    gradient buffer instead, as LDAdam's own code does, needs a loop that never zeroes gradients."""
    m, n = shape
    s, big = min(m, n), max(m, n)
    if method == "fira":
        return s * rank + 2 * big * rank + 1
    if method == "ldadam":
        return s * rank + 2 * big * rank + m * n
    if method == "adamem":
        return s * rank + big * rank + big + rank + big
    raise ValueError(f"Unknown method {method!r}; valid choices: fira, ldadam, adamem")
