"""Stochastic rounding of bfloat16 weights (opt-in): unbiased, only to the two neighbours, and it
moves weights that round-to-nearest freezes under small sign steps (pure bf16, Tables 3 and 10)."""
import pytest
import torch

from frugal import FRUGAL
from frugal.kernels import stochastic_round_


def neighbours(x32):
    down = x32.to(torch.bfloat16)
    below = torch.nextafter(down, torch.tensor(-float("inf"), dtype=torch.bfloat16))
    down = torch.where(down.float() > x32, below, down)
    up = torch.nextafter(down, torch.tensor(float("inf"), dtype=torch.bfloat16))
    return down, up


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=gen) * torch.logspace(-3, 3, 64)  # many binades, both signs
    x[0], x[1] = 1.0 + 2**-9, -(3.0 + 2**-8)  # exactly representable in fp32, between bf16 values
    down, up = neighbours(x)
    draws = 4000
    out = torch.empty(draws, 64, dtype=torch.bfloat16)
    stochastic_round_(out, x.expand(draws, 64).contiguous(), gen)
    assert ((out == down) | (out == up)).all()
    frac = (x - down.float()) / (up.float() - down.float())  # P(round up)
    p_up = (out == up).float().mean(0)
    assert ((p_up - frac).abs() < 5 * (frac * (1 - frac) / draws).sqrt() + 1e-6).all()
    mean = out.float().mean(0)
    ulp = up.float() - down.float()
    assert ((mean - x).abs() < 5 * ulp / (2 * draws**0.5)).all()  # unbiased: E[round(x)] = x


def test_exact_and_non_finite_values_are_kept():
    x = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf"), float("nan")])
    out = torch.empty(6, dtype=torch.bfloat16)
    stochastic_round_(out, x, torch.Generator().manual_seed(1))
    assert torch.equal(out[:5].float(), x[:5]) and out[5].isnan()


def sign_steps(stochastic_rounding, steps=100, lr=1e-4, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    w = (1 + torch.rand(64, 64, generator=gen)).to(dtype)  # |w| in [1, 2): bf16 ulp 2^-7 >> 2 lr
    p = torch.nn.Parameter(w.clone())
    opt = FRUGAL([{"params": [p], "always_state_free": True}], lr=lr,
                 stochastic_rounding=stochastic_rounding)
    g = torch.randn(64, 64, generator=gen).to(dtype)
    for _ in range(steps):
        p.grad = g
        opt.step()
    return w, p.detach(), g


def test_round_to_nearest_freezes_small_sign_steps_and_stochastic_rounding_moves_them():
    w, nearest, g = sign_steps(False)
    assert torch.equal(nearest, w)  # every step is lost to rounding
    w, stochastic, g = sign_steps(True)
    moved = stochastic != w
    assert moved.float().mean() > 0.5
    # in expectation the weights moved by -steps * lr * sign(g), as in float32
    drift = (stochastic.float() - w.float()) / (-100 * 1e-4 * torch.sign(g.float()))
    assert drift.mean() == pytest.approx(1.0, abs=0.1)


def test_off_by_default_and_only_for_bfloat16():
    with pytest.warns(UserWarning, match="no projectable parameters"):
        assert FRUGAL([torch.nn.Parameter(torch.zeros(2))]).defaults["stochastic_rounding"] is False
    w, p32, _ = sign_steps(True, steps=3, dtype=torch.float32)  # float32 weights: ordinary rounding
    w, q32, _ = sign_steps(False, steps=3, dtype=torch.float32)
    assert torch.equal(p32, q32)


def adamw_run(stochastic_rounding):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((1 + torch.rand(32, 32, generator=gen)).to(torch.bfloat16)) for _ in range(3)]
    start = [p.detach().clone() for p in params]
    groups = [{"params": params[:1], "projectable": True, "block": 0},
              {"params": params[1:2], "projectable": True, "block": 1}, {"params": params[2:]}]
    opt = FRUGAL(groups, lr=1e-4, density=0.5, stochastic_rounding=stochastic_rounding)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(32, 32, generator=gen).to(torch.bfloat16)
        opt.step()
    return start, [p.detach().clone() for p in params]


def test_stochastic_rounding_is_reproducible_and_covers_state_full_tensors():
    """A pure function of (seed, step, parameter): two runs agree. The AdamW tensors (the active
    block, the non-projectable one) take lr 1e-4 steps on |w| >= 1: only stochastic rounding
    moves them."""
    start, first = adamw_run(True)
    _, second = adamw_run(True)
    _, nearest = adamw_run(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for s, a, n in zip(start, first, nearest):
        assert torch.equal(n, s) and not torch.equal(a, s)
