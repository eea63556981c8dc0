"""Small numpy helpers shared by the references (no torch, no frugal)."""
from __future__ import annotations

import numpy as np


def gram_schmidt(y: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning y's columns, by modified Gram-Schmidt (run twice for accuracy)."""
    q = np.array(y, dtype=np.float64, copy=True)
    for _ in range(2):
        for k in range(q.shape[1]):
            for j in range(k):
                q[:, k] -= (q[:, j] @ q[:, k]) * q[:, j]
            q[:, k] /= np.linalg.norm(q[:, k])
    return q


def top_left_singular(g: np.ndarray, rank: int) -> np.ndarray:
    """Top-r left singular vectors, each column signed so that its largest-magnitude entry is
    positive (the library's convention, which makes "keep the state" backend-independent)."""
    u, _, _ = np.linalg.svd(g, full_matrices=False)
    u = u[:, :rank].copy()
    for k in range(rank):
        if u[np.argmax(np.abs(u[:, k])), k] < 0:
            u[:, k] = -u[:, k]
    return u


def as_left(shape) -> bool:
    """The papers' (GaLore's) rule: the basis acts on the smaller side. The references are written
    for a basis on the rows (m < n); a matrix with m >= n is handled as its transpose."""
    return shape[0] < shape[1]
