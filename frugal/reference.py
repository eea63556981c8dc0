"""Algorithm 1 for one tensor, written as the paper states it: the reference of the fast path.

``FRUGAL(foreach=False)`` runs every tensor through ``update_tensor``; the default fast path
(``FRUGAL.step``: fused multi-tensor kernels, gathers and scatters, weight decay fused into the
state-free pass) is tested against it. bfloat16 weights with ``stochastic_rounding=True`` take
this path too, since the new weights must exist in float32 before they are rounded.

    theta <- theta (1 - lr wd) - lr_full P^{-1}(d_full(P(g))) - lr_free d_free(g - P^{-1}(P(g)))

computed in float32 (at least) and rounded once into the weights. A tensor's role
(``frugal.windows``) decides P: ``FULL`` (the identity: non-projectable tensors, active blocks),
``FREE`` (zero: inactive blocks, ``always_state_free`` groups) or ``SPLIT`` (a coordinate or matrix
projection, ``frugal.state_management``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import projections as proj
from . import sharding, state_management, state_precision
from .kernels import stochastic_round_
from .rules import STATE_FREE, STATE_FULL, FreeContext, SplitContext
from .windows import FREE, FULL


def update_tensor(param: Tensor, grad: Tensor, group: dict, state: dict, role: str, ident: int,
                  step: int, window: int) -> None:
    """One step of one tensor (``grad``: its local values; ``param`` may be an FSDP2 DTensor) in
    subspace window ``window``."""
    p = sharding.local(param)
    full_rule, free_rule = STATE_FULL[group["state_full"]], STATE_FREE[group["state_free"]]
    rule_kwargs = {"betas": tuple(group["betas"]), "eps": group["eps"], "momentum": group["momentum"],
                   **{k: group[k] for k in full_rule.options}}
    lr = group["lr"]
    lr_full = lr * group["projectable_lr_scale"] if group["projectable"] else lr
    lr_free = lr * group["state_free_lr_scale"]
    new = p.to(torch.promote_types(p.dtype, torch.float32))
    decay = 1.0 - lr * group["weight_decay"]
    if role == FULL:
        full_rule.init_state(state, param, group=group)
        whole = {"like": param} if full_rule.gathers else {}  # Muon gathers an FSDP2 shard's matrix
        if state_precision.storage(group, p.numel()) != "param":  # moments decoded a chunk at a time
            _full_low_precision(p, grad, state, full_rule, rule_kwargs, lr_full, decay, _rounding(param, group, step,
                                                                                                  ident))
            return
        d = full_rule.direction(grad, {k: sharding.local(v) for k, v in state.items()}, **rule_kwargs, **whole)
        new = (new - lr_full * d) * decay if full_rule.decays_after else new * decay - lr_full * d
    elif role == FREE:
        new *= decay
        if free_rule.direction is not None:
            new -= lr_free * free_rule.direction(grad)
    else:
        projection, transposed = group["projection"], group["transposed"]
        if projection in proj.MATRIX:  # with error feedback (LDAdam) a = g + e
            sub, g_full, a = state_management.split_matrix(state, full_rule, p, grad, group, window, ident)
        else:
            sub = state_management.coordinates(state, full_rule, p, group, window, ident,
                                               sharding.shard_key(param, group))
            g_full, a = proj.project(grad, projection, transposed, sub), grad
        dim, flip = proj.reduced_dim(projection, p.shape, transposed)
        if free_rule.init_state is not None:
            free_rule.init_state(state, p.t() if flip else p, dim)
        lift = lambda x: proj.project_back(x, p.shape, projection, transposed, sub)  # noqa: E731
        if free_rule.split_step is not None:  # Fira: the rule takes the whole step
            free_rule.split_step(new, state, SplitContext(a, g_full, lift, dim, flip, full_rule, group))
        else:
            new *= decay
            d_full = full_rule.direction(g_full, state, **rule_kwargs)
            new -= lr_full * lift(d_full)
            if free_rule.contextual is not None:  # AdaMeM: the rule reads the split
                g_free = a - lift(g_full)
                d = free_rule.contextual(g_free.t() if flip else g_free, state, FreeContext(g_full, dim, group))
                new -= lr_free * (d.t() if flip else d)
            elif free_rule.direction is not None:
                new -= lr_free * free_rule.direction(a - lift(g_full))
    _write(p, new, _rounding(param, group, step, ident))


def _rounding(param: Tensor, group: dict, step: int, ident: int) -> torch.Generator | None:
    """The generator of the stochastic rounding of bf16 weights (None: round to nearest): a pure
    function of (seed, step, tensor[, shard]), so reruns and resumed runs round alike."""
    if not (group["stochastic_rounding"] and param.dtype == torch.bfloat16):
        return None
    seed = proj.mix_seed(group["seed"], step, ident, *sharding.mesh_coordinate(param))
    return torch.Generator(device=sharding.local(param).device).manual_seed(seed)


def _write(p: Tensor, new: Tensor, generator: torch.Generator | None) -> None:
    if generator is not None:
        stochastic_round_(p, new, generator)
    else:
        p.copy_(new)


def _full_low_precision(p: Tensor, grad: Tensor, state: dict, rule, rule_kwargs: dict, lr: float, decay: float,
                        generator: torch.Generator | None) -> None:
    """A wholly state-full tensor whose moments are stored in low precision (``frugal.state_precision``):
    the same update as above, a chunk at a time, so the float32 copies stay small."""
    dtype = torch.promote_types(p.dtype, torch.float32)
    flat_p, flat_g = p.view(-1), grad.reshape(-1)
    for start, stop in state_precision.chunks(flat_p.numel()):
        moments = state_precision.decode_chunk(state, rule, start, stop, dtype)
        d = rule.direction(flat_g[start:stop].to(dtype), moments, **rule_kwargs)
        new = flat_p[start:stop].to(dtype)
        new = (new - lr * d) * decay if rule.decays_after else new * decay - lr * d
        _write(flat_p[start:stop], new, generator)
        state_precision.encode_chunk(state, rule, start, stop, moments)
    state_precision.advance(state, rule)
