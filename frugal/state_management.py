"""Optimizer state management (Appendix C): a projected tensor's state-full subspace, window by
window, and what its state becomes when the subspace changes (Algorithm 1, line 7:
``s <- P_w(P_{w'}^{-1}(s))``). ``reset_state`` (docs/library.md, "State at a window change"):

- ``reset`` (default, the main text): entering coordinates start from zero state; a coordinate
  projection draws a new set each window, so its whole reduced state restarts (step count too). A
  block that stays state-full keeps its state, as does a subspace of every coordinate (density 1 is AdamW).
- ``reset_all``: the appendix pseudocode (``block_step``, ``svd_or_randk_step``) and the authors'
  code: every state-full block or subspace restarts at every boundary, staying ones too
  (``restart_block``); the paper presets set it.
- ``reset_everything``: ``reset_all`` plus the non-projectable tensors (the ``badam`` package's
  ``BlockOptimizer``); with ``master_weights`` the float32 copy restarts from the rounded weights.
- ``reproject``: exact for coordinate bases (staying coordinates' moments move, entering ones start
  at zero, the count is kept); matrix bases map first moments through ``R = Q_old^T Q_new`` with the
  norm kept (momentum-mass correction) and second moments through ``R * R``.
- ``keep``: the stale state (GaLore); a subspace of another size (density schedule) restarts.
- ``transport`` (matrix projections, AdamW; LDAdam): ``frugal.subspace.reproject_moments``; the count goes on.

Selecting every coordinate (or none) is an unchanged projection and keeps the state. Only the
state-full rule's state restarts: a contextual state-free rule's state and LDAdam's error buffer
outlive every change. ``power`` and error feedback (LDAdam): docs/concurrent_methods.md; ``p.grad``
is never written. The subspace is kept in the state (``index``: sorted coordinates; ``proj``: Q)
with ``window``, so a resumed run continues with it. The end of the module: checkpoint support.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import projections as proj
from . import state_precision
from .checks import HyperparameterError
from .hparams import resolve_momentum
from .rules import STATE_FREE, STATE_FULL, StateFullRule
from .sharding import local, shard_key
from .windows import FREE, FULL, Layout

# Modes under which every state-full subspace restarts at every window boundary (staying ones too).
RESTART_EVERY_WINDOW = ("reset_all", "reset_everything")


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
    whole = p.numel() if dim is None else p.shape[dim]
    if mode not in RESTART_EVERY_WINDOW and "window" in state and idx.numel() in (0, whole) \
            and idx.numel() == state["index"].numel():
        mode = "keep"  # all (or nothing) stays selected: an unchanged projection keeps its state
    if mode == "keep" and "index" in state and state["index"].numel() != idx.numel():
        mode = "reset"  # another number of coordinates (a density schedule): the old state does not fit
    if mode == "reproject":
        for name in rule.state_names:
            state[name] = _move_coordinates(state[name], state["index"], idx, 0 if dim is None else dim)
    elif mode == "reset" or mode in RESTART_EVERY_WINDOW:
        drop_full_state(state, rule)  # before the new state is allocated: peak = resting state + one tensor
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


def restart_block(state: dict, rule: StateFullRule, group: dict, window: int) -> None:
    """A state-full block (under ``reset_everything`` any state-full tensor) in ``window``: under
    ``RESTART_EVERY_WINDOW`` its state restarts when ``window`` is not ``state["window"]``;
    otherwise nothing (``reset``: what enters starts fresh because leaving dropped it)."""
    if group["reset_state"] in RESTART_EVERY_WINDOW and state.get("window") != window:
        drop_full_state(state, rule)
        state["window"] = window


def drop_full_state(state: dict, rule: StateFullRule) -> None:
    """Forget the state-full rule's state (moments, step count, subspace, the float32 master copy of
    ``master_weights``); keep the rest."""
    for name in rule.state_names:
        state_precision.drop(state, name)
    for name in ("step", "index", "proj", "window", state_precision.MASTER):
        state.pop(name, None)


def matrix(state: dict, rule: StateFullRule, p: Tensor, grad: Tensor, group: dict, window: int,
           ident: int, moved: dict | None = None) -> Tensor:
    """The orthonormal basis Q of ``p``'s state-full subspace in ``window``, the state carried over.
    ``grad``: what the step projects (with error feedback ``g + e``). ``moved`` receives ``q_old`` and
    ``m_old`` (the first moment before the change) when an existing basis changes."""
    projection, transposed, density = group["projection"], group["transposed"], group["density"]
    if state.get("window") != window:
        with proj.full_fp32():  # basis, power iteration, moments moved: full fp32 (projections docstring)
            _change_basis(state, rule, p, grad, group, window, ident, moved)
    rule.init_state(state, p, proj.reduced_shape(projection, p.shape, transposed, density))
    return state["proj"]


def _change_basis(state: dict, rule: StateFullRule, p: Tensor, grad: Tensor, group: dict, window: int,
                  ident: int, moved: dict | None) -> None:
    """A new basis for ``window`` and what the state-full rule's state becomes (``reset_state``)."""
    projection, transposed, density = group["projection"], group["transposed"], group["density"]
    side = proj.matrix_side(p.shape, transposed)
    rank = proj.matrix_rank(p.shape, density)
    q_old = state.get("proj")
    if projection == "power" and q_old is not None and q_old.shape[1] == rank:
        q = _power_step(state, grad.t() if transposed else grad, q_old, side, group)
    else:
        q = proj.matrix_projection(projection, grad, transposed, density, group["seed"], window, ident,
                                    group["svd_signs"])
    mode = group["reset_state"] if "window" in state else "reset"
    if mode == "keep" and q_old is not None and q_old.shape != q.shape:
        mode = "reset"  # another rank (a density schedule): the old state does not fit
    if moved is not None and q_old is not None and "exp_avg" in state:
        moved.update(q_old=q_old, m_old=state["exp_avg"])
    if mode == "reproject":
        _reproject(state, rule, q_old, q, side)
    elif mode == "transport":
        _transport(state, q_old, q, side, group["betas"])
    elif mode == "reset" or mode in RESTART_EVERY_WINDOW:
        drop_full_state(state, rule)
    state["proj"], state["window"] = q, window


