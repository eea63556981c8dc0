r"""AdaMeM in float64, as the FRUGAL paper describes it (Appendix "Comparison with Concurrent
Methods"): FRUGAL with an SVD subspace, Adafactor with momentum as the state-full rule and
one-sided Adafactor as the state-free rule (Vyas, Morwani & Kakade, WANT@ICML 2024).

Written for a basis P (m x r) on the rows of an m x n weight (m < n); a tall weight runs as its
transpose. Adafactor's factored second moment uses the paper's sums (Shazeer & Stern 2018,
Algorithm 4): V = R C / (1^T R) with R, C running row and column sums of squares. Every T steps
P = top-r left singular vectors of the gradient, and the state-full state restarts (FRUGAL's reset).
Per step (k = steps since that restart, t = steps since the start, constant beta2 with Adam's
bias correction):

    X   = P.T @ G (r x n);   F = G - P @ X
    M   = beta1 M + (1 - beta1) X
    R   = beta2 R + (1 - beta2) X^2 @ 1_n ;   C = beta2 C + (1 - beta2) 1_r^T @ X^2
    U   = (M / (1 - beta1^k)) / (sqrt(outer(R, C) / sum(R) / (1 - beta2^k)) + eps)
    s   = beta2 s + (1 - beta2) * mean over rows of F^2          (one value per column, n)
    W   = (1 - lr*wd) W - lr * scale * P @ U - lr * free_scale * F / (sqrt(s / (1 - beta2^t)) + eps)
"""
from __future__ import annotations

import numpy as np

from .common import as_left, top_left_singular


def run(w0, grad_fn, steps, *, lr, rank, update_gap, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, scale=1.0, free_scale=1.0):
    left = as_left(w0.shape)
    w = np.array(w0 if left else w0.T, dtype=np.float64)
    gfun = (lambda x, t: grad_fn(x, t)) if left else (lambda x, t: grad_fn(x.T, t).T)
    m_rows, n_cols = w.shape
    s = np.zeros(n_cols)
    out = []
    for t in range(steps):
        g = gfun(w, t)
        if t % update_gap == 0:
            p = top_left_singular(g, rank)
            mom, row, col, k = np.zeros((rank, n_cols)), np.zeros(rank), np.zeros(n_cols), 0
        x = p.T @ g
        f = g - p @ x
        k += 1
        mom = beta1 * mom + (1 - beta1) * x
        row = beta2 * row + (1 - beta2) * (x ** 2).sum(axis=1)
        col = beta2 * col + (1 - beta2) * (x ** 2).sum(axis=0)
        vhat = np.outer(row, col) / row.sum() / (1 - beta2 ** k)
        u = (mom / (1 - beta1 ** k)) / (np.sqrt(vhat) + eps)
        s = beta2 * s + (1 - beta2) * (f ** 2).mean(axis=0)
        free = f / (np.sqrt(s / (1 - beta2 ** (t + 1))) + eps)
        w = (1 - lr * weight_decay) * w - lr * scale * p @ u - lr * free_scale * free
        out.append(w.copy() if left else w.T.copy())
    return out
