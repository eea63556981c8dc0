"""LR schedules against an independent, hand-written formula."""
import math

import pytest
import torch

from frugal.schedules import build_lambda, build_scheduler


def reference(step, peak_steps, warmup, floor, restart):
    """Independent restatement: position in cycle, linear ramp, half-cosine down to `floor`."""
    if not restart and step >= peak_steps:
        return floor
    pos = step - (step // peak_steps) * peak_steps if restart else step
    if pos < warmup:
        return pos / warmup
    frac = (pos - warmup) / (peak_steps - warmup)
    return floor + (1 - floor) * (1 + math.cos(math.pi * frac)) / 2


def test_cosine_restarts_key_steps():
    f = build_lambda("cosine_restarts", 1000, cycle_length=100)  # warmup 10, floor 0.1
    assert f(0) == 0.0
    assert f(5) == pytest.approx(0.5)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55)  # half-way through the decay: (1 + 0.1) / 2
    assert f(99) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 89 / 90)) / 2)
    # every cycle re-warms from zero
    assert f(100) == 0.0 and f(105) == pytest.approx(0.5) and f(110) == pytest.approx(1.0)
    for step in range(0, 1000, 7):
        assert f(step) == pytest.approx(reference(step, 100, 10, 0.1, True))


def test_cosine_one_cycle_and_constant():
    f = build_lambda("cosine", 200, warmup_fraction=0.05, min_lr_ratio=0.0)
    for step in range(0, 400, 3):
        assert f(step) == pytest.approx(reference(step, 200, 10, 0.0, False))
    assert f(10_000) == 0.0
    g = build_lambda("constant", 100, warmup_steps=4)
    assert [g(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_warmup_steps_overrides_fraction():
    f = build_lambda("cosine_restarts", 100, cycle_length=50, warmup_fraction=0.5, warmup_steps=2)
    assert f(1) == pytest.approx(0.5) and f(2) == pytest.approx(1.0) and f(51) == pytest.approx(0.5)


def test_scheduler_drives_optimizer_and_state_dict():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.2)
    sched = build_scheduler(opt, "cosine_restarts", total_steps=40, cycle_length=20)
    lrs = []
    for _ in range(25):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(0.2) and lrs[20] == 0.0
    state = sched.state_dict()
    torch.save(state, __import__("io").BytesIO())  # plain data only


@pytest.mark.parametrize("name, total, kwargs, match", [
    ("linear", 10, {}, r"'linear'.*constant.*cosine.*cosine_restarts"),
    ("cosine", 0, {}, r"total_steps=0 is invalid"),
    ("cosine_restarts", 10, {"cycle_length": 0}, r"cycle_length=0 is invalid"),
    ("cosine", 10, {"warmup_fraction": 1.5}, r"warmup_fraction: 1.5"),
    ("cosine", 10, {"min_lr_ratio": -0.1}, r"min_lr_ratio: -0.1"),
    ("constant", 10, {"warmup_steps": 11}, r"warmup_steps=11 is invalid"),
    ("constant", 10, {"cycle_length": 5}, r"cycle_length.*warmup_fraction"),
])
def test_bad_input(name, total, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_lambda(name, total, **kwargs)
