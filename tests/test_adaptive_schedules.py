"""The opt-in schedules wired into FRUGAL: a density that decays over training and an update gap that
grows on a loss plateau (AdaFRUGAL's proposal). Off by default; when on, resumable bit for bit and
reported through `pop_events()`."""
from __future__ import annotations

import io

import pytest
import torch

import frugal
from frugal import FRUGAL, HyperparameterError
from frugal import projections as P
from frugal.adaptive import scheduled_density


def make(layers=8, shape=(6, 8), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen).to(dtype)) for _ in range(layers)] + \
        [torch.nn.Parameter(torch.randn(5, generator=gen).to(dtype))]


def groups(params):
    return [{"params": [p], "projectable": True, "block": i} for i, p in enumerate(params[:-1])] + \
        [{"params": [params[-1]]}]


def step(opt, params, t, loss=None):
    gen = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    if loss is not None:
        opt.observe_loss(loss)
    opt.step()


def test_off_by_default_windows_are_step_over_gap_and_nothing_is_kept():
    params = make()
    opt = FRUGAL(groups(params), density=0.25, update_gap=2, block_order="ascending")
    seen = []
    for t in range(8):
        seen.append(opt.active_blocks())
        step(opt, params, t, loss=1.0)
    assert seen == [P.select_blocks("ascending", 8, 0.25, t // 2, 0) for t in range(8)]
    assert "clock" not in opt.param_groups[0] and opt.pop_events() == []


def test_block_density_schedule_shrinks_the_state_full_set_and_walks_on():
    params = make()
    opt = FRUGAL(groups(params), density=0.5, update_gap=2, block_order="ascending",
                 density_schedule="linear", density_end=0.125, density_steps=8)
    seen, events = [], []
    for t in range(12):
        seen.append(opt.active_blocks())
        step(opt, params, t)
        events += opt.pop_events()
        full = [p for p in params[:-1] if p in opt.state]
        assert len(full) == len(seen[-1])  # only the window's blocks own state
    counts = [len(blocks) for blocks in seen[::2]]
    expected = [P.block_count(8, scheduled_density(w * 2, start=0.5, end=0.125, steps=8)) for w in range(6)]
    assert counts == expected == [4, 3, 3, 2, 1, 1]
    # the walk continues where the last window stopped: every block comes round in turn
    starts = [sum(counts[:w]) for w in range(6)]
    assert [set(blocks) for blocks in seen[::2]] == [{(s + j) % 8 for j in range(k)} for s, k in zip(starts, counts)]
    # one event per change of the density (window 2 changes it without changing the rounded count)
    assert [(e["window"], e["state_full_blocks"]) for e in events] == [(1, 3), (2, 3), (3, 2), (4, 1)]
    assert all(e["event"] == "density" for e in events)


@pytest.mark.parametrize("projection,reset_state", [("column", "keep"), ("column", "reproject"),
                                                    ("svd", "keep"), ("svd", "reset"), ("randk", "reset")])
def test_split_density_schedule_resizes_the_reduced_state(projection, reset_state):
    params = make(layers=2, shape=(8, 12))
    opt = FRUGAL(groups(params), density=0.5, update_gap=3, projection=projection, reset_state=reset_state,
                 density_schedule="step", density_end=0.25, density_steps=3)
    step(opt, params, 0)
    big = opt.state[params[0]]["exp_avg"].numel()
    for t in range(1, 4):
        step(opt, params, t)
    small = opt.state[params[0]]["exp_avg"].numel()
    assert small * 2 == big
    assert opt.density_report()["requested"] == pytest.approx(0.25)
    assert torch.isfinite(params[0]).all()


def test_plateau_grows_the_gap_at_window_starts_and_reports_it():
    params = make(layers=2, shape=(6, 8))
    opt = FRUGAL(groups(params), density=0.5, update_gap=2, projection="svd", update_gap_growth=2.0,
                 plateau_patience=1, plateau_threshold=0.01, max_update_gap=8)
    windows, events = [], []
    for t in range(20):
        step(opt, params, t, loss=3.0)  # no progress at all
        windows.append(opt.state[params[0]]["window"])
        events += opt.pop_events()
    # window 0 (steps 0-1) sets the best loss; every later window fails to improve: 2 -> 4 -> 8 (cap)
    assert windows == [0] * 2 + [1] * 2 + [2] * 4 + [3] * 8 + [4] * 4
    assert [(e["window"], e["update_gap"], e["previous_update_gap"]) for e in events] == [(2, 4, 2), (3, 8, 4)]
    assert events[0]["window_loss"] == pytest.approx(3.0)


def test_without_losses_the_gap_never_grows():
    params = make(layers=2)
    opt = FRUGAL(groups(params), projection="column", update_gap=2, update_gap_growth=2.0, plateau_patience=1)
    for t in range(10):
        step(opt, params, t)
    assert opt.param_groups[0]["clock"]["update_gap"] == 2 and opt.pop_events() == []


@pytest.mark.parametrize("projection", ["block", "column", "svd"])
def test_resume_mid_window_is_bitwise_with_both_schedules(projection):
    """Stop inside a window, save (torch.save, weights_only load), continue: the same weights and
    the same later events as the uninterrupted run; the clock travels in param_groups[0]."""
    kw = dict(density=0.5, update_gap=2, projection=projection, density_schedule="cosine", density_end=0.25,
              density_steps=12, update_gap_growth=2.0, plateau_patience=1, plateau_threshold=0.05,
              block_order="ascending", max_update_gap=16)
    losses = [5.0, 4.0, 3.9, 3.89, 3.88, 3.87, 3.86, 3.85, 3.0, 2.99, 2.98, 2.97, 2.96, 2.95, 2.9, 2.9, 2.9]
    params = make()
    opt = FRUGAL(groups(params), **kw)
    for t in range(5):
        step(opt, params, t, loss=losses[t])
    opt.pop_events()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = FRUGAL(groups(twin), **kw)
    twin_opt.load_state_dict(torch.load(buf, weights_only=True))
    ev_a, ev_b = [], []
    for t in range(5, len(losses)):
        step(opt, params, t, loss=losses[t])
        step(twin_opt, twin, t, loss=losses[t])
        ev_a += opt.pop_events()
        ev_b += twin_opt.pop_events()
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
    assert ev_a == ev_b and any(e["event"] == "update_gap" for e in ev_a)
    assert opt.active_blocks() == twin_opt.active_blocks()


@pytest.mark.parametrize("config", [
    dict(projection="block", density_schedule="linear", density_end=0.25, density_steps=6),
    dict(projection="column", update_gap_growth=2.0, plateau_patience=1),
    dict(projection="svd", density_schedule="step", density_end=0.25, density_steps=4,
         update_gap_growth=1.5, plateau_patience=1),
])
def test_fast_path_matches_the_reference_path_with_schedules(config):
    runs = []
    for foreach in (True, False):
        params = make(layers=4, dtype=torch.float64)
        opt = FRUGAL(groups(params), density=0.5, update_gap=2, weight_decay=0.1, foreach=foreach, **config)
        for t in range(11):
            step(opt, params, t, loss=2.0)
        runs.append((params, opt.pop_events()))
    (a, ev_a), (b, ev_b) = runs
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert ev_a == ev_b


def test_materialize_state_follows_the_density_schedule_and_refuses_a_growing_gap():
    kw = dict(density=0.5, update_gap=2, projection="column", density_schedule="linear", density_end=0.25,
              density_steps=8)
    params = make(layers=2)
    opt = FRUGAL(groups(params), **kw)
    for t in range(7):
        step(opt, params, t)
    fresh = FRUGAL(groups(make(layers=2)), **kw)
    fresh.materialize_state(7)
    shapes = {k: {n: tuple(v.shape) for n, v in s.items() if torch.is_tensor(v)}
              for k, s in opt.state_dict()["state"].items()}
    assert shapes == {k: {n: tuple(v.shape) for n, v in s.items() if torch.is_tensor(v)}
                      for k, s in fresh.state_dict()["state"].items()}
    growing = FRUGAL(groups(make(layers=2)), projection="column", update_gap_growth=2.0)
    with pytest.raises(HyperparameterError, match="update_gap_growth > 1"):
        growing.materialize_state(3)


def test_estimate_counts_the_peak_density():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(4))
    low = frugal.estimate_state_bytes(model, "frugal", projection="column", density=0.25)
    high = frugal.estimate_state_bytes(model, "frugal", projection="column", density=0.5)
    scheduled = frugal.estimate_state_bytes(model, "frugal", projection="column", density=0.5, density_end=0.25,
                                            density_schedule="linear", density_steps=100)
    assert scheduled == high > low


def test_bad_schedule_settings_are_named():
    params = make(layers=2)
    with pytest.raises(HyperparameterError, match="density_schedule 'linear' needs density_steps"):
        FRUGAL(groups(params), density_schedule="linear")
    with pytest.raises(HyperparameterError, match="Invalid density_schedule: 'exp'; valid choices: constant"):
        FRUGAL(groups(params), density_schedule="exp")
    with pytest.raises(HyperparameterError, match="Invalid update_gap_growth: 0.5"):
        FRUGAL(groups(params), update_gap_growth=0.5)
    mixed = groups(params)
    mixed[0]["update_gap"] = 5
    with pytest.raises(HyperparameterError, match="share update_gap: got 5 and 200"):
        FRUGAL(mixed, projection="column", update_gap_growth=2.0)  # at construction, not at the first step