def split_matrix(state: dict, rule: StateFullRule, p: Tensor, grad: Tensor, group: dict, window: int,
                 ident: int) -> tuple[Tensor, Tensor, Tensor]:
    """A matrix projection's split: ``(Q, R, a)``, the basis, ``R = reduce(a)`` and ``a``: ``grad``, or
    with error feedback ``g + e`` in the error buffer, left holding what the low-rank step leaves out."""
    a, moved = grad, None
    if group["error_feedback"]:
        a, moved = feedback_begin(state, grad), {}
    q = matrix(state, rule, p, a, group, window, ident, moved)
    r = proj.project(a, group["projection"], group["transposed"], q)
    if group["error_feedback"]:
        feedback_end(state, group, p, r, q, moved)
    return q, r, a


def _updates_so_far(state: dict) -> Tensor:
    """The step count, at least 1 (a count of 0 has zero moments: any positive value reads them as zero)."""
    return state["step"].double().clamp_min(1.0)


def _power_step(state: dict, a: Tensor, q_old: Tensor, side: str, group: dict) -> Tensor:
    from . import subspace  # LDAdam's, imported where its projection runs

    rho = group["subspace_momentum"]
    if "exp_avg" in state and "step" in state and rho:
        b = subspace.subspace_target(a, state["exp_avg"], q_old, side, rho=rho, beta1=group["betas"][0],
                                     step=_updates_so_far(state))
    else:
        b = a
    return subspace.block_power_iteration(b, q_old, side)


def _transport(state: dict, q_old: Tensor, q_new: Tensor, side: str, betas) -> None:
    """LDAdam's projection-aware move of AdamW's moments into the new basis; the count goes on."""
    from . import subspace

    r = subspace.change_of_basis(q_old, q_new, side)
    state["exp_avg"], state["exp_avg_sq"] = subspace.reproject_moments(
        state["exp_avg"], state["exp_avg_sq"], r, side, beta1=betas[0], beta2=betas[1],
        step=_updates_so_far(state))


def feedback_begin(state: dict, grad: Tensor) -> Tensor:
    """``a = g + e`` in the error buffer (created as a copy of the first gradient); returns it."""
    e = state.get("error")
    if e is None:
        state["error"] = e = grad.clone()
    else:
        e.add_(grad)
    return e


def feedback_end(state: dict, group: dict, p: Tensor, full_grad: Tensor, q: Tensor, moved: dict) -> None:
    """The new error (docs/concurrent_methods.md, LDAdam), written without a full-size temporary;
    call it after the split and before the state-full update (which changes the first moment)."""
    transposed = group["transposed"]
    e = state["error"].t() if transposed else state["error"]
    side = proj.matrix_side(p.shape, transposed)
    beta1 = group["betas"][0]
    with proj.full_fp32():
        _add_lift_(e, full_grad, q, side, -1.0)
        if moved and beta1:
            c = beta1 / (1.0 - beta1)
            _add_lift_(e, moved["m_old"], moved["q_old"], side, c)
            _add_lift_(e, state["exp_avg"], q, side, -c)


def _add_lift_(out: Tensor, x: Tensor, q: Tensor, side: str, alpha: float) -> None:
    """``out += alpha * lift(x)`` (``x @ q.T`` or ``q @ x``) in place."""
    if side == "right":
        out.addmm_(x, q.t(), alpha=alpha)
    else:
        out.addmm_(q, x, alpha=alpha)


