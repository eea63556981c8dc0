"""LDAdam: frugal.subspace / tests/reference/concurrent.py's ldadam_step_ against a float64 implementation written
from the LDAdam paper's Algorithm 1 (tests/reference/ldadam64.py), plus properties of the pieces."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from frugal import subspace as sub
from reference import concurrent
from reference import ldadam64
from reference.problems import NoisyLeastSquares, run_torch

STEPS, RANK = 15, 3


@pytest.mark.parametrize("error_feedback", [True, False])
@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
def test_ldadam_step_matches_float64_reference(shape, error_feedback):
    problem = NoisyLeastSquares(shape, seed=1)
    hp = dict(lr=1e-2, rank=RANK, weight_decay=0.1, error_feedback=error_feedback)
    ref = ldadam64.run(problem.w0, problem.grad, STEPS, **hp)
    got, state = run_torch(problem, concurrent.ldadam_step_, STEPS, torch.float64, **hp)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ref, got)) < 1e-12
    assert np.abs(ref[-1] - problem.w0).max() > 0.05  # it moved: the comparison means something
    assert ("error" in state) == error_feedback
    floats = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    assert floats == concurrent.state_floats("ldadam", shape, RANK) - (0 if error_feedback else shape[0] * shape[1])


def test_error_feedback_changes_the_trajectory_and_helps():
    problem = NoisyLeastSquares((12, 20), seed=2, noise=0.0)
    hp = dict(lr=3e-2, rank=2)
    with_ef, _ = run_torch(problem, concurrent.ldadam_step_, 60, torch.float64, **hp)
    without, _ = run_torch(problem, concurrent.ldadam_step_, 60, torch.float64, error_feedback=False, **hp)
    assert problem.loss(with_ef[-1]) < problem.loss(without[-1])


def test_block_power_iteration_converges_to_the_top_singular_subspace():
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(12, 12, generator=gen, dtype=torch.float64))
    s = torch.tensor([10.0, 8.0, 6.0] + [1.0 / (i + 1) for i in range(9)], dtype=torch.float64)
    b = u[:, :12] @ torch.diag(s) @ v.t()  # 30 x 12, gap after the third singular value
    q0, _ = torch.linalg.qr(torch.randn(12, 3, generator=gen, dtype=torch.float64))
    q = sub.block_power_iteration(b, q0, "right", iterations=40)
    top = v[:, :3]
    assert torch.allclose(q @ q.t(), top @ top.t(), atol=1e-10)
    assert torch.allclose(q.t() @ q, torch.eye(3, dtype=torch.float64), atol=1e-12)
    ql = sub.block_power_iteration(b.t(), q0, "left", iterations=40)  # same subspace, other side
    assert torch.allclose(ql @ ql.t(), top @ top.t(), atol=1e-10)


@pytest.mark.parametrize("side", ["right", "left"])
def test_change_of_basis_is_reduce_of_lift(side):
    gen = torch.Generator().manual_seed(1)
    q_old, _ = torch.linalg.qr(torch.randn(10, 4, generator=gen, dtype=torch.float64))
    q_new, _ = torch.linalg.qr(torch.randn(10, 4, generator=gen, dtype=torch.float64))
    x = torch.randn((7, 4) if side == "right" else (4, 7), generator=gen, dtype=torch.float64)
    r = sub.change_of_basis(q_old, q_new, side)
    direct = sub.reduce(sub.lift(x, q_old, side), q_new, side)
    moved, _ = sub.reproject_moments(x, x * x, r, side, beta1=0.9, beta2=0.99, step=3)
    assert torch.allclose(moved, direct, atol=1e-12)


def test_second_moment_transport_is_exact_for_a_coordinate_permutation():
    """When the new basis permutes the old one the transported v is v permuted, exactly."""
    q_old = torch.eye(6, dtype=torch.float64)[:, :3]
    q_new = q_old[:, [2, 0, 1]]
    r = sub.change_of_basis(q_old, q_new, "right")
    m = torch.randn(5, 3, dtype=torch.float64)
    v = m * m + torch.rand(5, 3, dtype=torch.float64)
    m2, v2 = sub.reproject_moments(m, v, r, "right", beta1=0.9, beta2=0.99, step=4)
    assert torch.allclose(m2, m[:, [2, 0, 1]]) and torch.allclose(v2, v[:, [2, 0, 1]])


def test_canonical_signs_make_the_basis_backend_independent():
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    q = sub.top_singular_basis(g, 3, "right")
    flipped = sub.canonical_signs(q * torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64))
    assert torch.equal(flipped, q)
    assert bool((q.gather(0, q.abs().argmax(0, keepdim=True)) > 0).all())


def test_bad_arguments_are_named():
    w, g = torch.zeros(6, 4), torch.ones(6, 4)
    with pytest.raises(ValueError, match=r"rho \(subspace momentum\): 1.0"):
        concurrent.ldadam_step_(w, g, {}, 0, lr=1e-3, rank=2, rho=1.0)
    with pytest.raises(ValueError, match=r"rank: 0 .*\[1, 4\]"):
        concurrent.ldadam_step_(w, g, {}, 0, lr=1e-3, rank=0)
