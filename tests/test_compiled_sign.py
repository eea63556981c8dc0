"""The single-pass sign update (frugal.kernels, torch.compile) against the eager ops it replaces:
bitwise the same weights, gradients untouched, and sign_update="auto" (the default) compiles for
large tensors and falls back to eager ops, with one warning, when compiling is impossible.

Each process compiles once per dtype (seconds; inductor's on-disk cache makes later runs faster),
so the tests share one compiled kernel and use two dtypes."""
import shutil
import warnings

import pytest
import torch

from frugal import FRUGAL, kernels

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch.compile on CPU needs a C++ compiler")


def tensors(dtype, shapes, seed=0, special=False):
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(shape, generator=gen) * 10).to(dtype) for shape in shapes]
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
    grads[0].view(-1)[:5] = 0.0  # sign(0) = 0: only the decay there
    if special:
        grads[0].view(-1)[5:7] = torch.tensor([float("nan"), -0.0])  # torch.sign(nan) = 0 too
    return params, grads


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lr,decay", [(3e-3, 1.0), (0.37, 1.0 - 0.37 * 0.013)])
def test_compiled_equals_eager_bitwise(dtype, lr, decay):
    params, grads = tensors(dtype, [(33, 17), (1000,), (8, 4, 5), (70001,)], special=True)
    before = [g.clone() for g in grads]
    eager = [p.clone() for p in params]
    kernels.sign_update_(eager, grads, lr=lr, decay=decay, mode="eager")
    compiled = [p.clone() for p in params]
    kernels.sign_update_(compiled, grads, lr=lr, decay=decay, mode="compiled")
    for c, e, p in zip(compiled, eager, params):
        assert torch.equal(c, e)
        assert not torch.equal(c, p)
    for g, b in zip(grads, before):  # gradients are only read
        torch.testing.assert_close(g, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.slow
@needs_compiler
def test_packs_of_tensors_any_sizes_one_graph_each():
    """PACK tensors per call, the rest one by one; new sizes do not recompile."""
    from torch._dynamo.utils import counters
    sizes = [kernels.AUTO_MIN_NUMEL + 17 * i for i in range(kernels.PACK + 3)]
    params, grads = tensors(torch.float32, [(n,) for n in sizes])
    eager = [p.clone() for p in params]
    kernels.sign_update_(eager, grads, lr=1e-2, decay=0.99, mode="eager")
    kernels.sign_update_(params, grads, lr=1e-2, decay=0.99, mode="auto")
    assert all(torch.equal(p, e) for p, e in zip(params, eager))
    graphs = counters["stats"]["unique_graphs"]
    params, grads = tensors(torch.float32, [(n + 5,) for n in reversed(sizes)], seed=1)
    kernels.sign_update_(params, grads, lr=3e-2, decay=0.98, mode="auto")
    assert counters["stats"]["unique_graphs"] == graphs  # other sizes, LR and decay: no recompile


@pytest.mark.slow
@needs_compiler
def test_auto_compiles_large_tensors_only(monkeypatch):
    calls = []
    real = kernels._kernel

    def spy(count, decayed):
        kernel = real(count, decayed)
        return lambda ps, *args: (calls.extend(p.numel() for p in ps), kernel(ps, *args))

    monkeypatch.setattr(kernels, "_kernel", spy)
    monkeypatch.setattr(kernels, "_unavailable", {})
    params, grads = tensors(torch.float32, [(4, 4), (kernels.AUTO_MIN_NUMEL,)])
    kernels.sign_update_(params, grads, lr=1e-2, mode="auto")
    assert calls == [kernels.AUTO_MIN_NUMEL]


def test_auto_falls_back_once_with_a_warning(monkeypatch):
    def broken(count, decayed):
        def kernel(*args):
            raise RuntimeError("no working C++ compiler")
        return kernel

    monkeypatch.setattr(kernels, "_kernel", broken)
    monkeypatch.setattr(kernels, "_unavailable", {})
    params, grads = tensors(torch.float32, [(kernels.AUTO_MIN_NUMEL,), (kernels.AUTO_MIN_NUMEL + 1,)])
    expected = [p.clone() for p in params]
    kernels.sign_update_(expected, grads, lr=1e-2, decay=0.999, mode="eager")
    with pytest.warns(RuntimeWarning, match="compiled sign update is unavailable on cpu"):
        kernels.sign_update_(params, grads, lr=1e-2, decay=0.999, mode="auto")
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device type
        kernels.sign_update_(params, grads, lr=1e-2, mode="auto")
    with pytest.raises(RuntimeError, match="sign_update='compiled' could not compile"):
        kernels.sign_update_(params, grads, lr=1e-2, mode="compiled")


@pytest.mark.slow
@needs_compiler
def test_frugal_default_path_is_compiled_and_equals_eager(monkeypatch):
    """FRUGAL's default (sign_update="auto") on tensors above the size threshold: bitwise the
    eager run, over block switches, with weight decay and a state-free LR scale."""
    calls = []
    real = kernels._kernel
    monkeypatch.setattr(kernels, "_kernel", lambda *key: (calls.append(key), real(*key))[1])
    shapes = [(256, 256), (256, 260), (300,)]
    runs = {}
    for mode in ("auto", "eager"):
        params = [torch.nn.Parameter(p) for p in tensors(torch.float32, shapes)[0]]
        groups = [{"params": [params[0]], "projectable": True, "block": 0},
                  {"params": [params[1]], "projectable": True, "block": 1}, {"params": [params[2]]}]
        kw = {} if mode == "auto" else {"sign_update": "eager"}
        opt = FRUGAL(groups, lr=1e-2, density=0.5, update_gap=2, weight_decay=0.1,
                     state_free_lr_scale=0.5, **kw)
        for t in range(5):
            grads = tensors(torch.float32, shapes, seed=t + 1)[1]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
        runs[mode] = params
    assert calls, "the default path did not use the compiled kernel"
    for a, b in zip(runs["auto"], runs["eager"]):
        assert torch.equal(a, b)


# ---- gradients that are views into a shared buffer: DDP buckets, FSDP2 reduce-scatter outputs
@pytest.mark.slow
@needs_compiler
def test_views_at_any_storage_offset_reuse_one_graph():
    """Dynamo specialises on whether an input's storage offset is 0. Packs of gradient views whose
    offsets are 0 at a different position each call needed a new graph per pattern: after the
    recompile limit, sign_update="compiled" failed and "auto" fell back to eager for the run."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    n, pack = kernels.AUTO_MIN_NUMEL, kernels.PACK
    bucket = torch.randn(n * pack * 2, generator=torch.Generator().manual_seed(0))
    params = tensors(torch.float32, [(n,)] * pack)[0]
    graphs = None
    for call in range(torch._dynamo.config.recompile_limit + 4):
        # a different gradient starts the buffer each call, the others at offsets > 0
        starts = [((i - call) % pack) * n * 2 for i in range(pack)]
        grads = [bucket[s:s + n] for s in starts]
        expected = [p.clone() for p in params]
        kernels.sign_update_(expected, grads, lr=1e-3, decay=0.99, mode="eager")
        kernels.sign_update_(params, grads, lr=1e-3, decay=0.99, mode="compiled")
        assert all(torch.equal(p, e) for p, e in zip(params, expected))
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # no recompiles after the first call


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _layers_run(parallelism: str, sign_update: str, steps: int = 3):
    """FRUGAL (update_gap=1, most blocks state-free) on 12 square layers, wrapped in DDP with
    small gradient buckets (views at many offsets) or sharded by FSDP2."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256, bias=False) for _ in range(12)]
    quads = [torch.nn.Sequential(*layers[i:i + 4]) for i in range(0, len(layers), 4)]
    net = torch.nn.Sequential(*quads)
    if parallelism == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True, bucket_cap_mb=1)
    else:
        from torch.distributed.fsdp import fully_shard

        for quad in quads:  # four weights per group: their gradients are views of one reduce-scatter output
            fully_shard(quad)
        model = fully_shard(net)
    groups = [{"params": [layer.weight], "projectable": True, "block": i} for i, layer in enumerate(layers)]
    opt = FRUGAL(groups, lr=1e-3, density=0.1, update_gap=1, weight_decay=0.1, sign_update=sign_update)
    offsets = set()
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 256, generator=gen)).pow(2).mean().backward()
        offsets |= {getattr(layer.weight.grad, "_local_tensor", layer.weight.grad).storage_offset() for layer in layers}
        opt.step()
        opt.zero_grad(set_to_none=parallelism != "ddp")
    from frugal.sharding import local

    return [local(layer.weight.detach()).clone() for layer in layers], offsets


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_compiled_update_survives_ddp_buckets_and_fsdp2_shards(process_group, monkeypatch, parallelism):
    """The compiled pass stays in use (no fallback, no warning) on DDP bucket views and FSDP2
    shards, over more steps than dynamo's recompile limit, each switching the state-full block (so
    every pack holds another mix of views), with at most its two graphs (a pack, a single tensor)
    compiled, and gives the eager run's weights. (With the views passed as they are, every mix of
    zero and non-zero storage offsets was a new graph: the limit was hit within these steps.)"""
    from torch._dynamo.utils import counters

    steps = torch._dynamo.config.recompile_limit + 4
    calls = []
    real = kernels._kernel
    monkeypatch.setattr(kernels, "_kernel", lambda *key: (calls.append(key), real(*key))[1])
    monkeypatch.setattr(kernels, "_unavailable", {})
    monkeypatch.setattr(kernels, "_compiled", {})  # this test's graphs are counted from none
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        compiled, offsets = _layers_run(parallelism, "auto", steps)
    assert kernels._unavailable == {} and calls
    assert counters["stats"]["unique_graphs"] - graphs <= 2  # the pack's and the single tensor's
    assert len(offsets) > 1  # the gradients really were views at several offsets
    eager, _ = _layers_run(parallelism, "eager", steps)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    strict, _ = _layers_run(parallelism, "compiled", steps)  # and "compiled" does not stop the run
    assert all(torch.equal(c, e) for c, e in zip(strict, eager))
