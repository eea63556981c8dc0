"""FRUGAL: one optimizer step = select the subspace, split the gradient, update both parts, write
back (Algorithm 1 of the paper).

``FRUGAL.step`` runs these phases over every tensor with a gradient:

1. select (``_select``): each tensor's role this step (``frugal.windows``): wholly state-full
   (non-projectable tensors, active blocks), wholly state-free (inactive blocks,
   ``always_state_free`` groups) or split (the other projections). Block-projected tensors leaving
   the state-full set drop their state here, before any state is allocated, so a block switch
   peaks at the resting state plus one block; so do the state-full tensors whose state restarts at
   the window boundary (``reset_all``: the blocks; ``reset_everything``: every tensor).
2. split (``_split``): a split tensor's state-full subspace for this window (``frugal.state_management``:
   chosen every ``update_gap`` steps, state carried over), its reduced gradient ``full_grad`` and
   reduced ``target`` (coordinate projections: a gathered copy of the weights; matrix projections:
   zeros that collect the update), and the gradient its state-free rule sees: the residual
   ``g - P^{-1}(P(g))``, or for an elementwise rule on a coordinate projection the whole gradient (see 5).
3. state-full update: ``rules.STATE_FULL`` over buckets of equal settings (``FullKey``): torch's
   fused AdamW kernel for AdamW.
4. state-free update: ``rules.STATE_FREE`` over buckets (``FreeKey``): signSGD as one compiled pass
   per tensor (``frugal.kernels``). Decoupled weight decay of state-free and split tensors is fused
   into this pass.
5. write back (``_write_back``): coordinate projections scatter the updated reduced weights over
   the state-free result (which is why an elementwise state-free rule may run on the whole tensor);
   matrix projections, and coordinate projections of a non-elementwise rule, add ``P^{-1}(target)``.

Split tensors go through 2-5 a batch at a time (about one layer), so their temporaries stay far
below the moments. ``step()`` only reads ``p.grad``. ``FRUGAL(foreach=False)`` runs
``frugal.reference.update_tensor`` instead: Algorithm 1 literally, one tensor at a time, with no
fused kernels and no gather/scatter shortcuts; it is the reference the fast path is tested
against, and the path of bfloat16 weights with ``stochastic_rounding=True``.

The concurrent methods the paper reads as FRUGAL instances (registry entries ``fira``, ``ldadam``,
``adamem``) plug into these phases (docs/concurrent_methods.md, "How each method maps onto the phased
step"): AdaMeM as a state-full rule with its own state layout (``rules.StateFullRule.shapes``) and a
*contextual* state-free rule that keeps a statistic per tensor (phase 4); Fira as a rule that takes a
split tensor's whole step in phase 4 (``rules.StateFreeRule.split_step``; phases 3 and 5 skip the
tensor, its ``target`` is None); LDAdam as ``projection="power"``, ``reset_state="transport"`` and
``error_feedback=True`` in phase 2 (``frugal.state_management``: ``p.grad`` is never written).

The opt-in schedules (``density_schedule``, ``update_gap_growth``: AdaFRUGAL's proposal) keep their
clock in the first param group, so ``state_dict()`` resumes them exactly, and report their changes
through ``pop_events()``.
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

    Args (core):
        params: a model, its ``named_parameters()``, plain tensors (blocks guessed from repeating
            shapes, with a warning) or param groups (``frugal.grouping``). Group keys:
            ``projectable`` (split this group's tensors), ``block`` (its layer index),
            ``transposed`` (GPT-2 ``Conv1D`` weight stored (in, out)), ``always_state_free``
            (the whole tensor takes the state-free rule). Other tensors are state-full, never reset;
            given a model, a rule of weight matrices (``state_full="muon"``) gives them AdamW
            (``StateFullRule.rest``, as the registry's ``frugal_muon``; ``frugal.describe`` lists them).
        lr, betas, eps, weight_decay: as torch's AdamW (decoupled decay on every tensor).
        density: :math:`\rho`, the state-full share of projectable elements: ``block`` keeps
            k of the L blocks (``projections.block_count``); ``column``, ``row``, ``randk`` that
            share of columns, rows or coordinates; ``svd``, ``random``, ``randperm``, ``power`` rank
            round(:math:`\rho\min(m, n)`) on the smaller side.
        update_gap: T, the steps of one subspace window.
        projection: block, column, row, randk, randperm, svd, random, power.
        state_full, state_free: a registered rule (``rules.STATE_FULL``, ``rules.STATE_FREE``): the
            paper's adamw, lion, sgdm and signsgd, sgd, none (BAdam / GaLore), and those of the modules
            that register their own (``frugal.describe``'s docs; docs/library.md, "Writing a rule").
        state_free_lr_scale, projectable_lr_scale: :math:`\gamma` and :math:`\kappa`.
        reset_state: the state after a change of subspace: reset (the main text: a block that
            stays state-full keeps its state, density 1 is AdamW), reset_all (the appendix
            pseudocode and the authors' code, which the presets of the paper's tables set: every
            state-full block restarts at every window boundary), reset_everything (reset_all, and
            the non-projectable tensors restart too: the ``badam`` package's BlockOptimizer, which
            clears its Adam's whole state at every switch), reproject, keep (GaLore), transport
            (LDAdam); ``frugal.state_management`` compares them.
        window_offset: window boundaries come this many steps earlier: the window of step t
            (counted from 0) is ``(t + window_offset) // update_gap``, so the first window is
            ``window_offset`` steps shorter. The ``badam`` package's first block trains
            ``update_gap - 1`` steps (its switch test counts the step before the switch): 1. At
            most ``update_gap - 1`` is used (with ``update_gap=1`` the package switches every step).
        block_order: descending (the paper's), ascending, mirror, random.
        block_granularity: layer (the paper's text) or tensor (the authors' code: single weights,
            Python's ``round``), or layer_floor (whole layers, ``int(density * L)`` of them: the
            ``badam`` package's blocks as the authors' code makes them for BAdam).
        momentum: sgdm's and muon's; None (the default) takes the rule's own: 0.9 for sgdm (the
            paper's), 0.95 for muon (torch's). seed: the subspace draws.
        **options: the registered rules' own hyperparameters (``StateFullRule.options``,
            ``StateFreeRule.options``), each rule's defaults where not given: signsgd's ``sign_update``
            (auto, compiled, eager: ``frugal.kernels``), muon's ``nesterov``, ``ns_steps``,
            ``ns_coefficients``, ``adjust_lr_fn`` (``frugal.muon``), fira's ``fira_gamma`` (its
            norm-growth limiter; None: off, for runs that clip gradients).

    Args (concurrent methods, module docstring):
        subspace_momentum, error_feedback: LDAdam (with ``projection="power"``,
            ``reset_state="transport"``).
        svd_signs: the sign of each singular vector of an svd basis, which matters where the state
            is kept across a change of basis (GaLore, Fira): canonical (largest entry positive, so
            CPU and GPU runs agree) or raw (``torch.linalg.svd``'s, backend-dependent, as the
            galore-torch and fira packages; the registry's ``galore`` and ``fira`` take it).

    Args (schedules, opt-in, off by default):
        density_schedule, density_end, density_steps: the density goes from ``density`` to
            ``density_end`` over ``density_steps`` steps (constant, linear, cosine, step), read at
            the first step of each window.
        update_gap_growth, plateau_patience, plateau_threshold, max_update_gap: the update gap is
            multiplied by ``update_gap_growth`` (up to ``max_update_gap``) when a window's mean
            loss (``observe_loss``) has not improved by ``plateau_threshold`` for
            ``plateau_patience`` windows.

    Args (implementation: same results, other speed or memory):
        stochastic_rounding: round bfloat16 weights stochastically (unbiased) so updates below half
            an ulp are not lost in pure bf16 (off: the paper's runs round to nearest).
        master_weights: a bfloat16/float16 tensor keeps, while it is state-full, a float32 copy
            of its weights (``state["master"]``) and float32 moments; the state-full rule updates
            the copy (with the gradient in float32) and the weights are the copy rounded to
            nearest. The copy is made from the weights when the tensor's state starts and dropped
            with it (a reset restarts it from the rounded weights): the ``badam`` package in pure
            bf16, whose fp32 copy of the trained tensors lives for one block. No effect on float32
            weights. Not a ``state_precision`` (that stores the moments); counted by ``state_bytes``
            and the estimate.
        state_precision: the state-full moments of whole tensors in the weights' dtype (``param``),
            bfloat16 (``bf16``) or bitsandbytes' blockwise 8 bits (``8bit``), decoded to float32
            for each update (``frugal.state_precision``; block projection, elementwise rules).
        foreach: False runs the single-tensor reference step (``frugal.reference``).

    Subspaces are pure functions of (seed, window, parameter position) drawn from private
    generators, so data-parallel ranks and resumed runs agree without communication. Every param
    group holds the step counter ``"step"`` (the same number in each: the subspace windows are
    global), written inside ``step()``; a group added later starts at the current count. A param
    group is what both ``state_dict()`` and torch.distributed.checkpoint keep besides
    per-parameter state.
    Parameters may be FSDP2 DTensor shards: block state is then DTensors (checkpointable and
    reshardable by torch.distributed.checkpoint), column/row/randk select within each local shard
    (their reduced state is per rank), and svd/random are refused.
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        density=density, update_gap=update_gap, projection=projection,
                        state_full=state_full, state_free=state_free,
                        state_free_lr_scale=state_free_lr_scale,
                        projectable_lr_scale=projectable_lr_scale, reset_state=reset_state,
                        block_order=block_order, block_granularity=block_granularity, window_offset=window_offset,
                        momentum=momentum, seed=seed,
                        subspace_momentum=subspace_momentum, error_feedback=error_feedback,
                        svd_signs=svd_signs, density_schedule=density_schedule, density_end=density_end,
                        density_steps=density_steps, update_gap_growth=update_gap_growth,
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
        """Set the step counter to ``step`` and give every tensor that holds state after ``step``
        steps its state, zero-filled, in the shapes a checkpoint of that step holds: for loading
        with torch.distributed.checkpoint (``state_management.materialize_state``)."""
        state_management.materialize_state(self.state, self.param_groups, self._get_layout(), step)
        self._events = []  # replaying the windows up to ``step`` is not news for the training log

    # ---- events and the loss (opt-in schedules) ----------------------------------------------
    def observe_loss(self, loss: float) -> None:
        """Record one training loss (a float, the same on every data-parallel rank: the all-reduced
        mean) for the plateau-growing update gap. Call it once per step; without
        ``update_gap_growth`` > 1 it does nothing. A window's gap is decided from the mean of the
        losses recorded since the previous window change, so the decisions are the same on every
        rank and after a resume (the sums are part of ``state_dict()``)."""
        self._get_layout().observe_loss(self.param_groups[0], loss)

    def pop_events(self) -> list[dict]:
        """Changes made by the opt-in schedules since the last call, oldest first, for the training
        log: ``{"event": "density", "window", "density"[, "state_full_blocks"]}`` when a density
        schedule changes the density of a new window, and ``{"event": "update_gap", "window",
        "update_gap", "previous_update_gap", "window_loss"}`` when a plateau grows the gap."""
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
        """Share of projectable elements that are state-full in the next step's window (the census itself:
        a subclass that reports the density otherwise keeps this share)."""
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
