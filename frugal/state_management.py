"""Optimizer state management (Appendix C): a projected tensor's state-full subspace, window by
window, and what its state becomes when the subspace changes.

Algorithm 1, line 7: when the projection changes from ``P_{w'}`` to ``P_w`` the state ``s`` becomes
``P_w(P_{w'}^{-1}(s))``. ``reset_state`` picks what the optimizer does instead of (or as) that:

- ``reset`` (default): entering coordinates start from zero state (Appendix C: "reset the state
  before a new round"); for coordinate projections a new window draws a new coordinate set, so the
  whole reduced state restarts, including the bias-correction count.
- ``reproject``: Appendix C's re-projection. Exact for coordinate bases (the moments of coordinates
  that stay selected move to their new position, entering ones start at zero, the step count is
  kept); for matrix bases first moments map through ``R = Q_old^T Q_new`` with the norm kept
  (the paper's momentum-mass correction) and second moments through ``R * R``.
- ``keep``: the stale state as it is (GaLore).

Selecting every coordinate (or none) is an unchanged projection and keeps the state.

The subspace is kept as tensors in the state (``index``: sorted coordinates; ``proj``: Q) with
``window``, the window it was chosen in, so a resumed run continues with the same subspace.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import projections as proj
from .rules import StateFullRule


def coordinates(state: dict, rule: StateFullRule, p: Tensor, group: dict, window: int, ident: int,
                shard=()) -> Tensor:
    """The sorted indices of ``p``'s state-full coordinates in ``window``, the state carried over."""
    projection, transposed, density = group["projection"], group["transposed"], group["density"]
    if state.get("window") == window:
        rule.init_state(state, p, state[rule.state_names[0]].shape)
        return state["index"]
    idx = proj.coordinate_indices(projection, p.shape, transposed, density, group["seed"], window,
                                  ident, device=p.device, shard=shard)
    dim = proj.coordinate_dim(projection, p.shape, transposed)
    mode = group["reset_state"] if "window" in state else "reset"
    if "window" in state and idx.numel() in (0, p.numel() if dim is None else p.shape[dim]):
        mode = "keep"  # all (or nothing) stays selected: an unchanged projection keeps its state
    if mode == "reproject":
        for name in rule.state_names:
            state[name] = _move_coordinates(state[name], state["index"], idx, 0 if dim is None else dim)
    elif mode == "reset":
        state.clear()  # before the new state is allocated: peak = resting state + one tensor
    state["index"], state["window"] = idx, window
    rule.init_state(state, p, proj.reduced_shape(projection, p.shape, transposed, density))
    return idx


def _move_coordinates(old: Tensor, old_idx: Tensor, new_idx: Tensor, dim: int) -> Tensor:
    """Reduced state for ``new_idx`` holding ``old``'s values where the coordinate stays selected,
    zero where it enters (no full-size temporary: both index sets are sorted)."""
    shape = list(old.shape)
    shape[dim] = new_idx.numel()
    new = torch.zeros(shape, dtype=old.dtype, device=old.device)
    if old_idx.numel() == 0 or new_idx.numel() == 0:
        return new
    pos = torch.searchsorted(old_idx, new_idx).clamp_(max=old_idx.numel() - 1)
    stays = old_idx[pos] == new_idx
    new.index_copy_(dim, stays.nonzero().flatten(), old.index_select(dim, pos[stays]))
    return new


def matrix(state: dict, rule: StateFullRule, p: Tensor, grad: Tensor, group: dict, window: int,
           ident: int) -> Tensor:
    """The orthonormal basis Q of ``p``'s state-full subspace in ``window`` (svd: of this step's
    gradient, at the first step of a window), the state carried over."""
    projection, transposed, density = group["projection"], group["transposed"], group["density"]
    if state.get("window") != window:
        q = proj.matrix_projection(projection, grad, transposed, density, group["seed"], window, ident)
        mode = group["reset_state"] if "window" in state else "reset"
        if mode == "reproject":
            _reproject(state, rule, state["proj"], q, proj.matrix_side(p.shape, transposed))
        elif mode == "reset":
            state.clear()
        state["proj"], state["window"] = q, window
    rule.init_state(state, p, proj.reduced_shape(projection, p.shape, transposed, density))
    return state["proj"]


def _reproject(state: dict, rule: StateFullRule, q_old: Tensor, q_new: Tensor, side: str) -> None:
    """Appendix C: carry the moments into the new basis. First moments map through
    R = Q_old^T Q_new and are rescaled to keep their norm (the paper's momentum-mass
    correction); second moments map through R*R, exact when the bases are coordinate-aligned."""
    r = q_old.t() @ q_new
    for name in rule.state_names:
        s = state[name]
        mix = r * r if name == "exp_avg_sq" else r
        new = s @ mix if side == "right" else mix.t() @ s
        if name != "exp_avg_sq":
            new.mul_(s.norm() / new.norm().clamp_min(torch.finfo(new.dtype).tiny))
        state[name] = new
