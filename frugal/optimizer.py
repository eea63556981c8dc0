"""FRUGAL: one step = select the subspace, split the gradient, update both parts, write back
(Algorithm 1 of the paper); the phases of ``FRUGAL.step`` over every tensor with a gradient:

1. select (``_select``): each tensor's role (``frugal.windows``): state-full (non-projectable tensors,
   active blocks), state-free (inactive blocks, ``always_state_free`` groups) or split. Tensors leaving
   the state-full set, and those whose state restarts at the boundary (``reset_all``,
   ``reset_everything``), drop their state here, before any is allocated: a block switch peaks at the
   resting state plus one block.
2. split (``_split``): a split tensor's subspace (``frugal.state_management``), reduced ``full_grad``
   and ``target`` (coordinate projections: gathered weights; matrix projections: zeros collecting the
   update), and the state-free gradient: the residual ``g - P^{-1}(P(g))``, or the whole gradient for
   an elementwise rule on a coordinate projection (see 5).
3. state-full update: ``rules.STATE_FULL`` over buckets of equal settings (``FullKey``).
4. state-free update: ``rules.STATE_FREE`` over buckets (``FreeKey``), with the decoupled weight decay
   of state-free and split tensors fused in.
5. write back (``_write_back``): coordinate projections scatter the reduced weights over the
   state-free result; matrix projections, and non-elementwise rules, add ``P^{-1}(target)``.

Split tensors go through 2-5 about a layer at a time, so temporaries stay far below the moments;
``step()`` only reads ``p.grad``. ``foreach=False`` runs ``frugal.reference.update_tensor``
(Algorithm 1 literally, the fast path's test reference, and the path of bf16 weights with
``stochastic_rounding``). How Fira, LDAdam and AdaMeM plug into the phases: docs/concurrent_methods.md.
The opt-in schedules keep their clock in the first param group (``state_dict()`` resumes them) and
report changes through ``pop_events()``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import projections as proj
from . import grouping, state_management, state_precision
from .adaptive import check_shared, layout_of
from .hparams import HyperparameterError, check_group, resolve_momentum, validate
from .reference import update_tensor
from .rules import STATE_FREE, STATE_FULL, FreeContext, SplitContext, keywords, option_defaults
from .sharding import local, shard_key
from .windows import FREE, FULL, SPLIT, Layout, Window

GROUP_KEYS = {"projectable": False, "block": None, "transposed": False, "always_state_free": False}
_BATCH_TENSORS = 8  # split tensors per batch of phases 2-5: about one LLaMA layer (7 weights)


@dataclass(eq=False)
class Work:
    """One tensor's share of a step; phases 2-5 fill in and consume the last four fields."""
    param: Tensor
    local: Tensor  # the parameter's local values (itself unless it is an FSDP2 shard)
    grad: Tensor  # local values, read only
    group: dict
    state: dict
    role: str  # FULL, FREE or SPLIT
    ident: int  # position among all parameters: keys the random subspace
    window: int  # the subspace window of this step
    subspace: Tensor | None = None  # indices or Q (split tensors)
    target: Tensor | None = None  # what the state-full rule updates in place
    full_grad: Tensor | None = None  # the gradient the state-full rule sees
    free_grad: Tensor | None = None  # the gradient the state-free rule sees
    additive: bool = False  # target collects an update that phase 5 adds


class FullKey(NamedTuple):
    """Tensors that one call of a state-full rule updates together."""
    rule: str
    lr: float
    weight_decay: float
    betas: tuple
    eps: float
    momentum: float
    device: torch.device
    dtype: torch.dtype
    options: tuple = ()  # the rule's keywords (rules.keywords): (key, value) pairs


class FreeKey(NamedTuple):
    """Tensors that one call of a state-free rule updates together."""
    rule: str
    lr: float
    decay: float
    options: tuple  # the rule's own options: (key, value) pairs
    device: torch.device
    dtype: torch.dtype


