"""frugal.adaptive: the opt-in density schedule and plateau-growing update gap (building blocks)."""
from __future__ import annotations

import copy
import math

import pytest

from frugal.adaptive import PlateauGap, WindowClock, scheduled_density


def test_density_schedules_run_from_start_to_end():
    for kind in ("linear", "cosine", "step"):
        values = [scheduled_density(t, start=0.5, end=0.1, steps=100, kind=kind) for t in range(0, 151, 10)]
        assert values[0] == 0.5 and values[-1] == pytest.approx(0.1)
        assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))  # never increases
    assert scheduled_density(50, start=0.5, end=0.1, steps=100, kind="linear") == pytest.approx(0.3)
    assert scheduled_density(50, start=0.5, end=0.1, steps=100, kind="cosine") == pytest.approx(0.3)
    assert scheduled_density(99, start=0.5, end=0.1, steps=100, kind="step") == 0.5
    assert scheduled_density(10**6, start=0.25, end=0.0, steps=100, kind="constant") == 0.25


def test_density_schedule_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="kind: 'exp'; valid choices: constant, linear, cosine, step"):
        scheduled_density(0, start=0.5, end=0.1, steps=10, kind="exp")
    with pytest.raises(ValueError, match="end: 1.5"):
        scheduled_density(0, start=0.5, end=1.5, steps=10)
    with pytest.raises(ValueError, match="steps: 0"):
        scheduled_density(0, start=0.5, end=0.1, steps=0)


def test_window_clock_is_step_over_gap_when_the_gap_is_constant():
    clock = WindowClock(7)
    assert [clock.tick(t) for t in range(50)] == [t // 7 for t in range(50)]
    skipping = WindowClock(7)
    assert skipping.tick(0) == 0 and skipping.tick(30) == 30 // 7  # steps not ticked lose nothing


def test_window_clock_applies_a_new_gap_at_the_next_window_and_resumes():
    clock = WindowClock(4)
    windows = []
    for t in range(20):
        if t == 5:
            clock.set_gap(8)  # requested inside window 1 (steps 4..7): applies from window 2 on
        windows.append(clock.tick(t))
        if t == 9:
            saved = copy.deepcopy(clock.state_dict())
    assert windows == [0] * 4 + [1] * 4 + [2] * 8 + [3] * 4
    resumed = WindowClock(4)
    resumed.load_state_dict(saved)
    assert [resumed.tick(t) for t in range(10, 20)] == windows[10:]


def test_plateau_gap_grows_only_on_a_plateau_and_resumes():
    ctl = PlateauGap(patience=2, threshold=0.01, factor=2.0, max_gap=800)
    losses = [5.0, 4.0, 3.0, 2.99, 2.98, 2.99, 2.98, 2.99, 2.98, 1.0, 0.999, 0.998, 0.997]
    gaps, gap = [], 200
    for i, loss in enumerate(losses):
        gap = ctl.observe(loss, gap)
        gaps.append(gap)
        if i == 5:
            saved = copy.deepcopy(ctl.state_dict())
            saved_gap = gap
    # improving (5 -> 3), then every two windows without a 1% gain: x2, capped at 800
    assert gaps == [200, 200, 200, 200, 400, 400, 800, 800, 800, 800, 800, 800, 800]
    again = PlateauGap(patience=2, threshold=0.01, factor=2.0, max_gap=800)
    again.load_state_dict(saved)
    gap, tail = saved_gap, []
    for loss in losses[6:]:
        gap = again.observe(loss, gap)
        tail.append(gap)
    assert tail == gaps[6:]
    assert ctl.observe(math.nan, 800) == 800


def test_steady_progress_never_grows_the_gap():
    ctl = PlateauGap(patience=1, threshold=0.01)
    gap = 200
    for i in range(50):
        gap = ctl.observe(10.0 * 0.95 ** i, gap)
    assert gap == 200


def test_plateau_gap_rejects_bad_settings_by_name():
    with pytest.raises(ValueError, match="factor: 1.0"):
        PlateauGap(factor=1.0)
    with pytest.raises(ValueError, match="patience: 0"):
        PlateauGap(patience=0)
    with pytest.raises(ValueError, match="update_gap: 0"):
        WindowClock(0)
