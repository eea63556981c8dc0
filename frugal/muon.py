"""Muon as FRUGAL's state-full rule (``state_full="muon"``), with torch's hyperparameters.

Muon (Keller Jordan, 2024; ``torch.optim.Muon``) keeps one momentum buffer per element and
replaces the update of a weight matrix by an approximately orthogonalised version of its
(Nesterov) momentum, computed by a few Newton-Schulz iterations. Per target matrix ``t`` with
gradient ``g`` and buffer ``b`` (torch's formulation, ``torch/optim/_muon.py``)::

    b <- momentum * b + (1 - momentum) * g                 (torch: b.lerp_(g, 1 - momentum))
    u <- g + momentum * (b - g)  if nesterov  else  b       (torch: g.lerp(b, momentum))
    O <- NS(u)                   ns_steps quintic iterations with ns_coefficients, in bfloat16,
                                 on the matrix scaled to unit Frobenius norm (floor eps)
    t <- t * (1 - lr * weight_decay) - lr * adjust(A, B) * O

with ``adjust`` from ``adjust_lr_fn``: ``"original"`` (Keller Jordan's ``sqrt(max(1, A/B))``) or
``"match_rms_adamw"`` (Moonshot's "Muon is Scalable for LLM Training", arXiv:2502.16982:
``0.2 * sqrt(max(A, B))``, the RMS of a typical AdamW update, so that one learning rate serves the
AdamW, Muon and sign parts). ``A x B`` is the logical shape (a GPT-2 ``Conv1D`` weight, stored
``(in, out)``, is read as its transpose). State: ``momentum_buffer`` (torch's name), no step counter.

Inside FRUGAL (docs/muon.md) it runs on whole matrices (``projection="block"``; groups built from a
model give the other tensors AdamW: ``REST``) and on the columns (rows) a ``column`` (``row``)
projection selects; other projections are refused (``check_group``). FSDP2: only the orthogonalised
matrix of an active block is all-gathered (bfloat16; ``gathered_bytes()``), each rank applies its shard.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .checks import HyperparameterError, check_integer
from .rules import StateFullRule, register_state_full
from .sharding import is_dtensor, local

# Keller Jordan's quintic coefficients and step count, as torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
ADJUST_LR_FNS = ("original", "match_rms_adamw")
# Projections whose state-full part is a matrix Muon can orthogonalise.
PROJECTIONS = ("block", "column", "row")
# The rule's own hyperparameters (torch.optim.Muon's) with their defaults (``StateFullRule.options``).
OPTIONS = {"nesterov": True, "ns_steps": NS_STEPS, "ns_coefficients": NS_COEFFICIENTS,
           "adjust_lr_fn": "match_rms_adamw"}

_gathered = [0]


def gathered_bytes() -> int:
    """Bytes of the whole matrices this process all-gathered from sharded (FSDP2) parameters since
    the last ``reset_gathered_bytes()`` (bfloat16: 2 bytes per element; (world - 1) / world of it
    crosses the network)."""
    return _gathered[0]


def reset_gathered_bytes() -> None:
    _gathered[0] = 0


def newton_schulz(u: Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = 1e-7) -> Tensor:
    """The approximate orthogonalisation of ``u`` (2-D), in bfloat16: ``steps`` quintic iterations
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on the wide orientation, from ``X = u / max(|u|_F, eps)``.
    Torch's iteration (``torch.optim._muon._zeropower_via_newtonschulz``), written out."""
    a, b, c = coefficients
    x = u.bfloat16()
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def lr_ratio(shape, adjust_lr_fn: str, transposed: bool = False) -> float:
    """Muon's update scale for a matrix of stored ``shape`` (logical: ``(B, A)`` stored when transposed)."""
    rows, cols = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise HyperparameterError(f"Invalid adjust_lr_fn: {adjust_lr_fn!r}; valid choices: {', '.join(ADJUST_LR_FNS)}")


def _orthogonalise(u_local: Tensor, like: Tensor, coefficients, steps, eps) -> Tensor:
    """NS of the whole matrix whose local part is ``u_local``; ``like`` (the parameter) tells
    whether it is an FSDP2 shard. Returns the local part of the result (bfloat16)."""
    if not is_dtensor(like):
        return newton_schulz(u_local, coefficients, steps, eps)
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = like.device_mesh, like.placements
    part = u_local.bfloat16()
    whole = DTensor.from_local(part, mesh, placements, shape=like.shape, stride=like.stride(),
                               run_check=False).full_tensor()
    _gathered[0] += whole.numel() * whole.element_size()
    result = newton_schulz(whole, coefficients, steps, eps)
    replicated = DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements).to_local()  # a local slice: no communication


def _step(t: Tensor, g: Tensor, buf: Tensor, *, lr, weight_decay, momentum, eps, nesterov, ns_steps,
          ns_coefficients, adjust_lr_fn, transposed) -> None:
    """One Muon step of one target (``t``, ``g``, ``buf`` may be FSDP2 DTensors)."""
    lt, lg, lb = local(t), local(g), local(buf)
    lb.lerp_(lg, 1.0 - momentum)
    u = lg.lerp(lb, momentum) if nesterov else lb
    update = _orthogonalise(u, t, ns_coefficients, ns_steps, eps)
    if weight_decay:
        lt.mul_(1.0 - lr * weight_decay)
    lt.add_(update, alpha=-lr * lr_ratio(t.shape, adjust_lr_fn, transposed))


