"""Element-wise kernels of the step: the state-free sign update and stochastic rounding to bfloat16.

The sign update ``p <- p * decay - lr * sign(g)`` is memory-bound; eager torch reads and writes the
weights twice and allocates ``sign(g)``, while one pass compiled by ``torch.compile`` reads ``p`` and
``g`` once and writes ``p`` once. It rounds exactly where the eager ops round (``lr`` in the weight
dtype, as ``add_`` rounds ``alpha``): bitwise the same weights (tested in fp32, bf16, fp16, fp64).

``sign_update``: ``"auto"`` (default) compiles for tensors of at least ``AUTO_MIN_NUMEL`` elements on
CPU and CUDA, eager below; where compiling is impossible it warns once and stays eager for that
device type (never fails a run). ``"compiled"``: every tensor, an error if it cannot compile.
``"eager"``: never compile. Compiled calls take ``PACK`` tensors at a time; two graphs (``PACK``
tensors, one tensor) with dynamic shapes serve every size and storage offset, and ``lr`` and the decay
are 0-d tensors, so LR schedules do not recompile.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor

SIGN_UPDATES = ("auto", "compiled", "eager")
AUTO_MIN_NUMEL = 1 << 16
PACK = 8  # tensors per compiled call: a call costs ~20 us of Python, as much as a 1M-element pass
_COMPILED_DEVICES = ("cpu", "cuda")

_compiled: dict[tuple, object] = {}  # (tensors per call, with decay) -> compiled function
_unavailable: dict[str, str] = {}  # device type -> why compiling failed ("auto" stays eager there)


def _sign_step(params, grads, lr: Tensor) -> None:
    """One pass per tensor: ``p <- round(p - lr * sign(g))`` in ``lr``'s dtype (the op-math type:
    float32 for 16-bit weights), rounding to ``p``'s dtype as eager ``add_`` does. ``lr * sign(g)``
    is a choice between lr, -lr and 0 (as torch.sign: 0 for g = 0 and NaN), fewer instructions than
    sign then multiply."""
    zero = torch.zeros_like(lr)
    for p, g in zip(params, grads):
        step = torch.where(g > 0, lr, torch.where(g < 0, -lr, zero))
        p.copy_((p.to(lr.dtype) - step).to(p.dtype))


def _sign_step_decayed(params, grads, lr: Tensor, decay: Tensor) -> None:
    """``_sign_step`` after decoupled weight decay, rounded as eager ``mul_`` then ``add_``:
    ``p <- round(round(p * decay) - lr * sign(g))`` (a separate function: no multiply without decay)."""
    zero = torch.zeros_like(lr)
    for p, g in zip(params, grads):
        x = (p.to(lr.dtype) * decay).to(p.dtype).to(lr.dtype)
        step = torch.where(g > 0, lr, torch.where(g < 0, -lr, zero))
        p.copy_((x - step).to(p.dtype))


def _kernel(count: int, decayed: bool):
    """The compiled pass over ``count`` tensors of any sizes (a graph per count and dtype)."""
    if (count, decayed) not in _compiled:
        # emulate_precision_casts keeps the intermediate rounding to bf16/fp16 that eager does
        # (and turns off Triton's FMA contraction, which would skip a rounding on CUDA).
        _compiled[count, decayed] = torch.compile(_sign_step_decayed if decayed else _sign_step,
                                                  dynamic=True, fullgraph=True,
                                                  options={"emulate_precision_casts": True})
    return _compiled[count, decayed]


def _plain(t: Tensor) -> Tensor:
    """``t`` flat, as a tensor of its own that starts its storage (a DLPack alias: no copy, writes go
    through). Dynamo specialises a graph on whether each input's storage offset is 0, so a pack of DDP
    bucket or FSDP2 views could need 2^PACK graphs and hit the recompile limit."""
    return torch.from_dlpack(t.detach().view(-1))


def _call(params: list[Tensor], grads: list[Tensor], lr: Tensor, decay: Tensor | None) -> None:
    # Without "duck shaping" every tensor size is its own symbol: no guard on which sizes are
    # equal, so one graph serves any PACK tensors (of at least 2 elements: sizes 0 and 1 are
    # specialised). The setting is read when dynamo traces, i.e. on a first call.
    scalars = (lr,) if decay is None else (lr, decay)
    with fx_config.patch(use_duck_shape=False):
        _kernel(len(params), decay is not None)([_plain(p) for p in params], [_plain(g) for g in grads], *scalars)


def _use_compiled(mode: str, p: Tensor, g: Tensor) -> bool:
    if mode == "eager" or not (p.is_contiguous() and g.is_contiguous()) or p.numel() < 2:
        return False
    if mode == "compiled":
        return True
    return (p.numel() >= AUTO_MIN_NUMEL and p.device.type in _COMPILED_DEVICES
            and p.device.type not in _unavailable)


def _scalars(p: Tensor, lr: float, decay: float) -> tuple[Tensor, Tensor | None]:
    opmath = torch.promote_types(p.dtype, torch.float32)
    # torch.full, not torch.tensor: no blocking host-to-device copy on CUDA.
    lr_t = torch.full((), lr, dtype=p.dtype, device=p.device).to(opmath)  # add_ rounds alpha so
    return lr_t, None if decay == 1.0 else torch.full((), decay, dtype=opmath, device=p.device)


def _eager(params: list[Tensor], grads: list[Tensor], lr: float, decay: float) -> None:
    if not params:
        return
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
    for p, g in zip(params, grads):  # one sign(g) temporary at a time, not one per tensor
        p.add_(torch.sign(g), alpha=-lr)


def sign_update_(params: list[Tensor], grads: list[Tensor], *, lr: float, decay: float = 1.0,
                 mode: str = "auto") -> None:
    """``p <- p * decay - lr * sign(g)`` for every pair, in place; ``grads`` are only read.
    All tensors share one device and dtype (the optimizer buckets them so)."""
    if mode not in SIGN_UPDATES:
        raise ValueError(f"Invalid sign_update: {mode!r}; valid choices: {', '.join(SIGN_UPDATES)}")
    eager_p, eager_g, fast_p, fast_g = [], [], [], []
    for p, g in zip(params, grads):
        compiled = _use_compiled(mode, p, g)
        (fast_p if compiled else eager_p).append(p)
        (fast_g if compiled else eager_g).append(g)
    if fast_p:
        scalars = _scalars(fast_p[0], lr, decay)
        # packs of PACK tensors, the rest one by one: two graphs, whatever the number of tensors
        cuts = list(range(0, len(fast_p) - len(fast_p) % PACK, PACK))
        calls = [slice(i, i + PACK) for i in cuts]
        calls += [slice(i, i + 1) for i in range(len(cuts) * PACK, len(fast_p))]
        for part in calls:
            try:
                _call(fast_p[part], fast_g[part], *scalars)
            except Exception as err:  # compile errors surface at a first call, before p is written
                if mode == "compiled":
                    raise RuntimeError(f"sign_update='compiled' could not compile the sign update on "
                                       f"{fast_p[0].device.type}: {err}. Use sign_update='auto' "
                                       "(falls back to eager ops) or 'eager'.") from err
                device = fast_p[0].device.type
                if device not in _unavailable:
                    _unavailable[device] = f"{type(err).__name__}: {err}"
                    warnings.warn(f"FRUGAL: the compiled sign update is unavailable on {device} "
                                  f"({_unavailable[device]}); using eager ops (same results, slower). "
                                  "Pass sign_update='eager' to silence this.", RuntimeWarning, stacklevel=2)
                eager_p += fast_p[part]
                eager_g += fast_g[part]
    _eager(eager_p, eager_g, lr, decay)


def stochastic_round_(dst: Tensor, src: Tensor, generator: torch.Generator | None = None) -> None:
    """Write float32 ``src`` into bfloat16 ``dst`` rounding up or down at random with probability
    proportional to the distance (unbiased: E[dst] = src): uniform 16-bit noise added to the lower bits,
    then truncated. Keeps updates below half a bf16 ulp from being lost (a weight of 1.0 has ulp 2^-7:
    round-to-nearest never moves it by a sign step of lr = 1e-4). Non-finite values are copied as they are.
    """
    if dst.dtype != torch.bfloat16 or src.dtype != torch.float32:
        raise TypeError(f"stochastic_round_ writes float32 into bfloat16, got {src.dtype} -> {dst.dtype}")
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    bits = (src.view(torch.int32) + noise).bitwise_and_(-65536)  # -65536 = 0xFFFF0000
    rounded = torch.where(torch.isfinite(src), bits.view(torch.float32), src)
    dst.copy_(rounded)  # exact: the low 16 bits are zero
