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
    with pytest.raises(ValueError, match="steps=0 is invalid"):
        scheduled_density(0, start=0.5, end=0.1, steps=0)


def _windows(clock, steps, **kw):
    out = []
    for t in steps:
        clock.tick(t, **kw)
        out.append(clock.window)
    return out


def test_window_clock_is_step_over_gap_when_the_gap_is_constant():
    clock = WindowClock(7)
    assert _windows(clock, range(50)) == [t // 7 for t in range(50)]
    skipping = WindowClock(7)
    assert _windows(skipping, [0, 30]) == [0, 30 // 7]  # steps not ticked lose nothing
    walk = WindowClock(4)
    walk.tick(13, blocks=lambda start: 3)  # windows starting at 0, 4, 8 had 3 blocks each
    assert (walk.window, walk.start, walk.offset) == (3, 12, 9)


def test_window_clock_takes_the_plateau_gap_at_the_next_window_and_resumes():
    ctl = PlateauGap(patience=1, threshold=0.01, factor=2.0, max_gap=16)
    clock = WindowClock(4)
    windows, events = [], []
    for t in range(30):
        events += clock.tick(t, plateau=ctl)
        windows.append(clock.window)
        clock.observe(1.0 if t < 4 else 1.0 - 1e-4 * t)  # the first window sets the best; then flat
        if t == 9:
            saved, saved_ctl = copy.deepcopy(clock.state_dict()), copy.deepcopy(ctl.state_dict())
    # window 0: steps 0-3 (best); window 1: 4-7 (no gain: the next gap doubles); window 2: 8-15;
    # window 3: 16-31 (gap 16 = max_gap)
    assert windows == [0] * 4 + [1] * 4 + [2] * 8 + [3] * 14
    assert [e["update_gap"] for e in events] == [8, 16]
    resumed, ctl2 = WindowClock(4), PlateauGap(patience=1, threshold=0.01, factor=2.0, max_gap=16)
    resumed.load_state_dict(saved)
    ctl2.load_state_dict(saved_ctl)
    again = []
    for t in range(10, 30):
        resumed.tick(t, plateau=ctl2)
        again.append(resumed.window)
        resumed.observe(1.0 if t < 4 else 1.0 - 1e-4 * t)
    assert again == windows[10:]


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
    with pytest.raises(ValueError, match="patience=0 is invalid"):
        PlateauGap(patience=0)
    with pytest.raises(ValueError, match="update_gap=0 is invalid"):
        WindowClock(0)