def muon_(targets, grads, states, steps, *, lr, betas, eps, weight_decay, momentum=0.95, nesterov=True,
          ns_steps=NS_STEPS, ns_coefficients=NS_COEFFICIENTS, adjust_lr_fn="match_rms_adamw",
          transposed=False):
    """The foreach form of ``frugal.rules``: one matrix at a time (the iteration is per matrix).
    ``targets``/``grads``/buffers may be FSDP2 DTensors (module docstring); empty ones (a
    ``column`` projection keeping no column) are skipped."""
    (bufs,) = states
    for t, g, buf in zip(targets, grads, bufs):
        if t.numel() == 0:
            continue
        _step(t, g, buf, lr=lr, weight_decay=weight_decay, momentum=momentum, eps=eps, nesterov=nesterov,
              ns_steps=ns_steps, ns_coefficients=ns_coefficients, adjust_lr_fn=adjust_lr_fn, transposed=transposed)


def muon_direction(grad, state, *, betas, eps, momentum=0.95, nesterov=True, ns_steps=NS_STEPS,
                   ns_coefficients=NS_COEFFICIENTS, adjust_lr_fn="match_rms_adamw", transposed=False, like=None):
    """The direction form (``p <- p - lr * d``): ``d = adjust(A, B) * NS(u)``, the buffer advanced.
    ``like``: the parameter when ``grad``/the buffer are its FSDP2 shards' local parts."""
    if grad.numel() == 0:
        return torch.zeros_like(grad)
    buf = local(state["momentum_buffer"])
    buf.lerp_(grad, 1.0 - momentum)
    u = grad.lerp(buf, momentum) if nesterov else buf
    like = grad if like is None else like
    update = _orthogonalise(u, like, ns_coefficients, ns_steps, eps)
    return update.to(grad.dtype) * lr_ratio(like.shape, adjust_lr_fn, transposed)


def check_group(group: dict) -> None:
    """Refuse, at construction, what Muon cannot update: a projection without a reduced matrix, a
    tensor it would update whole that is not 2-D, a split of an FSDP2 shard (its selected columns
    or rows are spread over the ranks; block projection gathers whole matrices)."""
    if group.get("always_state_free"):
        return
    projectable = group.get("projectable", False)
    projection = group["projection"]
    if projectable and projection not in PROJECTIONS:
        raise HyperparameterError(
            f"state_full 'muon' orthogonalises a matrix, but projection {projection!r} has no reduced matrix "
            f"to orthogonalise; valid projections with state_full 'muon': {', '.join(PROJECTIONS)}")
    whole = not projectable or projection == "block"
    for p in group["params"]:
        if p.dim() != 2:
            raise HyperparameterError(
                f"state_full 'muon' updates 2-D matrices; this group holds a tensor of shape {tuple(p.shape)} "
                f"{'that it would update whole' if whole else 'to split'}; give such tensors state_full='adamw' "
                "in a group of their own, or pass the model, FRUGAL(model, state_full='muon'), or use "
                "frugal.build_optimizer(model, 'frugal_muon'), which give embeddings, norms, biases and the "
                "output layer AdamW")
        if not whole and is_dtensor(p):
            raise HyperparameterError(
                f"state_full 'muon' with projection {projection!r} would orthogonalise columns/rows spread over "
                f"the FSDP2 shards of a tensor of shape {tuple(p.shape)}; valid projection for sharded "
                "parameters with state_full 'muon': block")


def check_options(hparams: dict) -> dict:
    """Validate and normalise Muon's keys present in ``hparams`` (others pass through)."""
    out = dict(hparams)
    if "nesterov" in out and not isinstance(out["nesterov"], bool):
        raise HyperparameterError(f"Invalid nesterov: {out['nesterov']!r} (expected True or False)")
    if "adjust_lr_fn" in out and out["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise HyperparameterError(
            f"Invalid adjust_lr_fn: {out['adjust_lr_fn']!r}; valid choices: {', '.join(ADJUST_LR_FNS)}")
    if "ns_steps" in out:
        n = check_integer("ns_steps", out["ns_steps"], 1, integral_floats=True)
        if n >= 100:  # torch's limit
            raise HyperparameterError(f"Invalid ns_steps: {n!r} (expected an integer in [1, 99])")
        out["ns_steps"] = n
    if "ns_coefficients" in out:
        c = out["ns_coefficients"]
        ok = not isinstance(c, (str, bytes)) and hasattr(c, "__len__") and len(c) == 3 and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) for x in c)
        if not ok:
            raise HyperparameterError(f"Invalid ns_coefficients: {c!r} (expected three finite numbers (a, b, c))")
        out["ns_coefficients"] = tuple(float(x) for x in c)
    return out


# One momentum buffer, its Nesterov mix orthogonalised by Newton-Schulz; AdamW on what is not a matrix where
# the groups are built from a model.
REST = ("adamw", "Muon orthogonalises the weight matrices of the transformer blocks: norms and biases are not "
                 "matrices, and embeddings and the output head take AdamW as Muon's authors and "
                 "torch.optim.Muon's docs prescribe")
register_state_full("muon", StateFullRule(muon_, muon_direction, ("momentum_buffer",), False, options=OPTIONS,
                                          group_keys=("transposed",), gathers=True, check=check_group,
                                          default_momentum=0.95, validate_options=check_options, rest=REST))
