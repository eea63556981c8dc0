r"""Fira in float64, from Chen et al. (arXiv:2410.01623), Section 4 and Algorithm 1.

Written for a basis P (m x r) on the rows of an m x n weight (m < n); a tall weight runs as its
transpose. Every T steps P = top-r left singular vectors of the current gradient; the Adam state is
kept across the change (Fira follows GaLore) or reset. Per step:

    R   = P.T @ G                         (r x n)
    psi = Adam direction of R (bias-corrected, eps outside the square root)
    phi_j = ||psi[:, j]|| / (||R[:, j]|| + 1e-8)          (one factor per column)
    S   = (G - P @ R) * phi[None, :]
    if a previous norm s_prev exists and ||S|| > gamma * (s_prev + 1e-8): S *= gamma*(s_prev+1e-8)/||S||
    s_prev = ||S||
    W   = (1 - lr*wd) * W - lr * (scale * P @ psi + S)

``package=True``: the step of the authors' ``fira`` package (1.0.2) instead, written from its
source: n = m / (sqrt(v) + eps) (eps on the uncorrected root), c = sqrt(1 - beta2^t) / (1 - beta1^t),
phi from n, S = (G - scale * P @ R) * phi (the scale also on the residual), the limiter on that S,
then W = (W - lr * c * (scale * P @ n + S)) * (1 - lr*wd) (decay after the update).
"""
from __future__ import annotations

import numpy as np

from .common import as_left, top_left_singular


def run(w0, grad_fn, steps, *, lr, rank, update_gap, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, scale=1.0, gamma=1.01, keep_state=True, columns_fn=None, package=False):
    """``columns_fn(window)``: the column indices of a column projection (FRUGAL's), instead of the
    SVD basis; the basis is then the coordinate matrix of those columns of the (transposed) weight."""
    left = as_left(w0.shape) and columns_fn is None
    w = np.array(w0 if left else w0.T, dtype=np.float64)
    gfun = (lambda x, t: grad_fn(x, t)) if left else (lambda x, t: grad_fn(x.T, t).T)
    out, s_prev, p, m, v, count = [], None, None, None, None, 0
    for t in range(steps):
        g = gfun(w, t)
        if t % update_gap == 0:
            if columns_fn is None:
                p = top_left_singular(g, rank)
            else:
                p = np.eye(w.shape[0])[:, list(columns_fn(t // update_gap))]
            if m is None or not keep_state:
                m, v, count = np.zeros((rank, w.shape[1])), np.zeros((rank, w.shape[1])), 0
        r = p.T @ g
        count += 1
        m = beta1 * m + (1 - beta1) * r
        v = beta2 * v + (1 - beta2) * r * r
        if package:
            c = np.sqrt(1 - beta2 ** count) / (1 - beta1 ** count)
            psi = m / (np.sqrt(v) + eps)
            residual = g - scale * (p @ r)
        else:
            c = 1.0
            psi = (m / (1 - beta1 ** count)) / (np.sqrt(v / (1 - beta2 ** count)) + eps)
            residual = g - p @ r
        phi = np.sqrt((psi ** 2).sum(axis=0)) / (np.sqrt((r ** 2).sum(axis=0)) + 1e-8)
        s = residual * phi[None, :]
        norm = np.sqrt((s ** 2).sum())
        if gamma is not None and s_prev is not None and norm > gamma * (s_prev + 1e-8):
            s = s * (gamma * (s_prev + 1e-8) / norm)
            norm = gamma * (s_prev + 1e-8)
        s_prev = norm
        if package:
            w = (w - lr * c * (scale * p @ psi + s)) * (1 - lr * weight_decay)
        else:
            w = (1 - lr * weight_decay) * w - lr * (scale * p @ psi + s)
        out.append(w.copy() if left else w.T.copy())
    return out
