"""FRUGAL: one optimizer step = split the gradient, update both parts, combine (Algorithm 1)."""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.optim import Optimizer

from . import projections as proj
from . import grouping
from .hparams import HyperparameterError, validate
from .rules import STATE_FREE, STATE_FULL

GROUP_KEYS = {"projectable": False, "block": None, "transposed": False, "always_state_free": False}
_BLOCK_SHARED = ("density", "update_gap", "block_order", "block_granularity", "seed")


class FRUGAL(Optimizer):
    r"""FRUGAL (Full-Rank Updates with GrAdient spLitting), Algorithm 1 of the paper.

    For every projectable tensor with gradient :math:`g` at step :math:`t`, window
    :math:`w = \lfloor t / T \rfloor` (``T = update_gap``) fixes a projection :math:`P_w`:

    .. math::
        g_{full} = P_w(g), \qquad g_{free} = g - P_w^{-1}(g_{full}) \\
        s \leftarrow P_w(P_{w'}^{-1}(s)) \quad (\text{only when the subspace changed}) \\
        \theta \leftarrow (1 - \eta\lambda)\,\theta
            - \eta\,\kappa\,P_w^{-1}(\mathrm{StateFull}(g_{full}, s))
            - \eta\,\gamma\,\mathrm{StateFree}(g_{free})

    with :math:`\eta` = ``lr``, :math:`\lambda` = ``weight_decay``, :math:`\kappa` =
    ``projectable_lr_scale`` (GaLore's 0.25), :math:`\gamma` = ``state_free_lr_scale``.
    StateFull is AdamW (bias correction counted since the state was (re)initialised), Lion or
    SGD with momentum; StateFree is :math:`\mathrm{sign}(g_{free})` (signSGD), :math:`g_{free}`
    (SGD) or 0 (``none``: BAdam / GaLore). State-free coordinates own no state.

    The density :math:`\rho` (``density``) sets the share of projectable elements that are
    state-full: ``block`` keeps round-half-up(:math:`\rho L`) of the L blocks (transformer
    layers, or single tensors with ``block_granularity="tensor"``) state-full; ``column``,
    ``row``, ``randk`` keep that share of columns, rows or random coordinates; ``svd``,
    ``random`` and ``randperm`` use rank round(:math:`\rho\min(m, n)`) on the smaller side.
    ``reset_state`` decides what the state-full rule sees after a change of subspace: fresh
    state (``reset``), the old state re-projected (``reproject``, Appendix C), or the stale
    state as it is (``keep``, GaLore). An unchanged projection leaves the state unchanged
    (Algorithm 1 line 7 is the identity), so density 1 is AdamW: a block that stays state-full
    keeps its state and only entering blocks start fresh. For coordinate projections (column,
    row, randk, randperm) a new window draws a new coordinate set, i.e. a changed projection:
    ``reset`` starts the whole reduced state fresh (the paper's reset, Appendix C), while
    ``reproject`` carries over the moments of coordinates that stay selected (exact for
    coordinate bases) and keeps the tensor's step counter; selecting all or none keeps the state.

    Param-group keys: ``projectable`` (split this group's tensors), ``block`` (its layer index),
    ``transposed`` (GPT-2 ``Conv1D`` weight stored (in, out)), ``always_state_free`` (update the
    whole tensor with the state-free rule). Other tensors are state-full and never reset.

    Subspaces are pure functions of (seed, window, parameter position) drawn from private
    generators, so data-parallel ranks and resumed runs agree without communication. With
    ``state_free="signsgd"`` (eager path; see :func:`frugal.rules.signsgd_` for the opt-in
    compiled one) and for ``svd``/``random`` projections ``step`` overwrites the gradients in
    place (with their sign, or the residual) instead of allocating temporaries on the hot path:
    read the gradients before stepping.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 density=0.25, update_gap=200, projection="block", state_full="adamw",
                 state_free="signsgd", state_free_lr_scale=1.0, projectable_lr_scale=1.0,
                 reset_state="reset", block_order="descending", block_granularity="layer",
                 momentum=0.9, seed=0):
        params = grouping.resolve_params(params)  # a model, named or plain tensors: see grouping.py
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        density=density, update_gap=update_gap, projection=projection,
                        state_full=state_full, state_free=state_free,
                        state_free_lr_scale=state_free_lr_scale,
                        projectable_lr_scale=projectable_lr_scale, reset_state=reset_state,
                        block_order=block_order, block_granularity=block_granularity,
                        momentum=momentum, seed=seed)
        defaults = validate(defaults)
        self._layout = None
        self._index_cache: dict[int, tuple[int, torch.Tensor]] = {}
        super().__init__(params, defaults)

    # ---- groups and layout -------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, default in GROUP_KEYS.items():
            group.setdefault(key, default)
        # One step counter for the whole optimizer (it fixes the window), kept in every group
        # as a plain int so that state_dict() round-trips it.
        group.setdefault("step", self.param_groups[0].get("step", 0) if len(self.param_groups) > 1 else 0)
        group.update(validate({k: group[k] for k in self.defaults}))
        if group["projectable"] and not group["always_state_free"]:
            p2 = group["projection"] not in ("block", "randk")
            for p in group["params"]:
                if p2 and p.dim() != 2:
                    raise HyperparameterError(f"projection {group['projection']!r} needs 2-D tensors, got shape "
                                     f"{tuple(p.shape)}; valid choices for other shapes: block, randk")
            if (group["projection"] == "block" and group["block_granularity"] == "layer"
                    and group["block"] is None):
                raise HyperparameterError("A projectable group with projection 'block' and block_granularity "
                                 "'layer' needs its layer index as group key 'block' (or use "
                                 "block_granularity='tensor')")
        self._layout = None

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every state tensor of a floating-point parameter to the parameter's dtype;
        # index tensors must stay int64 (bf16 cannot even represent indices above 256).
        indices = {k: s["index"] for k, s in state_dict["state"].items() if "index" in s}
        super().load_state_dict(state_dict)
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(saved["params"], group["params"]):
                if key in indices:
                    self.state[p]["index"] = indices[key].to(device=p.device, dtype=torch.int64)
        self._layout = None
        self._index_cache.clear()

    def _block_groups(self):
        return [g for g in self.param_groups
                if g["projectable"] and not g["always_state_free"] and g["projection"] == "block"]

    def _get_layout(self) -> dict:
        """Positions of parameters and blocks; rebuilt only when the param groups change."""
        if self._layout is not None:
            return self._layout
        idents, n = [], 0
        for g in self.param_groups:
            idents.append(list(range(n, n + len(g["params"]))))
            n += len(g["params"])
        groups = self._block_groups()
        layout = {"idents": idents, "blocks": None, "block_of": {}, "hp": None}
        if groups:
            hp = {k: groups[0][k] for k in _BLOCK_SHARED}
            for g in groups:
                for k in _BLOCK_SHARED:
                    if g[k] != hp[k]:
                        raise HyperparameterError(f"All block-projected groups must share {k}: got {hp[k]!r} "
                                         f"and {g[k]!r}")
            tensor_level = hp["block_granularity"] == "tensor"
            for gi, g in enumerate(self.param_groups):
                if any(g is x for x in groups):
                    for pi, p in enumerate(g["params"]):
                        layout["block_of"][id(p)] = len(layout["block_of"]) if tensor_level else g["block"]
            layout["blocks"] = sorted(set(layout["block_of"].values()))
            layout["hp"] = hp
        self._layout = layout
        return layout

    def _active(self, layout: dict, step: int) -> set:
        if layout["blocks"] is None:
            return set()
        hp, blocks = layout["hp"], layout["blocks"]
        window = step // hp["update_gap"]
        cached = layout.get("active")
        if cached is None or cached[0] != window:
            pos = proj.select_blocks(hp["block_order"], len(blocks), hp["density"], window, hp["seed"])
            cached = (window, {blocks[i] for i in pos})
            layout["active"] = cached
        return cached[1]

    def active_blocks(self) -> list[int] | None:
        """State-full blocks (layer indices, or tensor positions with granularity 'tensor') of
        the window the next step will use; None without block projection."""
        layout = self._get_layout()
        if layout["blocks"] is None:
            return None
        return sorted(self._active(layout, self.param_groups[0]["step"]))

    def state_full_fraction(self) -> float:
        """Share of projectable elements that are state-full in the next step's window."""
        layout = self._get_layout()
        active = self._active(layout, self.param_groups[0]["step"])
        total = full = 0
        for g in self.param_groups:
            if not g["projectable"] or g["always_state_free"]:
                continue
            for p in g["params"]:
                total += p.numel()
                if g["projection"] == "block":
                    full += p.numel() if layout["block_of"][id(p)] in active else 0
                else:
                    full += math.prod(proj.reduced_shape(g["projection"], p.shape, g["transposed"],
                                                         g["density"]))
        return full / total if total else 0.0

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layout = self._get_layout()
        full = defaultdict(lambda: ([], [], defaultdict(list), []))  # targets, grads, states, steps
        free = defaultdict(lambda: ([], []))
        decay = defaultdict(list)
        post = []
        for gi, group in enumerate(self.param_groups):
            step = group["step"]
            group["step"] = step + 1
            window = step // group["update_gap"]
            rule = STATE_FULL[group["state_full"]]
            lr, wd = group["lr"], group["weight_decay"]
            lr_free = lr * group["state_free_lr_scale"]
            hp = (group["state_full"], tuple(group["betas"]), group["eps"], group["momentum"])
            active = self._active(layout, step)
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise ValueError("FRUGAL does not support sparse gradients (got one for a tensor "
                                     f"of shape {tuple(p.shape)}); valid choices: dense gradients")
                projection = group["projection"]
                free_key = (group["state_free"], lr_free, p.device, p.dtype)
                if group["always_state_free"] or (group["projectable"] and projection == "block"
                                                  and layout["block_of"][id(p)] not in active):
                    self.state.pop(p, None)  # a state-free tensor owns no state
                    if wd:
                        decay[1.0 - lr * wd].append(p)
                    free[free_key][0].append(p)
                    free[free_key][1].append(g)
                    continue
                state = self.state[p]
                if not group["projectable"] or projection == "block":
                    # Target is the parameter itself: weight decay goes into the fused kernel.
                    lr_full = lr if not group["projectable"] else lr * group["projectable_lr_scale"]
                    if group["projectable"]:
                        # Entering the state-full set starts fresh; staying keeps the state.
                        if state.get("window", -2) < window - 1:
                            state.clear()
                        state["window"] = window
                    self._init_state(state, rule, p.shape, p)
                    wd_eff = wd * lr / lr_full if (wd and lr_full) else 0.0
                    if wd and not lr_full:
                        decay[1.0 - lr * wd].append(p)
                    self._add_full(full[hp + (lr_full, wd_eff, p.device, p.dtype)], rule, state, p, g)
                    continue
                lr_full = lr * group["projectable_lr_scale"]
                ident = layout["idents"][gi][pi]
                if projection in proj.MATRIX:
                    target, g_red = self._matrix_part(group, state, rule, p, g, window, ident, post)
                else:
                    target, g_red = self._coordinate_part(group, state, rule, p, g, window, ident, post)
                    if wd:
                        decay[1.0 - lr * wd].append(target)
                if wd:
                    decay[1.0 - lr * wd].append(p)
                self._add_full(full[hp + (lr_full, 0.0, p.device, p.dtype)], rule, state, target, g_red)
                if group["state_free"] != "none":
                    free[free_key][0].append(p)
                    free[free_key][1].append(g)

        for factor, tensors in decay.items():
            torch._foreach_mul_(tensors, factor)
        for (name, betas, eps, momentum, lr_full, wd_eff, _, _), (ts, gs, st, steps) in full.items():
            states = [st[n] for n in STATE_FULL[name].state_names]
            STATE_FULL[name].fn(ts, gs, states, steps, lr=lr_full, betas=betas, eps=eps,
                                weight_decay=wd_eff, momentum=momentum)
        for (name, lr_free, _, _), (ps, gs) in free.items():
            STATE_FREE[name](ps, gs, lr=lr_free)
        for op in post:  # after the state-free rule: coordinate copy-backs overwrite its update
            op()
        return loss

    @staticmethod
    def _init_state(state, rule, shape, like):
        for name in rule.state_names:
            if name not in state:
                state[name] = torch.zeros(shape, dtype=like.dtype, device=like.device)
                state.pop("step", None)
        if rule.counts_steps:
            s = state.get("step")
            if s is None:
                state["step"] = torch.zeros((), dtype=torch.float32, device=like.device)
            elif s.device != like.device:  # load_state_dict leaves 'step' where it was saved
                state["step"] = s.to(like.device)

    @staticmethod
    def _add_full(bucket, rule, state, target, grad):
        bucket[0].append(target)
        bucket[1].append(grad)
        for name in rule.state_names:
            bucket[2][name].append(state[name])
        if rule.counts_steps:
            bucket[3].append(state["step"])

    def _indices(self, group, p, window, ident):
        """Coordinate subspace of one tensor. randk's indices are not kept in the state (the
        paper stores only the seed): they are regenerated from it and memoised per window."""
        args = (group["projection"], p.shape, group["transposed"], group["density"], group["seed"])
        if group["projection"] != "randk":
            return proj.coordinate_indices(*args, window, ident, device=p.device)
        cached = self._index_cache.get(ident)
        if cached is None or cached[0] != window:
            cached = (window, proj.coordinate_indices(*args, window, ident, device=p.device))
            self._index_cache[ident] = cached
        return cached[1]

    def _coordinate_part(self, group, state, rule, p, g, window, ident, post):
        projection, transposed = group["projection"], group["transposed"]
        randk = projection == "randk"
        if state.get("window") != window:
            idx = self._indices(group, p, window, ident)
            old = state.get("window")
            shape = proj.reduced_shape(projection, p.shape, transposed, group["density"])
            mode = group["reset_state"] if old is not None else "reset"
            dim = proj.coordinate_dim(projection, p.shape, transposed)
            if old is not None and idx.numel() in (0, p.numel() if dim is None else p.shape[dim]):
                mode = "keep"  # all (or nothing) stays selected: an unchanged projection keeps state
            if mode == "reproject":
                old_idx = (self._indices(group, p, old, ident) if randk else state["index"])
                for name in rule.state_names:
                    back = proj.project_back(state[name], p.shape, projection, transposed, old_idx)
                    state[name] = proj.project(back, projection, transposed, idx)
            elif mode == "reset":
                state.clear()
            if not randk:
                state["index"] = idx
            state["window"] = window
            self._init_state(state, rule, shape, p)
        else:
            self._init_state(state, rule, state[rule.state_names[0]].shape, p)
        idx = self._indices(group, p, window, ident) if randk else state["index"]
        dim = proj.coordinate_dim(projection, p.shape, transposed)
        # The state-free rule then runs on the whole tensor and the copy-back (after it)
        # overwrites the state-full coordinates: no pass to zero them in the gradient.
        # Gathers: torch.take / torch.gather beat index_select by ~1.5x on CPU for flat (randk)
        # and inner-dimension (column of a row-major weight) selections; rows are contiguous
        # slices, for which index_select is a memcpy per row. Same values either way.
        if dim is None:
            flat = p.view(-1)
            target = torch.take(flat, idx)
            g_red = torch.take(g, idx)
            post.append(lambda: flat.scatter_(0, idx, target))  # much faster than 1-D index_copy_
        elif dim == p.dim() - 1 and p.dim() > 1:
            expanded = idx.expand(*p.shape[:-1], idx.numel())
            target = torch.gather(p, dim, expanded)
            g_red = torch.gather(g, dim, expanded)
            post.append(lambda: p.index_copy_(dim, idx, target))
        else:
            target = p.index_select(dim, idx)
            g_red = g.index_select(dim, idx)
            post.append(lambda: p.index_copy_(dim, idx, target))
        return target, g_red

    def _matrix_part(self, group, state, rule, p, g, window, ident, post):
        projection, transposed = group["projection"], group["transposed"]
        if state.get("window") != window:
            q = proj.matrix_projection(projection, g, transposed, group["density"], group["seed"],
                                       window, ident)
            mode = group["reset_state"] if "window" in state else "reset"
            if mode == "reproject":
                self._reproject_matrix(state, rule, state["proj"], q, proj.matrix_side(p.shape, transposed))
            elif mode == "reset":
                state.clear()
            state["proj"], state["window"] = q, window
        q = state["proj"]
        shape = proj.reduced_shape(projection, p.shape, transposed, group["density"])
        self._init_state(state, rule, shape, p)
        g_red = proj.project(g, projection, transposed, q)
        target = torch.zeros_like(g_red)
        post.append(lambda: p.add_(proj.project_back(target, p.shape, projection, transposed, q)))
        if group["state_free"] != "none":
            g.sub_(proj.project_back(g_red, p.shape, projection, transposed, q))
        return target, g_red

    @staticmethod
    def _reproject_matrix(state, rule, q_old, q_new, side):
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
