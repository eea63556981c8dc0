r"""LDAdam in float64, from Robert et al. (ICLR 2025, arXiv:2410.16103), Algorithm 1.

Written for a basis P (m x r) on the rows of an m x n weight (m < n); a tall weight runs as its
transpose. Per step t = 1, 2, ...:

    a     = g_t + xi                                  (gradient plus error feedback)
    b     = rho * P_old @ (m / (1 - beta1^(t-1))) + (1 - rho) * a     (t > 1; b = a at t = 1)
    P     = top-r left singular vectors of a          (t = 1)
          = GramSchmidt(b @ b.T @ P_old)              (t > 1: one warm-started power iteration)
    C     = P.T @ P_old                               (r x r change of basis)
    m~    = C @ m
    v~    = (1 - beta2^(t-1)) * | (C*C) @ (v/(1-beta2^(t-1)) - (m/(1-beta1^(t-1)))^2)
                                  + (C @ m / (1-beta1^(t-1)))^2 |
    g~    = P.T @ a
    xi    = a - P @ g~ + beta1/(1-beta1) * (P_old @ m - P @ m~)
    m     = beta1 * m~ + (1 - beta1) * g~ ;  v = beta2 * v~ + (1 - beta2) * g~^2
    W     = (1 - lr*wd) * W - lr * P @ (m/(1-beta1^t)) / (sqrt(v/(1-beta2^t)) + eps)
"""
from __future__ import annotations

import numpy as np

from .common import as_left, gram_schmidt, top_left_singular


def run(w0: np.ndarray, grad_fn, steps: int, *, lr: float, rank: int, beta1: float = 0.908,
        beta2: float = 0.99, rho: float = 0.908, eps: float = 1e-8, weight_decay: float = 0.0,
        error_feedback: bool = True) -> list[np.ndarray]:
    """Weights after each step; ``grad_fn(w, t)`` returns the gradient at ``w`` (t is 0-based)."""
    left = as_left(w0.shape)
    w = np.array(w0 if left else w0.T, dtype=np.float64)
    gfun = (lambda x, t: grad_fn(x, t)) if left else (lambda x, t: grad_fn(x.T, t).T)
    m_rows, n_cols = w.shape
    xi = np.zeros_like(w)
    m = np.zeros((rank, n_cols))
    v = np.zeros((rank, n_cols))
    p_old = None
    out = []
    for t in range(1, steps + 1):
        a = gfun(w, t - 1) + xi
        if p_old is None:
            p = top_left_singular(a, rank)
            m_t, v_t = np.zeros_like(m), np.zeros_like(v)
            lost = np.zeros_like(w)
        else:
            c1, c2 = 1 - beta1 ** (t - 1), 1 - beta2 ** (t - 1)
            b = rho * p_old @ (m / c1) + (1 - rho) * a
            p = gram_schmidt(b @ b.T @ p_old)
            c = p.T @ p_old
            m_t = c @ m
            v_t = c2 * np.abs((c * c) @ (v / c2 - (m / c1) ** 2) + (m_t / c1) ** 2)
            lost = p_old @ m - p @ m_t
        g_red = p.T @ a
        xi = a - p @ g_red + beta1 / (1 - beta1) * lost if error_feedback else np.zeros_like(w)
        m = beta1 * m_t + (1 - beta1) * g_red
        v = beta2 * v_t + (1 - beta2) * g_red ** 2
        direction = (m / (1 - beta1 ** t)) / (np.sqrt(v / (1 - beta2 ** t)) + eps)
        w = (1 - lr * weight_decay) * w - lr * p @ direction
        p_old = p
        out.append(w.copy() if left else w.T.copy())
    return out
