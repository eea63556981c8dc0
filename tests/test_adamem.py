"""AdaMeM (as the FRUGAL paper describes it) and its Adafactor pieces (frugal.factored): against a
float64 implementation written from the description (tests/reference/adamem64.py) and against
torch.optim.Adafactor (an independent implementation of the factored second moment)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from frugal import factored as fa
from reference import concurrent
from reference import adamem64
from reference.problems import NoisyLeastSquares, run_torch


@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
def test_adamem_step_matches_float64_reference(shape):
    problem = NoisyLeastSquares(shape, seed=1)
    hp = dict(lr=1e-2, rank=3, update_gap=4, weight_decay=0.1, scale=0.25)
    ref = adamem64.run(problem.w0, problem.grad, 15, free_scale=1.0, **hp)
    got, state = run_torch(problem, concurrent.adamem_step_, 15, torch.float64, **hp)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ref, got)) < 1e-12
    assert np.abs(ref[-1] - problem.w0).max() > 0.05
    # memory: the state-full part in the rank-3 subspace, one vector for the residual rule
    big = max(shape)
    assert state["exp_avg"].shape == ((big, 3) if shape[0] >= shape[1] else (3, big))
    assert state["free_stat"].shape == (big,)
    floats = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    assert floats == concurrent.state_floats("adamem", shape, 3)


def test_residual_update_stays_orthogonal_to_the_state_full_subspace():
    """The one-sided statistic lives on the un-projected side, so the residual update has no
    component in the state-full subspace (the reason for that choice, frugal/factored.py)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(20, 12, generator=gen, dtype=torch.float64)
    w = torch.zeros(20, 12, dtype=torch.float64)
    state: dict = {}
    concurrent.adamem_step_(w, g, state, 0, lr=1.0, rank=3, scale=0.0)  # residual rule only
    q = state["proj"]
    assert w.abs().max() > 0.1
    assert (w @ q).abs().max() < 1e-12


def test_adafactor_matches_torch_adafactor():
    """fa.adafactor_ (factored second moment, Adafactor's decay schedule and update clipping)
    reproduces torch.optim.Adafactor given torch's step size (relative step x parameter RMS)."""
    gen = torch.Generator().manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(7, 5, generator=gen, dtype=torch.float64))
    p = p_ref.detach().clone()
    opt = torch.optim.Adafactor([p_ref], lr=0.01)
    row, col = torch.zeros(7, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for t in range(1, 9):
        g = torch.randn(7, 5, generator=gen, dtype=torch.float64) * (1 + t)
        g[2] = 0.0  # an all-zero row takes the eps1 path
        alpha = max(1e-3, float(p.norm() / p.numel() ** 0.5)) * min(0.01, t ** -0.5)
        p_ref.grad = g.clone()
        opt.step()
        fa.adafactor_(p, g, row, col, t, lr=alpha, eps1=torch.finfo(torch.float64).eps)
        assert torch.allclose(p, p_ref.detach(), rtol=0, atol=1e-13), t


def test_factored_variance_is_exact_for_rank_one_squares():
    """A gradient whose squares form a rank-one matrix is recovered exactly by the factors."""
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    b = torch.tensor([0.5, 1.0, 4.0, 2.0], dtype=torch.float64)
    g = torch.outer(a, b).sqrt()
    row, col = torch.zeros(3, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    fa.update_factors_(row, col, g, 1.0)
    assert torch.allclose(fa.factored_variance(row, col), g * g, atol=1e-14)


def test_rms_clip_and_zero_state_are_safe():
    u = torch.full((4, 4), 3.0)
    assert torch.allclose(fa.rms_clip_(u.clone(), 1.0), torch.ones(4, 4))
    assert torch.equal(fa.rms_clip_(torch.full((2, 2), 0.5), 1.0), torch.full((2, 2), 0.5))
    v = fa.factored_variance(torch.zeros(3), torch.zeros(2))
    assert torch.equal(v, torch.zeros(3, 2))  # no NaN from an all-zero start
