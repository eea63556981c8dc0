"""Algorithm 1 for one tensor, written as the paper states it: the reference of the fast path.

``FRUGAL(foreach=False)`` runs every tensor through ``update_tensor``; the default fast path
(``FRUGAL.step``: fused multi-tensor kernels, gathers and scatters, weight decay fused into the
state-free pass) is tested against it. bfloat16 weights with ``stochastic_rounding=True`` take
this path too, since the new weights must exist in float32 before they are rounded.

    theta <- theta (1 - lr wd) - lr_full P^{-1}(d_full(P(g))) - lr_free d_free(g - P^{-1}(P(g)))

computed in float32 (at least) and rounded once into the weights. A tensor's role decides P:
``FULL`` (the identity: non-projectable tensors, active blocks), ``FREE`` (zero: inactive blocks,
``always_state_free`` groups) or ``SPLIT`` (a coordinate or matrix projection, ``frugal.state_management``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import projections as proj
from . import sharding, state_management
from .kernels import stochastic_round_
from .rules import STATE_FREE, STATE_FULL, FreeContext

FULL, FREE, SPLIT = "state-full", "state-free", "split"


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
    new = p.to(torch.promote_types(p.dtype, torch.float32)) * (1.0 - lr * group["weight_decay"])
    if role == FULL:
        full_rule.init_state(state, param)
        whole = {"like": param} if full_rule.gathers else {}  # Muon gathers an FSDP2 shard's matrix
        new -= lr_full * full_rule.direction(grad, {k: sharding.local(v) for k, v in state.items()}, **rule_kwargs,
                                             **whole)
    elif role == FREE:
        if free_rule.direction is not None:
            new -= lr_free * free_rule.direction(grad)
    else:
        projection, transposed = group["projection"], group["transposed"]
        a, moved = grad, None
        if group["error_feedback"]:  # LDAdam: the step reads g + e (kept in the buffer)
            a, moved = state_management.feedback_begin(state, grad), {}
        if projection in proj.MATRIX:
            sub = state_management.matrix(state, full_rule, p, a, group, window, ident, moved)
        else:
            sub = state_management.coordinates(state, full_rule, p, group, window, ident,
                                               sharding.shard_key(param, group))
        g_full = proj.project(a, projection, transposed, sub)
        if group["error_feedback"]:
            state_management.feedback_end(state, group, p, g_full, sub, moved)
        d_full = full_rule.direction(g_full, state, **rule_kwargs)
        new -= lr_full * proj.project_back(d_full, p.shape, projection, transposed, sub)
        if free_rule.contextual is not None:  # Fira, AdaMeM: the rule reads the split
            dim, flip = proj.reduced_dim(projection, p.shape, transposed)
            g_free = a - proj.project_back(g_full, p.shape, projection, transposed, sub)
            residual = g_free.t() if flip else g_free
            free_rule.init_state(state, p.t() if flip else p, dim)
            d = free_rule.contextual(residual, state, FreeContext(g_full, d_full, dim, group))
            new -= lr_free * (d.t() if flip else d)
        elif free_rule.direction is not None:
            g_free = a - proj.project_back(g_full, p.shape, projection, transposed, sub)
            new -= lr_free * free_rule.direction(g_free)
    if group["stochastic_rounding"] and p.dtype == torch.bfloat16:
        # a pure function of (seed, step, tensor[, shard]): reruns and resumed runs round alike
        seed = proj.mix_seed(group["seed"], step, ident, *sharding.mesh_coordinate(param))
        stochastic_round_(p, new, torch.Generator(device=p.device).manual_seed(seed))
    else:
        p.copy_(new)