class FRUGAL(Optimizer):
    r"""FRUGAL (Full-Rank Updates with GrAdient spLitting), Algorithm 1 of the paper.

    For a projectable tensor with gradient :math:`g`, window :math:`w = \lfloor t / T \rfloor`
    (``T = update_gap``) fixes a projection :math:`P_w`:

    .. math::
        g_{full} = P_w(g), \qquad g_{free} = g - P_w^{-1}(g_{full}) \\
        s \leftarrow P_w(P_{w'}^{-1}(s)) \quad (\text{only when the subspace changed}) \\
        \theta \leftarrow (1 - \eta\lambda)\,\theta
            - \eta\,\kappa\,P_w^{-1}(\mathrm{StateFull}(g_{full}, s))
            - \eta\,\gamma\,\mathrm{StateFree}(g_{free})

    with :math:`\eta` = ``lr``, :math:`\lambda` = ``weight_decay``, :math:`\kappa` =
    ``projectable_lr_scale`` (GaLore's 0.25), :math:`\gamma` = ``state_free_lr_scale``. StateFull is
    AdamW (bias correction counted since the state was (re)initialised), Lion or SGD with momentum;
    StateFree is sign (signSGD), identity (SGD) or 0 (``none``: BAdam / GaLore). State-free
    coordinates own no state. Every key is described in docs/library.md ("Inputs, methods,
    hyperparameters, guarantees"); in brief:

    Args:
        params: a model, its ``named_parameters()``, plain tensors (blocks guessed from repeating
            shapes, with a warning) or param groups with keys ``projectable``, ``block`` (layer
            index), ``transposed`` (GPT-2 ``Conv1D``), ``always_state_free`` (``frugal.grouping``).
            Other tensors are state-full, never reset; a model with ``state_full="muon"`` gives
            them AdamW (``StateFullRule.rest``).
        lr, betas, eps, weight_decay: as torch's AdamW (decoupled decay on every tensor).
        density: :math:`\rho`, the state-full share of projectable elements: ``block`` keeps k of
            the L blocks (``projections.block_count``); ``column``, ``row``, ``randk`` that share of
            columns, rows or coordinates; ``svd``, ``random``, ``randperm``, ``power`` rank
            round(:math:`\rho\min(m, n)`).
        update_gap: T, the steps of one subspace window.
        projection: block, column, row, randk, randperm, svd, random, power.
        state_full, state_free: registered rules (``rules.STATE_FULL``, ``rules.STATE_FREE``).
        state_free_lr_scale, projectable_lr_scale: :math:`\gamma` and :math:`\kappa`.
        reset_state: the state after a change of subspace: reset (the main text: a staying block
            keeps its state, density 1 is AdamW), reset_all (the appendix and the authors' code:
            every state-full block restarts at every boundary), reset_everything (reset_all plus
            the non-projectable tensors: the ``badam`` package), reproject, keep (GaLore),
            transport (LDAdam); see ``frugal.state_management``.
        window_offset: the window of step t (from 0) is ``(t + window_offset) // update_gap``
            (the ``badam`` package: 1); at most ``update_gap - 1`` is used.
        block_order: descending (the paper's), ascending, mirror, random.
        block_granularity: layer (the paper's text), tensor (the authors' code: single weights,
            Python's ``round``) or layer_floor (``int(density * L)`` whole layers: ``badam``).
        momentum: sgdm's and muon's; None takes the rule's own (0.9 sgdm, 0.95 muon).
        seed: the subspace draws.
        subspace_momentum, error_feedback: LDAdam (with ``projection="power"``,
            ``reset_state="transport"``).
        svd_signs: canonical (largest entry of each singular vector positive: CPU and GPU agree)
            or raw (``torch.linalg.svd``'s, as galore-torch and fira; matters where state is kept
            across a change of basis).
        density_schedule, density_end, density_steps: opt-in density schedule (constant, linear,
            cosine, step), read at the first step of each window.
        update_gap_growth, plateau_patience, plateau_threshold, max_update_gap: opt-in; the gap is
            multiplied by ``update_gap_growth`` (up to ``max_update_gap``) when a window's mean loss
            (``observe_loss``) has not improved by ``plateau_threshold`` for ``plateau_patience`` windows.
        stochastic_rounding: unbiased rounding of bfloat16 weights (off: the paper's runs).
        master_weights: a bf16/fp16 tensor keeps, while state-full, a float32 copy of its weights
            (``state["master"]``) and float32 moments; the rule updates the copy and the weights are
            it rounded to nearest. Made when the state starts, dropped with it (the ``badam``
            package in pure bf16); counted by ``state_bytes`` and the estimate.
        state_precision: whole tensors' state-full moments in the weights' dtype (``param``),
            ``bf16`` or blockwise ``8bit``, decoded to float32 per update (``frugal.state_precision``).
        foreach: False runs the single-tensor reference step (``frugal.reference``).
        **options: the rules' own hyperparameters (``StateFullRule.options``,
            ``StateFreeRule.options``), each rule's defaults where not given.

    Subspaces are pure functions of (seed, window, parameter position), so data-parallel ranks and
    resumed runs agree without communication. Every param group holds the same step counter
    ``"step"`` (windows are global), written inside ``step()``; a group added later starts at the
    current count. Parameters may be FSDP2 DTensor shards: block state is then DTensors,
    column/row/randk select within each local shard (per-rank reduced state), svd/random are refused.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 density=0.25, update_gap=200, projection="block", state_full="adamw",
                 state_free="signsgd", state_free_lr_scale=1.0, projectable_lr_scale=1.0,
                 reset_state="reset", block_order="descending", block_granularity="layer", window_offset=0,
                 momentum=None, seed=0, subspace_momentum=0.0, error_feedback=False,
                 svd_signs="canonical", density_schedule="constant", density_end=0.0, density_steps=None,
                 update_gap_growth=1.0, plateau_patience=3, plateau_threshold=0.01, max_update_gap=None,
                 stochastic_rounding=False, state_precision="param", master_weights=False, foreach=True,
                 **options):
        # a model, named or plain tensors: see grouping.py (a model with state_full "muon": AdamW on the rest)
        params = grouping.resolve_params(params, state_full=state_full)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, density=density,
                        update_gap=update_gap, projection=projection, state_full=state_full, state_free=state_free,
                        state_free_lr_scale=state_free_lr_scale, projectable_lr_scale=projectable_lr_scale,
                        reset_state=reset_state, block_order=block_order, block_granularity=block_granularity,
                        window_offset=window_offset, momentum=momentum, seed=seed, subspace_momentum=subspace_momentum,
                        error_feedback=error_feedback, svd_signs=svd_signs, density_schedule=density_schedule,
                        density_end=density_end, density_steps=density_steps, update_gap_growth=update_gap_growth,
                        plateau_patience=plateau_patience, plateau_threshold=plateau_threshold,
                        max_update_gap=max_update_gap, stochastic_rounding=stochastic_rounding,
                        state_precision=state_precision, master_weights=master_weights, foreach=foreach)
        rule_options = option_defaults()
        unknown = sorted(set(options) - set(rule_options))
        if unknown:
            raise HyperparameterError(f"FRUGAL does not take {unknown}; valid keys: "
                                      f"{sorted({*defaults, *rule_options})}")
        defaults = validate({**rule_options, **defaults, **options})  # the signature's keywords win
        self._layout = None
        self._events: list[dict] = []
        self._in_backward = None  # a frugal.in_backward.StepInBackward while one is attached
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:  # deepcopy / unpickle: caches are rebuilt
        super().__setstate__(state)
        self._layout = None
        self.__dict__.setdefault("_events", [])
        # load_state_dict comes through here too (and keeps it); a copy (deepcopy, unpickling) does not
        # step inside the original's backward
        self.__dict__.setdefault("_in_backward", None)

    # ---- groups, checkpoints -----------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        step = self.param_groups[0]["step"] if self.param_groups else 0
        own = [k for k in param_group if k in self.defaults]  # the defaults were validated in __init__
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, default in GROUP_KEYS.items():
            group.setdefault(key, default)
        group.setdefault("step", step)  # one count in every group: the windows are global
        try:
            if own:
                group.update(validate({k: group[k] for k in own}))
            resolve_momentum(group)
            check_group(group)
            check_shared(self.param_groups)  # one block walk and one window clock: shared settings
        except HyperparameterError:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise
        self._layout = None

    @property
    def step_count(self) -> int:
        """Steps taken so far; the next step's window is ``step_count // update_gap`` (with a
        density schedule or a growing gap: the window clock's, see ``pop_events``)."""
        return self.param_groups[0]["step"]

    def load_state_dict(self, state_dict: dict) -> None:
        exact = state_management.exact_entries(state_dict)  # torch would cast indices to the weights' dtype
        super().load_state_dict(state_dict)
        state_management.upgrade_groups(self.param_groups, self.defaults)
        state_management.restore_exact(self.state, self.param_groups, state_dict["param_groups"], exact)
        for group in self.param_groups:  # torch cast bfloat16 moments to the weights' dtype
            state_precision.restore_dtypes(self.state, group, STATE_FULL[group["state_full"]])
        self._layout = None

    def materialize_state(self, step: int) -> None:
        """Give every tensor the state, zero-filled, that a checkpoint of step ``step`` holds, for loading
        with torch.distributed.checkpoint (``state_management.materialize_state``)."""
        state_management.materialize_state(self.state, self.param_groups, self._get_layout(), step)
        self._events = []  # replaying the windows up to ``step`` is not news for the training log

    # ---- events and the loss (opt-in schedules) ----------------------------------------------
    def observe_loss(self, loss: float) -> None:
        """Record one training loss (the same on every rank: the all-reduced mean), once per step, for the
        plateau-growing update gap (a no-op without ``update_gap_growth`` > 1). The sums are part of
        ``state_dict()``, so every rank and a resumed run decide the same gaps."""
        self._get_layout().observe_loss(self.param_groups[0], loss)

    def pop_events(self) -> list[dict]:
        """The opt-in schedules' changes since the last call, oldest first: ``{"event": "density", "window",
        "density"[, "state_full_blocks"]}`` and ``{"event": "update_gap", "window", "update_gap",
        "previous_update_gap", "window_loss"}``."""
        events, self._events = self._events, []
        return events

    # ---- what is state-full ------------------------------------------------------------------
    def _get_layout(self) -> Layout:
        if self._layout is None:
            self._layout = layout_of(self.param_groups)
        return self._layout

    def _window(self, step: int, commit: bool) -> Window:
        """The window of ``step`` (``Layout.window``); the events of a committed move wait for ``pop_events``."""
        window, events = self._get_layout().window(self.param_groups[0], step, commit)
        self._events += events
        return window

    def next_roles(self) -> list:
        """Every tensor's role in the next step's window (``windows.Slot``: param, group, role, block),
        without moving the window: what ``density_report`` counts."""
        return list(self._get_layout().tensors(self.param_groups, self._window(self.step_count, commit=False)))

    def block_ids(self) -> list | None:
        """Every block the windows choose from (layer indices, or tensor positions with granularity
        'tensor'); None without block projection."""
        blocks = self._get_layout().blocks
        return None if blocks is None else list(blocks)

    def active_blocks(self) -> list | None:
        """State-full blocks (layer indices, or tensor positions with granularity 'tensor') of
        the window the next step will use; None without block projection."""
        layout = self._get_layout()
        return None if layout.blocks is None else sorted(self._window(self.step_count, commit=False).active)

    def state_full_fraction(self) -> float:
        """Share of projectable elements state-full in the next step's window (the census, whatever a
        subclass's ``density_report`` says)."""
        return FRUGAL.density_report(self)["state_full_share"]

    def density_report(self) -> dict:
        """The density requested and the one realised in the next step's window (keys
        ``requested``, ``realised``, ``unit``, ``state_full_share``, ``blocks``: ``frugal.density.density_report``)."""
        from .density import density_report  # the census, not the step

        return density_report(self)

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_backward is not None:  # the updates ran in backward: the deferred ones, the count
            self._in_backward.finish()
            return loss
        step = self.step_count
        slots = self._select(step)                                        # 1. select
        self._apply([self._work(t) for t in slots if t.param.grad is not None], step)
        self._set_step(step + 1)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with the step inside backward attached, also abandons a step that an
        error inside backward left unfinished (``StepInBackward.abort``)."""
        if self._in_backward is not None:
            self._in_backward.abort()
        super().zero_grad(set_to_none)

    def _apply(self, works: list[Work], step: int) -> None:
        """Phases 2-5 over ``works`` (tensors of step ``step``): also what a gradient hook of
        ``frugal.in_backward`` runs for one tensor."""
        fast, single = [], []
        for w in works:
            reference = not w.group["foreach"] or _rounds_stochastically(w)
            (single if reference else fast).append(w)
        for batch in _batches(fast):
            for w in batch:
                self._split(w)                                            # 2. split
            self._update_state_full(batch)                                # 3. state-full update
            self._update_state_free(batch)                                # 4. state-free update
            for w in batch:
                _write_back(w)                                       # 5. write back
        for w in single:
            update_tensor(w.param, w.grad, w.group, w.state, w.role, w.ident, step, w.window)

    def _set_step(self, step: int) -> None:
        for group in self.param_groups:
            group["step"] = step

    def _select(self, step: int) -> list:
        """Phase 1: every tensor's role (``windows.Slot``) in step ``step``'s window. Tensors
        leaving the state-full set (and state-free ones) drop their state first, whether or not
        they have a gradient; state is allocated only in later phases."""
        slots = list(self._get_layout().tensors(self.param_groups, self._window(step, commit=True)))
        for t in slots:
            if t.role == FREE:
                self.state.pop(t.param, None)  # a state-free tensor owns no state
            elif t.role == FULL and (t.block is not None or t.group["reset_state"] == "reset_everything"):
                state_management.restart_block(self.state[t.param], STATE_FULL[t.group["state_full"]], t.group,
                                               t.window)
            if t.param.grad is not None and t.param.grad.is_sparse:
                raise ValueError("FRUGAL does not support sparse gradients (got one for a tensor "
                                 f"of shape {tuple(t.param.shape)}); valid choices: dense gradients")
        return slots

    def _work(self, t) -> Work:
        """The step's work for slot ``t`` (a tensor with a gradient)."""
        return Work(t.param, local(t.param), local(t.param.grad), t.group,
                    self.state[t.param] if t.role != FREE else {}, t.role, t.ident, t.window)

    def _split(self, w: Work) -> None:
        """Phase 2: state-full subspace, ``full_grad``/``target`` and ``free_grad`` of one tensor."""
        group, rule = w.group, STATE_FULL[w.group["state_full"]]
        if w.role == FREE:
            w.free_grad = w.grad
            return
        if w.role == FULL:
            master = state_precision.master(w.state, w.param, group) if group["master_weights"] else None
            rule.init_state(w.state, w.param if master is None else master, group=group)
            w.target, w.full_grad = (w.local, w.grad) if master is None else (local(master), w.grad.float())
            return
        p, projection, transposed = w.local, group["projection"], group["transposed"]
        free = STATE_FREE[group["state_free"]]
        if projection in proj.MATRIX:
            w.subspace, w.full_grad, grad = state_management.split_matrix(w.state, rule, p, w.grad, group,
                                                                          w.window, w.ident)
            w.target, w.additive = torch.zeros_like(w.full_grad), True  # collects the state-full update
            w.free_grad = w.grad
            if free.reads_residual:
                w.free_grad = grad - proj.project_back(w.full_grad, p.shape, projection, transposed, w.subspace)
        else:
            w.subspace = state_management.coordinates(w.state, rule, p, group, w.window, w.ident,
                                                      shard_key(w.param, group))
            w.subspace = w.subspace.long()  # once, not in each of the gathers/scatters below
            w.full_grad = proj.project(w.grad, projection, transposed, w.subspace)
            if free.elementwise or not free.reads_residual:  # phase 5 overwrites the state-full coordinates
                w.free_grad, w.target = w.grad, proj.project(p, projection, transposed, w.subspace)
            else:  # the residual (zero on the state-full coordinates); phase 5 adds the state-full update
                w.free_grad = proj.write_coordinates_(w.grad.clone(), projection, transposed, w.subspace,
                                                      torch.zeros_like(w.full_grad))
                w.target, w.additive = torch.zeros_like(w.full_grad), True
        if free.split_step is not None:  # the rule takes the whole step in phase 4 (Fira)
            w.target, w.free_grad = None, None
        if free.init_state is not None:
            state_management.init_free_state(w.state, p, group)

    def _update_state_full(self, works: list[Work]) -> None:
        """Phase 3: the state-full rule on every target, one call per bucket of equal settings."""
        buckets: dict[FullKey, tuple] = {}
        for w in works:
            if w.target is None:  # state-free, or a rule that takes the whole step (phase 4)
                continue
            group = w.group
            lr, wd = group["lr"], group["weight_decay"]
            lr_full = lr * group["projectable_lr_scale"] if group["projectable"] else lr
            # Decoupled decay (lr * wd) happens inside the rule when the target holds weights;
            # an additive target collects only the update (phase 4 decays the weights).
            holds_weights = w.role == FULL or not w.additive
            wd_full = wd * lr / lr_full if holds_weights and lr_full else 0.0
            if wd and holds_weights and not lr_full:
                w.target.mul_(1.0 - lr * wd)
            rule = STATE_FULL[group["state_full"]]
            options = tuple(keywords(rule, group).items())
            low = group["state_precision"] != "param" and w.role == FULL  # moments in bf16 or 8 bits
            if low and state_precision.storage(group, w.target.numel()) != "param":
                state_precision.update_(rule, w.target, w.full_grad, w.state, lr=lr_full, betas=tuple(group["betas"]),
                                        eps=group["eps"], weight_decay=wd_full, momentum=group["momentum"],
                                        **dict(options))
                continue
            key = FullKey(group["state_full"], lr_full, wd_full, tuple(group["betas"]), group["eps"], group["momentum"],
                          w.target.device, w.target.dtype, options)
            targets, grads, states, steps = buckets.setdefault(key, ([], [], defaultdict(list), []))
            whole = rule.gathers and w.role == FULL  # the rule reads FSDP2 DTensors itself (Muon)
            targets.append(w.param if whole else w.target)
            grads.append(w.param.grad if whole else w.full_grad)
            for name in rule.state_names:
                states[name].append(w.state[name] if whole else local(w.state[name]))
            if rule.counts_steps:
                steps.append(w.state["step"])
        for key, (targets, grads, states, steps) in buckets.items():
            rule = STATE_FULL[key.rule]
            rule.foreach(targets, grads, [states[n] for n in rule.state_names], steps, lr=key.lr,
                         betas=key.betas, eps=key.eps, weight_decay=key.weight_decay, momentum=key.momentum,
                         **dict(key.options))

    def _update_state_free(self, works: list[Work]) -> None:
        """Phase 4: the state-free rule (with the weight decay of every non-state-full tensor);
        contextual rules (Fira, AdaMeM) one tensor at a time, the others in buckets."""
        buckets: dict[FreeKey, tuple] = {}
        for w in works:
            if w.role == FULL:
                continue
            group = w.group
            p = w.local
            rule = STATE_FREE[group["state_free"]]
            if rule.split_step is not None:
                _split_step(w, rule)
                continue
            if rule.contextual is not None:
                _contextual_update(w, rule)
                continue
            key = FreeKey(group["state_free"], group["lr"] * group["state_free_lr_scale"],
                          1.0 - group["lr"] * group["weight_decay"], tuple(keywords(rule, group).items()), p.device,
                          p.dtype)
            params, grads = buckets.setdefault(key, ([], []))
            params.append(p)
            grads.append(w.free_grad)
        for key, (params, grads) in buckets.items():
            STATE_FREE[key.rule].step_(params, grads, lr=key.lr, decay=key.decay, **dict(key.options))


