"""The opt-in single-pass sign update (FRUGAL_COMPILED_SIGN=1, torch.compile) must give exactly
the eager update's result: p - lr * sign(g), with sign(0) = 0, in fp32 and bf16."""
import shutil

import pytest
import torch

from frugal import rules

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                       reason="torch.compile on CPU needs a C++ compiler (the opt-in path documents this)"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_sign_update_equals_eager(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).to(dtype) for shape in [(33, 17), (1000,), (8, 4, 5)]]
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
    grads[0][0, :5] = 0.0  # sign(0) = 0: no update there
    eager_p, eager_g = [p.clone() for p in params], [g.clone() for g in grads]
    rules.signsgd_(eager_p, eager_g, lr=3e-3)

    monkeypatch.setenv("FRUGAL_COMPILED_SIGN", "1")
    comp_p, comp_g = [p.clone() for p in params], [g.clone() for g in grads]
    rules.signsgd_(comp_p, comp_g, lr=3e-3)
    for a, b, p in zip(comp_p, eager_p, params):
        assert torch.equal(a, b)
        assert not torch.equal(a, p)
    assert torch.equal(comp_p[0][0, :5], params[0][0, :5])
    assert all(torch.equal(a, b) for a, b in zip(comp_g, grads))  # the compiled path leaves grads alone
