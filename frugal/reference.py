"""Algorithm 1 for one tensor, written as the paper states it: the reference of the fast path.

``FRUGAL(foreach=False)`` runs every tensor through ``update_tensor``; the default fast path
(``FRUGAL.step``: fused multi-tensor kernels, gathers and scatters, weight decay fused into the
state-free pass) is tested against it. bfloat16 weights with ``stochastic_rounding=True`` take
this path too, since the new weights must exist in float32 before they are rounded.

    theta <- theta (1 - lr wd) - lr_full P^{-1}(d_full(P(g))) - lr_free d_free(g - P^{-1}(P(g)))

computed in float32 (at least) and rounded once into the weights. A tensor's role
(``frugal.windows``) decides P: ``FULL`` (the identity: non-projectable tensors, active blocks),
``FREE`` (zero: inactive blocks, ``always_state_free`` groups) or ``SPLIT`` (a coordinate or matrix
projection, ``frugal.state_management``). How bf16 weights are executed (a float32 master copy, whole
tensors of elementwise rules a chunk at a time, stochastic rounding) is ``frugal.state_precision``'s.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import projections as proj
from . import sharding, state_management, state_precision
from .rules import STATE_FREE, STATE_FULL, FreeContext, SplitContext, keywords
from .windows import FREE, FULL, SPLIT


def update_tensor(param: Tensor, grad: Tensor, group: dict, state: dict, role: str, ident: int,
                  step: int, window: int) -> None:
    """One step of one tensor (``grad``: its local values; ``param`` may be an FSDP2 DTensor) in
    subspace window ``window``."""
    p = sharding.local(param)
    full_rule, free_rule = STATE_FULL[group["state_full"]], STATE_FREE[group["state_free"]]
    rule_kwargs = {"betas": tuple(group["betas"]), "eps": group["eps"], "momentum": group["momentum"],
                   **keywords(full_rule, group)}
    free_kwargs = keywords(free_rule, group)
    lr = group["lr"]
    lr_full = lr * group["projectable_lr_scale"] if group["projectable"] else lr
    lr_free = lr * group["state_free_lr_scale"]
    decay = 1.0 - lr * group["weight_decay"]
    master = state_precision.master(state, param, group) if role == FULL and group["master_weights"] else None
    if master is not None:  # master_weights: this step on the float32 copy, which is then rounded in
        update_tensor(master, grad.float(), group, state, role, ident, step, window)
        p.copy_(sharding.local(master))
        return
    if role == FULL:
        full_rule.init_state(state, param, group=group)
    generator = state_precision.rounding(param, group, step, ident)
    if role != SPLIT and (full_rule if role == FULL else free_rule).elementwise:  # a chunk at a time
        state_precision.whole_in_chunks(p, grad, state, group, full_rule if role == FULL else None, free_rule,
                                        rule_kwargs, free_kwargs, lr_full, lr_free, decay, generator)
        return
    new = p.to(torch.promote_types(p.dtype, torch.float32))
    if role == FULL:
        whole = {"like": param} if full_rule.gathers else {}  # Muon gathers an FSDP2 shard's matrix
        d = full_rule.direction(grad, {k: sharding.local(v) for k, v in state.items()}, **rule_kwargs, **whole)
        new = (new - lr_full * d) * decay if full_rule.decays_after else new * decay - lr_full * d
    elif role == FREE:
        new *= decay
        if free_rule.direction is not None:
            new -= lr_free * free_rule.direction(grad, **free_kwargs)
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
                new -= lr_free * free_rule.direction(a - lift(g_full), **free_kwargs)
    state_precision.write(p, new, generator)