def _rounds_stochastically(w: Work) -> bool:
    return w.group["stochastic_rounding"] and w.param.dtype == torch.bfloat16


def _batches(works: list[Work]):
    """Whole-tensor work in one batch (no temporaries); split tensors a layer at a time."""
    whole = [w for w in works if w.role != SPLIT]
    if whole:
        yield whole
    batch: list[Work] = []
    for w in works:
        if w.role != SPLIT:
            continue
        if batch and (w.group is not batch[0].group or len(batch) == _BATCH_TENSORS):
            yield batch
            batch = []
        batch.append(w)
    if batch:
        yield batch


def _contextual_update(w: Work, rule) -> None:
    """p <- p * (1 - lr wd) - lr * state_free_lr_scale * d, d = rule(residual, its state, the split)."""
    group, p = w.group, w.local
    dim, transposed = proj.reduced_dim(group["projection"], p.shape, group["transposed"])
    residual = w.free_grad.t() if transposed else w.free_grad
    d = rule.contextual(residual, w.state, FreeContext(w.full_grad, dim, group))
    if group["weight_decay"]:
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
    p.sub_(d.t() if transposed else d, alpha=group["lr"] * group["state_free_lr_scale"])


def _split_step(w: Work, rule) -> None:
    """A rule that takes a split tensor's whole step (Fira): state-full part, residual, decay."""
    group, p = w.group, w.local
    projection, transposed = group["projection"], group["transposed"]
    dim, flip = proj.reduced_dim(projection, p.shape, transposed)
    lift = lambda x: proj.project_back(x, p.shape, projection, transposed, w.subspace)  # noqa: E731
    rule.split_step(p, w.state, SplitContext(w.grad, w.full_grad, lift, dim, flip,
                                             STATE_FULL[group["state_full"]], group))


def _write_back(w: Work) -> None:
    """Phase 5, and the end of the batch's temporaries."""
    if w.role == FULL and w.target is not None and w.target is not w.local:  # a master copy: round it in
        w.local.copy_(w.target)
    if w.role == SPLIT and w.target is not None:
        group, p = w.group, w.local
        if w.additive:
            p.add_(proj.project_back(w.target, p.shape, group["projection"], group["transposed"], w.subspace))
        else:
            proj.write_coordinates_(p, group["projection"], group["transposed"], w.subspace, w.target)
    w.target = w.full_grad = w.free_grad = w.subspace = None
