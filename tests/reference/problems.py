"""Small seeded problems whose gradient depends on the weights (so that trajectories diverge when
two implementations differ) and moves between steps (so that SVD subspaces change)."""
from __future__ import annotations

import numpy as np


class NoisyLeastSquares:
    """f(W) = 0.5 ||A W - B||^2 with a fresh seeded perturbation of the gradient at each step."""

    def __init__(self, shape, seed: int = 0, noise: float = 0.3):
        rng = np.random.default_rng(seed)
        m, n = shape
        self.a = rng.standard_normal((m + 3, m)) / np.sqrt(m)
        self.b = rng.standard_normal((m + 3, n))
        self.w0 = rng.standard_normal((m, n)) * 0.1
        self.noise = [rng.standard_normal((m, n)) * noise for _ in range(64)]

    def grad(self, w: np.ndarray, t: int) -> np.ndarray:
        return self.a.T @ (self.a @ w - self.b) + self.noise[t % len(self.noise)]

    def loss(self, w: np.ndarray) -> float:
        return 0.5 * float(((self.a @ w - self.b) ** 2).sum())


def run_torch(problem, step_fn, steps: int, dtype, **hparams):
    """Drive a ``reference.concurrent``-style ``step_fn(param, grad, state, step, **hparams)``."""
    import torch

    w = torch.tensor(problem.w0, dtype=dtype)
    state: dict = {}
    out = []
    for t in range(steps):
        g = torch.tensor(problem.grad(w.double().numpy(), t), dtype=dtype)
        step_fn(w, g, state, t, **hparams)
        out.append(w.double().numpy().copy())
    return out, state
