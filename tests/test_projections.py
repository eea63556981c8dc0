"""Coordinate selection: k distinct sorted indices drawn on the parameter's device without a
permutation of all elements, a pure function of (seed, window, parameter)."""
import pytest
import torch

from frugal import FRUGAL, state_bytes
from frugal import projections as P


@pytest.mark.parametrize("n,k", [(10, 0), (10, 1), (10, 5), (10, 6), (10, 10), (1000, 250), (1000, 999)])
def test_random_subset_is_k_distinct_sorted_indices(n, k):
    idx = P.random_subset(n, k, P.generator(3, 1, 7))
    assert idx.numel() == k
    assert torch.equal(idx, idx.unique(sorted=True))  # distinct and sorted
    assert k == 0 or (0 <= idx.min() and idx.max() < n)
    assert torch.equal(idx, P.random_subset(n, k, P.generator(3, 1, 7)))  # same key, same subset


def test_random_subset_is_uniform():
    """Every element is chosen with probability k/n (both branches: k <= n/2 and k > n/2), and
    pairs as often as in a uniform k-subset (no structure such as strides)."""
    n, draws = 12, 3000
    for k in (3, 8):
        counts = torch.zeros(n)
        pairs = torch.zeros(n, n)
        for seed in range(draws):
            mask = torch.zeros(n)
            mask[P.random_subset(n, k, P.generator(seed, 0, 0))] = 1
            counts += mask
            pairs += torch.outer(mask, mask)
        p = k / n
        sd = (p * (1 - p) / draws) ** 0.5
        assert ((counts / draws - p).abs() < 5 * sd).all(), counts / draws
        off_diag = pairs[~torch.eye(n, dtype=torch.bool)] / draws
        p2 = k * (k - 1) / (n * (n - 1))
        assert ((off_diag - p2).abs() < 5 * (p2 * (1 - p2) / draws) ** 0.5).all()


def test_selection_differs_by_window_parameter_and_seed():
    base = P.coordinate_indices("randk", (40, 50), False, 0.25, 0, 0, 0)
    for other in [(1, 0, 0), (0, 1, 0), (0, 0, 1)]:
        assert not torch.equal(base, P.coordinate_indices("randk", (40, 50), False, 0.25, *other))
    assert not torch.equal(base, P.coordinate_indices("randk", (40, 50), False, 0.25, 0, 0, 0, shard=(1,)))


def test_large_randk_draws_no_full_permutation(monkeypatch):
    def no_randperm(*args, **kwargs):
        raise AssertionError("randk must not permute every element")
    monkeypatch.setattr(torch, "randperm", no_randperm)
    shape = (1024, 2048)  # 2M elements
    idx = P.coordinate_indices("randk", shape, False, 0.25, 0, 0, 0, device="cpu")
    assert idx.dtype == torch.int32 and idx.numel() == 2**19 and idx.device.type == "cpu"


def test_randk_indices_live_in_the_state_and_are_counted():
    params = [torch.nn.Parameter(torch.randn(20, 30))]
    opt = FRUGAL([{"params": params, "projectable": True}], projection="randk", density=0.25, update_gap=2)
    params[0].grad = torch.randn(20, 30)
    opt.step()
    st = opt.state[params[0]]
    assert st["index"].dtype == torch.int32 and st["index"].numel() == 150
    assert state_bytes(opt) == 2 * 150 * 4 + 4 + 150 * 4  # moments, step counter, indices


# ---- projection arithmetic in full fp32, whatever the global TF32 / matmul-precision flags -------
_MATMULS = {"mm", "addmm", "bmm", "matmul", "_linalg_svd", "linalg_qr", "linalg_householder_product", "geqrf"}


class _PrecisionSpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, for every matmul-like op, the fp32 matmul precision in force when it ran."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _MATMULS:
            self.seen.append((name, torch.backends.cuda.matmul.fp32_precision,
                              torch.backends.mkldnn.matmul.fp32_precision))
        return func(*args, **(kwargs or {}))


def _steps(spy, **kw):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(12, 8, generator=g)), torch.nn.Parameter(torch.randn(8, 12, generator=g))]
    opt = FRUGAL([{"params": params, "projectable": True, "block": 0}], lr=1e-2, density=0.25, update_gap=2, **kw)
    for t in range(5):  # windows 0, 1, 2: bases changed twice
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with spy:
            opt.step()
    return [p.detach().clone() for p in params]


METHODS = [dict(projection="svd", state_free="none", reset_state="keep"),
           dict(projection="random", reset_state="reproject"),
           dict(projection="svd", state_free="fira", state_full="adamw_hf"),
           dict(projection="power", state_free="none", reset_state="transport", error_feedback=True)]


@pytest.mark.parametrize("kw", METHODS, ids=["galore", "random", "fira", "ldadam"])
def test_projection_math_runs_in_full_fp32_under_global_tf32(kw, monkeypatch):
    """With ``torch.set_float32_matmul_precision('medium')`` (cuBLAS TF32, oneDNN bf16: what
    train.tf32 and the presets turn on) every SVD, QR and matmul of the optimizer runs with the
    precision 'ieee' in force, the global setting is back afterwards, and the numbers equal a run
    at 'highest'. Without the guard the spy sees the lowered precision (the test can fail)."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        reference = _steps(_PrecisionSpy(), **kw)
        torch.set_float32_matmul_precision("medium")
        spy = _PrecisionSpy()
        got = _steps(spy, **kw)
        assert len(spy.seen) > 10 and any(name == "_linalg_svd" or name == "linalg_qr" for name, *_ in spy.seen)
        assert {(cuda, cpu) for _, cuda, cpu in spy.seen} == {("ieee", "ieee")}
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision) == \
            ("tf32", "bf16")  # restored
        assert torch.get_float32_matmul_precision() == "medium"
        for a, b in zip(got, reference):
            assert torch.equal(a, b)
        import contextlib
        monkeypatch.setattr(P, "full_fp32", contextlib.nullcontext)
        unguarded = _PrecisionSpy()
        _steps(unguarded, **kw)
        assert ("tf32", "bf16") in {(cuda, cpu) for _, cuda, cpu in unguarded.seen}
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("api", ["legacy", "new"])
def test_full_fp32_leaves_the_tf32_flags_readable_whichever_api_set_them(api):
    """train.tf32 (and many user loops) set ``torch.backends.cuda.matmul.allow_tf32 = True``, the
    legacy switch. If the guard then changed the new per-backend ``fp32_precision``, torch >= 2.9
    refuses to read the legacy flag ("mix of the legacy and new APIs"), and cuBLAS reads it before
    every fp32 matmul: every SVD-based run would stop at its first projection on a GPU. Inside and
    after the guard, both views must read, agree, and be restored."""
    matmul = torch.backends.cuda.matmul
    before = torch.get_float32_matmul_precision()
    try:
        if api == "legacy":
            matmul.allow_tf32 = True
        else:
            matmul.fp32_precision = "tf32"
        with P.full_fp32():
            assert matmul.fp32_precision == "ieee"
            if api == "legacy":  # what cuBLAS reads before an fp32 matmul
                assert matmul.allow_tf32 is False and torch.get_float32_matmul_precision() == "highest"
        assert matmul.fp32_precision == "tf32"
        if api == "legacy":
            assert matmul.allow_tf32 is True
    finally:
        torch.set_float32_matmul_precision(before)
        matmul.allow_tf32 = False