def _reproject(state: dict, rule: StateFullRule, q_old: Tensor, q_new: Tensor, side: str) -> None:
    """Appendix C's re-projection of the moments into the new basis (module docstring)."""
    r = q_old.t() @ q_new
    for name in rule.state_names:
        s = state[name]
        mix = r * r if name == "exp_avg_sq" else r
        new = s @ mix if side == "right" else mix.t() @ s
        if name != "exp_avg_sq":
            new.mul_(s.norm() / new.norm().clamp_min(torch.finfo(new.dtype).tiny))
        state[name] = new


def init_free_state(state: dict, p: Tensor, group: dict) -> None:
    """The state of a state-free rule that reads the split (Fira's norm, AdaMeM's statistic)."""
    free = STATE_FREE[group["state_free"]]
    if free.init_state is not None:
        dim, transposed = proj.reduced_dim(group["projection"], p.shape, group["transposed"])
        free.init_state(state, p.t() if transposed else p, dim)


def materialize(state: dict, param: Tensor, group: dict, whole: bool, window: int, ident: int, block: bool) -> None:
    """Give ``state`` the entries, zero-filled, that a checkpoint of a step in ``window`` holds for
    ``param``: ``whole``: the rule's moments of the whole tensor (``block``: also its window under
    ``reset_all``); a split: the window's coordinates drawn again, or a zero basis of its rank."""
    rule = STATE_FULL[group["state_full"]]
    p = local(param)
    if whole:
        if block or group["reset_state"] == "reset_everything":
            restart_block(state, rule, group, window)
        master = state_precision.master(state, param, group)
        rule.init_state(state, param if master is None else master, group=group)
        return
    if group["projection"] in proj.COORDINATE:
        coordinates(state, rule, p, group, window, ident, shard_key(param, group))
    else:
        transposed, density = group["transposed"], group["density"]
        m, n = proj.logical_shape(p.shape, transposed)
        side = n if proj.matrix_side(p.shape, transposed) == "right" else m
        state["proj"] = torch.zeros(side, proj.matrix_rank(p.shape, density), dtype=p.dtype, device=p.device)
        state["window"] = window
        rule.init_state(state, p, proj.reduced_shape(group["projection"], p.shape, transposed, density))
        if group["error_feedback"]:
            state["error"] = torch.zeros_like(p)
    init_free_state(state, param, group)


# ---- checkpoints ---------------------------------------------------------------------------------
def materialize_state(state: dict, groups: list[dict], layout: Layout, step: int) -> None:
    """``FRUGAL.materialize_state``: set the step counter to ``step`` and give every tensor that holds
    state after ``step`` steps its state, zero-filled (``materialize``), so that
    torch.distributed.checkpoint can load into it (``strict=False``: state-free tensors own none)::

        optimizer.materialize_state(saved_step)
        state = {"optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, state["optim"],
                                 options=StateDictOptions(strict=False))

    With a growing update gap the windows depend on the losses seen: refused.
    """
    if layout.clock is not None and layout.clock["update_gap_growth"] > 1.0:
        raise HyperparameterError(
            "materialize_state cannot know the windows of a run with update_gap_growth > 1 (they depend "
            "on the losses seen); load such a run with optimizer.load_state_dict instead")
    for group in groups:
        group["step"] = step
    groups[0].pop("clock", None)  # the clock replays every window from step 0 (the block walk counts them all)
    last = max(step - 1, 0)  # a checkpoint of step S holds the state of the window of step S - 1
    window, _ = layout.window(groups[0], last, commit=True)
    for t in layout.tensors(groups, window):
        if t.role == FREE:
            state.pop(t.param, None)
        else:
            materialize(state[t.param], t.param, t.group, t.role == FULL, t.window, t.ident, t.block is not None)


def exact_entries(state_dict: dict) -> dict:
    """The state entries torch's ``load_state_dict`` would cast to the parameter's dtype but must stay
    exact, by parameter key: integers (indices, counters), 8-bit moments' float32 scales and a
    ``master_weights`` group's whole state; ``restore_exact`` puts them back."""
    masters = {key for g in state_dict["param_groups"] if g.get("master_weights") for key in g["params"]}
    return {key: {name: v for name, v in s.items()
                  if torch.is_tensor(v) and (key in masters or not v.is_floating_point()
                                             or name.endswith(state_precision.ABSMAX))}
            for key, s in state_dict["state"].items()}


def restore_exact(state: dict, groups: list[dict], saved_groups: list[dict], exact: dict) -> None:
    """Put ``exact_entries`` back, each on its parameter's (local) device."""
    for saved, group in zip(saved_groups, groups):
        for key, p in zip(saved["params"], group["params"]):
            for name, v in exact.get(key, {}).items():
                state[p][name] = v.to(device=local(p).device)


def upgrade_groups(groups: list[dict], defaults: dict) -> None:
    """Loaded param groups made current: new keys take their defaults, ``momentum=None`` its rule's
    value, every group the first's step count (older state dicts kept it there only)."""
    for group in groups:
        for key, default in defaults.items():
            group.setdefault(key, default)
        resolve_momentum(group)
    for group in groups:
        group["step"] = groups[0]["step"]
