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

The same scaling works for FRUGAL's coordinate projections ``column`` and ``row`` (the reduced
gradient is a set of columns or rows, and the scaling runs along the other dimension), but not for
``block``: a tensor there is wholly state-full or wholly state-free, so there is no projected part of
the same tensor to take norms from (the FRUGAL paper, Appendix "Comparison with Concurrent
Methods").

Which dimension: the norms are taken over the dimension the projection reduced (``reduced_dim``),
giving one factor per index of the other one. For an ``m x n`` weight with ``Q`` on the columns
(``G Q``, ``m x r``, GaLore's choice for ``m >= n``) ``reduced_dim=1``: one factor per row.
All functions here are tensor-only (no ``.item()``): the limiter decides with ``torch.where``.
"""
from __future__ import annotations

import torch
from torch import Tensor

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


def new_limiter_state(like: Tensor) -> Tensor:
    """The limiter's state before the first step: a 0-d tensor holding -1 ("no previous norm")."""
    return torch.full((), -1.0, dtype=like.dtype, device=like.device)
