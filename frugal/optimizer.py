"""FRUGAL: one optimizer step = select the subspace, split the gradient, update both parts, write
back (Algorithm 1 of the paper).

``FRUGAL.step`` runs these phases over every tensor with a gradient:

1. select (``_select``): each tensor's role this step: wholly state-full (non-projectable tensors,
   active blocks), wholly state-free (inactive blocks, ``always_state_free`` groups) or split (the
   other projections). Block-projected tensors leaving the state-full set drop their state here,
   before any state is allocated, so a block switch peaks at the resting state plus one block.
2. split (``_split``): a split tensor's state-full subspace for this window (``frugal.state_management``:
   chosen every ``update_gap`` steps, state carried over), its reduced gradient ``full_grad`` and
   reduced ``target`` (coordinate projections: a gathered copy of the weights; matrix projections:
   zeros that collect the update), and the gradient its state-free rule sees (matrix projections:
   the residual ``g - P^{-1}(P(g))``; coordinate projections: the whole gradient, see 5).
3. state-full update: ``rules.STATE_FULL`` over buckets of equal settings (``FullKey``): torch's
   fused AdamW kernel for AdamW.
4. state-free update: ``rules.STATE_FREE`` over buckets (``FreeKey``): signSGD as one compiled pass
   per tensor (``frugal.kernels``). Decoupled weight decay of state-free and split tensors is fused
   into this pass.
5. write back (``_write_back``): coordinate projections scatter the updated reduced weights over
   the state-free result (which is why the state-free rule may run on the whole tensor); matrix
   projections add ``P^{-1}(target)``.

Split tensors go through 2-5 a batch at a time (about one layer), so their temporaries stay far
below the moments. ``step()`` only reads ``p.grad``. ``FRUGAL(foreach=False)`` runs
``frugal.reference.update_tensor`` instead: Algorithm 1 literally, one tensor at a time, with no
fused kernels and no gather/scatter shortcuts; it is the reference the fast path is tested
against, and the path of bfloat16 weights with ``stochastic_rounding=True``.

The concurrent methods the paper reads as FRUGAL instances (its Appendix "Comparison with
Concurrent Methods"; registry entries ``fira``, ``ldadam``, ``adamem``) plug into these phases:

- AdaMeM: a state-full rule with its own state layout (``adafactor_momentum``: Adafactor's factors,
  ``rules.StateFullRule.shapes``) in phase 3, and a *contextual* state-free rule
  (``one_sided_adafactor``) in phase 4 that keeps a statistic per tensor.
- Fira: the contextual rule ``fira`` reads the state-full update. For it phase 3 runs the
  state-full rule with learning rate 1 on a zero target, which then holds ``-psi`` exactly (no
  division by a learning rate that is 0 during warm-up); phase 4 reads it, and phase 5 adds
  ``lr * projectable_lr_scale`` times its lift.
- LDAdam: ``projection="power"`` (a basis tracked by block power iteration), ``reset_state=
  "transport"`` (the moments moved into the new basis) and ``error_feedback=True``: in phase 2 the
  gradient is added to the error buffer (``p.grad`` is never written), the split reads that sum,
  and the buffer is left holding what the low-rank step did not apply (``frugal.state_management``).

Opt-in beyond the paper (off by default): ``density_schedule`` (the density decays over training,
evaluated at the first step of each window) and ``update_gap_growth`` (the update gap grows when
the training loss, given by ``observe_loss``, stops improving: AdaFRUGAL's proposal). Both keep
their clock in the first param group, so ``state_dict()`` resumes them exactly, and report their
changes through ``pop_events()``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import projections as proj
from . import grouping, state_management
from .adaptive import WindowClock, advance_clock, density_at, observe_clock
from .hparams import HyperparameterError, check_combination, validate
from .reference import FREE, FULL, SPLIT, update_tensor
from .rules import STATE_FREE, STATE_FULL, FreeContext
from .sharding import is_dtensor, local, shard_key

GROUP_KEYS = {"projectable": False, "block": None, "transposed": False, "always_state_free": False}
_BLOCK_SHARED = ("density", "update_gap", "block_order", "block_granularity", "seed",
                 "density_schedule", "density_end", "density_steps")
# One clock serves every group once windows are not step // update_gap: its settings are shared.
_CLOCK_SHARED = ("update_gap", "update_gap_growth", "plateau_patience", "plateau_threshold", "max_update_gap")
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
    additive: bool = False  # target collects an update that phase 5 adds (times write_scale)
    write_scale: float = 1.0


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
    options: tuple = ()  # the values of the rule's own group keys (StateFullRule.options)


class FreeKey(NamedTuple):
    """Tensors that one call of a state-free rule updates together."""
    rule: str
    lr: float
    decay: float
    sign_update: str
    device: torch.device
    dtype: torch.dtype


@dataclass
class _Layout:
    """Positions and blocks of the parameters; rebuilt when the param groups change."""
    idents: list[list[int]]
    block_of: list[list]  # per group, per parameter: its block, or None
    blocks: list | None  # sorted block ids; None without block projection
    block_settings: dict | None  # the settings every block-projected group shares
    clock: dict | None = None  # the settings of the window clock; None: windows are step // update_gap
    active: tuple | None = None  # (window, frozenset of active blocks), memoised


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
    ``reset_state`` decides what the state-full rule sees after a change of subspace (fresh,
    re-projected or stale state: see ``frugal.state_management``). An unchanged projection leaves the
    state unchanged (Algorithm 1 line 7 is the identity), so density 1 is AdamW: a block that
    stays state-full keeps its state and only entering blocks start fresh.

    Beyond the paper, ``state_full="muon"`` (frugal/muon.py) is torch.optim.Muon's rule with its keys
    ``nesterov``, ``ns_steps``, ``ns_coefficients``, ``adjust_lr_fn`` (and ``momentum``, ``eps``;
    pass ``momentum=0.95``, torch's Muon default, as the registry entries ``muon``/``frugal_muon`` do),
    on block, column and row projections.

    Concurrent methods (module docstring): ``state_full="adafactor_momentum"`` and
    ``state_free="one_sided_adafactor"`` (AdaMeM), ``state_free="fira"`` with the norm-growth
    limiter ``fira_gamma`` (Fira; None: off, for runs that clip gradients), ``projection="power"``
    with ``subspace_momentum``, ``reset_state="transport"`` and ``error_feedback`` (LDAdam).

    Opt-in schedules (off by default): ``density_schedule`` ("constant", "linear", "cosine",
    "step") takes the density from ``density`` to ``density_end`` over ``density_steps`` steps,
    read at the first step of each window; ``update_gap_growth`` > 1 multiplies the update gap
    (up to ``max_update_gap``) when the mean training loss of a window, fed by ``observe_loss``,
    has not improved by the relative ``plateau_threshold`` for ``plateau_patience`` windows.

    Implementation keys: ``sign_update`` ("auto", "compiled", "eager"; ``frugal.kernels``) picks
    the signSGD kernel; ``stochastic_rounding=True`` rounds bfloat16 weights stochastically
    (unbiased) instead of to nearest, so updates below half a bf16 ulp are not lost in pure bf16
    training (off by default: the paper's runs round to nearest); ``foreach=False`` runs the
    single-tensor reference step (slow; for tests and debugging).

    Param-group keys: ``projectable`` (split this group's tensors), ``block`` (its layer index),
    ``transposed`` (GPT-2 ``Conv1D`` weight stored (in, out)), ``always_state_free`` (update the
    whole tensor with the state-free rule). Other tensors are state-full and never reset.

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
                 reset_state="reset", block_order="descending", block_granularity="layer",
                 momentum=0.9, seed=0, fira_gamma=1.01, subspace_momentum=0.0, error_feedback=False,
                 density_schedule="constant", density_end=0.0, density_steps=None,
                 update_gap_growth=1.0, plateau_patience=3, plateau_threshold=0.01, max_update_gap=None,
                 nesterov=True, ns_steps=5, ns_coefficients=(3.4445, -4.7750, 2.0315),
                 adjust_lr_fn="match_rms_adamw",
                 sign_update="auto", stochastic_rounding=False, foreach=True):
        params = grouping.resolve_params(params)  # a model, named or plain tensors: see grouping.py
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        density=density, update_gap=update_gap, projection=projection,
                        state_full=state_full, state_free=state_free,
                        state_free_lr_scale=state_free_lr_scale,
                        projectable_lr_scale=projectable_lr_scale, reset_state=reset_state,
                        block_order=block_order, block_granularity=block_granularity,
                        momentum=momentum, seed=seed, fira_gamma=fira_gamma,
                        subspace_momentum=subspace_momentum, error_feedback=error_feedback,
                        density_schedule=density_schedule, density_end=density_end,
                        density_steps=density_steps, update_gap_growth=update_gap_growth,
                        plateau_patience=plateau_patience, plateau_threshold=plateau_threshold,
                        max_update_gap=max_update_gap, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, adjust_lr_fn=adjust_lr_fn, sign_update=sign_update,
                        stochastic_rounding=stochastic_rounding, foreach=foreach)
        defaults = validate(defaults)
        self._layout = None
        self._events: list[dict] = []
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:  # deepcopy / unpickle: caches are rebuilt
        super().__setstate__(state)
        self._layout = None
        self.__dict__.setdefault("_events", [])

    # ---- groups, layout, checkpoints ---------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        step = self.param_groups[0]["step"] if self.param_groups else 0
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for key, default in GROUP_KEYS.items():
            group.setdefault(key, default)
        group.setdefault("step", step)  # one count in every group: the windows are global
        group.update(validate({k: group[k] for k in self.defaults}))
        check_combination(group)
        self._check_rule_shapes(group)
        if group["projectable"] and not group["always_state_free"]:
            projection = group["projection"]
            for p in group["params"]:
                if projection not in ("block", "randk") and p.dim() != 2:
                    raise HyperparameterError(
                        f"projection {projection!r} needs 2-D tensors, got shape {tuple(p.shape)}; "
                        "valid choices for other shapes: block, randk")
                if is_dtensor(p) and STATE_FREE[group["state_free"]].contextual is not None:
                    raise HyperparameterError(
                        f"state_free {group['state_free']!r} reads norms and statistics of the whole matrix "
                        f"(Fira's limiter: its norm), but the parameter of shape {tuple(p.shape)} is an FSDP2 "
                        "shard; valid choices for sharded parameters: signsgd, sgd, none")
                if projection in proj.MATRIX and is_dtensor(p):
                    raise HyperparameterError(
                        f"projection {projection!r} needs each whole weight matrix (for its basis), "
                        f"but the parameter of shape {tuple(p.shape)} is an FSDP2 shard; valid "
                        "choices for sharded parameters: block, column, row, randk, randperm")
            if projection == "block" and group["block_granularity"] == "layer" and group["block"] is None:
                raise HyperparameterError(
                    "A projectable group with projection 'block' and block_granularity 'layer' needs "
                    "its layer index as group key 'block' (or use block_granularity='tensor')")
        self._layout = None

    @staticmethod
    def _check_rule_shapes(group: dict) -> None:
        """A state-full rule of matrices (Adafactor's factors) refuses, at construction, a tensor it
        would have to update whole (non-projectable, block) that is not 2-D, and FSDP2 shards."""
        rule = STATE_FULL[group["state_full"]]
        if rule.check is not None:  # the rule's own refusals (Muon: frugal/muon.py)
            rule.check(group)
        if not rule.matrix_only or group["always_state_free"]:
            return
        whole = not group["projectable"] or group["projection"] == "block"
        for p in group["params"]:
            if is_dtensor(p) or (whole and p.dim() != 2):
                raise HyperparameterError(
                    f"state_full {group['state_full']!r} factors the second moment of a matrix; it cannot "
                    f"update the {'FSDP2 shard' if is_dtensor(p) else 'tensor'} of shape {tuple(p.shape)} "
                    "in this group; give the group state_full='adamw' (as the 'adamem' registry entry "
                    "does for embeddings, norms and the output layer)")

    @property
    def step_count(self) -> int:
        """Steps taken so far; the next step's window is ``step_count // update_gap`` (with a
        density schedule or a growing gap: the window clock's, see ``pop_events``)."""
        return self.param_groups[0]["step"]

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every state tensor of a floating-point parameter to the parameter's dtype;
        # index tensors and integer counters keep theirs (bf16 cannot even represent indices above 256).
        exact = {key: {name: v for name, v in s.items() if torch.is_tensor(v) and not v.is_floating_point()}
                 for key, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        self._set_step(self.param_groups[0]["step"])  # state dicts that kept it in the first group only
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(saved["params"], group["params"]):
                for name, v in exact.get(key, {}).items():
                    self.state[p][name] = v.to(device=local(p).device)
        self._layout = None

    # ---- events and the loss (opt-in schedules) ----------------------------------------------
    def observe_loss(self, loss: float) -> None:
        """Record one training loss (a float, the same on every data-parallel rank: the all-reduced
        mean) for the plateau-growing update gap. Call it once per step; without
        ``update_gap_growth`` > 1 it does nothing. A window's gap is decided from the mean of the
        losses recorded since the previous window change, so the decisions are the same on every
        rank and after a resume (the sums are part of ``state_dict()``)."""
        layout = self._get_layout()
        if layout.clock is not None and layout.clock["update_gap_growth"] > 1.0:
            observe_clock(self.param_groups[0], layout.clock, loss)

    def pop_events(self) -> list[dict]:
        """Changes made by the opt-in schedules since the last call, oldest first, for the training
        log: ``{"event": "density", "window", "density"[, "state_full_blocks"]}`` when a density
        schedule changes the density of a new window, and ``{"event": "update_gap", "window",
        "update_gap", "previous_update_gap", "window_loss"}`` when a plateau grows the gap."""
        events, self._events = self._events, []
        return events

    def _clock(self, layout: _Layout, step: int, commit: bool) -> WindowClock | None:
        """The window clock at ``step`` (None: windows are ``step // update_gap``); ``commit`` (only
        a step) stores it, lets the plateau controller decide and records the events; a query never
        decides anything, so asking (e.g. ``active_blocks()``) cannot change a run."""
        if layout.clock is None:
            return None
        blocks = None
        if layout.blocks is not None:
            n = len(layout.blocks)
            blocks = lambda start: proj.block_count(n, density_at(layout.block_settings, start))  # noqa: E731
        clock, events = advance_clock(self.param_groups[0], layout.clock, step, blocks=blocks, commit=commit)
        self._events += events
        return clock

    def _effective(self, group: dict, clock: WindowClock | None) -> dict:
        """``group`` with the density of the clock's window (itself without a density schedule)."""
        if clock is None or group["density_schedule"] == "constant":
            return group
        return {**group, "density": density_at(group, clock.start)}

    @staticmethod
    def _window(group: dict, step: int, clock: WindowClock | None) -> int:
        return step // group["update_gap"] if clock is None else clock.window

    def materialize_state(self, step: int) -> None:
        """Set the step counter to ``step`` and give every tensor that holds state after ``step``
        steps (in the window of the last step taken) its state, zero-filled, in the shapes a
        checkpoint of that step holds.

        For loading with torch.distributed.checkpoint, which loads into the state dict of the
        optimizer it is given: which tensors hold state depends on the window, so a freshly built
        FRUGAL must first look like the saved one (``dcp.load`` then fills in the values), and
        ``strict=False`` because state-free tensors own no state::

            optimizer.materialize_state(saved_step)
            state = {"optim": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=path)
            set_optimizer_state_dict(model, optimizer, state["optim"],
                                     options=StateDictOptions(strict=False))

        With a growing update gap the windows depend on the losses seen, which only the
        checkpoint knows: refused.
        """
        layout = self._get_layout()
        if layout.clock is not None and layout.clock["update_gap_growth"] > 1.0:
            raise HyperparameterError(
                "materialize_state cannot know the windows of a run with update_gap_growth > 1 (they depend "
                "on the losses seen); load such a run with optimizer.load_state_dict instead")
        self._set_step(step)
        self.param_groups[0].pop("clock", None)
        last = max(step - 1, 0)  # a checkpoint of step S holds the state of the window of step S - 1
        clock = self._clock(layout, last, commit=True)
        self._events = []
        active = self._active(layout, last, clock)
        for gi, group in enumerate(self.param_groups):
            group = self._effective(group, clock)
            rule = STATE_FULL[group["state_full"]]
            window = self._window(group, last, clock)
            for pi, p in enumerate(group["params"]):
                role = self._role(group, layout.block_of[gi][pi], active)
                if role == FREE:
                    self.state.pop(p, None)
                elif role == FULL:
                    rule.init_state(self.state[p], p)
                elif group["projection"] in proj.COORDINATE:
                    state_management.coordinates(self.state[p], rule, local(p), group, window,
                                                 layout.idents[gi][pi], shard_key(p, group))
                    self._init_free_state(self.state[p], p, group)
                else:  # the basis comes from the checkpoint (svd: from a gradient)
                    state = self.state[p]
                    shape = proj.reduced_shape(group["projection"], p.shape, group["transposed"],
                                               group["density"])
                    m, n = proj.logical_shape(p.shape, group["transposed"])
                    side = n if proj.matrix_side(p.shape, group["transposed"]) == "right" else m
                    rank = proj.matrix_rank(p.shape, group["density"])
                    state["proj"] = torch.zeros(side, rank, dtype=p.dtype, device=p.device)
                    state["window"] = window
                    rule.init_state(state, p, shape)
                    if group["error_feedback"]:
                        state["error"] = torch.zeros_like(p)
                    self._init_free_state(state, p, group)

    @staticmethod
    def _init_free_state(state: dict, p: Tensor, group: dict) -> None:
        """The state of a contextual state-free rule (Fira's norm, AdaMeM's statistic)."""
        free = STATE_FREE[group["state_free"]]
        if free.init_state is not None:
            dim, transposed = proj.reduced_dim(group["projection"], p.shape, group["transposed"])
            free.init_state(state, p.t() if transposed else p, dim)

    def _get_layout(self) -> _Layout:
        if self._layout is not None:
            return self._layout
        idents, block_of, n = [], [], 0
        for group in self.param_groups:
            idents.append(list(range(n, n + len(group["params"]))))
            block_of.append([None] * len(group["params"]))
            n += len(group["params"])
        split = [group for group in self.param_groups if group["projectable"] and not group["always_state_free"]]
        groups = [(gi, group) for gi, group in enumerate(self.param_groups)
                  if group["projectable"] and not group["always_state_free"] and group["projection"] == "block"]
        layout = _Layout(idents, block_of, None, None)
        if groups:
            block_settings = {k: groups[0][1][k] for k in _BLOCK_SHARED}
            for _, group in groups:
                for k in _BLOCK_SHARED:
                    if group[k] != block_settings[k]:
                        raise HyperparameterError(
                            f"All block-projected groups must share {k}: got {block_settings[k]!r} and {group[k]!r}")
            count = 0
            for gi, group in groups:
                for pi in range(len(group["params"])):
                    block_of[gi][pi] = count if block_settings["block_granularity"] == "tensor" else group["block"]
                    count += 1
            layout.blocks = sorted({b for row in block_of for b in row if b is not None})
            layout.block_settings = block_settings
        clocked = [group for group in split
                   if group["density_schedule"] != "constant" or group["update_gap_growth"] > 1.0]
        if clocked:
            clock = {k: clocked[0][k] for k in _CLOCK_SHARED + _BLOCK_SHARED}
            for group in split:
                for k in _CLOCK_SHARED:
                    if group[k] != clock[k]:
                        raise HyperparameterError(
                            f"With a density schedule or a growing update gap all projected groups share one "
                            f"window clock, so they must share {k}: got {clock[k]!r} and {group[k]!r}")
            layout.clock = clock
        self._layout = layout
        return layout

    def _active(self, layout: _Layout, step: int, clock: WindowClock | None) -> frozenset:
        """State-full blocks of the window holding ``step``."""
        if layout.blocks is None:
            return frozenset()
        window = self._window(layout.block_settings, step, clock)
        if layout.active is None or layout.active[0] != window:
            shared = layout.block_settings
            density = shared["density"] if clock is None else density_at(shared, clock.start)
            chosen = proj.select_blocks(shared["block_order"], len(layout.blocks), density, window, shared["seed"],
                                        offset=None if clock is None else clock.offset)
            layout.active = (window, frozenset(layout.blocks[i] for i in chosen))
        return layout.active[1]

    @staticmethod
    def _role(group: dict, block, active: frozenset) -> str:
        if group["always_state_free"]:
            return FREE
        if not group["projectable"]:
            return FULL
        if group["projection"] == "block":
            return FULL if block in active else FREE
        return SPLIT

    # ---- what is state-full ------------------------------------------------------------------
    def active_blocks(self) -> list | None:
        """State-full blocks (layer indices, or tensor positions with granularity 'tensor') of
        the window the next step will use; None without block projection."""
        layout = self._get_layout()
        clock = self._clock(layout, self.step_count, commit=False)
        return None if layout.blocks is None else sorted(self._active(layout, self.step_count, clock))

    def _census(self) -> tuple[int, int, int, float]:
        """(projectable elements, state-full ones next step, one selection unit, density asked)."""
        layout = self._get_layout()
        clock = self._clock(layout, self.step_count, commit=False)
        active = self._active(layout, self.step_count, clock)
        total = full = units = asked = 0
        block_sizes: dict = defaultdict(int)
        for gi, group in enumerate(self.param_groups):
            if not group["projectable"] or group["always_state_free"]:
                continue
            group = self._effective(group, clock)
            for pi, p in enumerate(group["params"]):
                n = p.numel()
                total += n
                asked += group["density"] * n
                if group["projection"] == "block":
                    block_sizes[layout.block_of[gi][pi]] += n
                    full += n if layout.block_of[gi][pi] in active else 0
                    continue
                shape = proj.reduced_shape(group["projection"], p.shape, group["transposed"], group["density"])
                full += math.prod(shape)
                if group["projection"] == "randk":
                    units += 1
                elif group["projection"] in proj.MATRIX:  # one more rank: a column (row) of the state
                    units += shape[0] if proj.matrix_side(p.shape, group["transposed"]) == "right" else shape[1]
                else:  # one more column (row): the elements across the other dimension
                    units += n // p.shape[proj.coordinate_dim(group["projection"], p.shape, group["transposed"])]
        units += max(block_sizes.values(), default=0)
        return total, full, units, (asked / total if total else self.defaults["density"])

    def state_full_fraction(self) -> float:
        """Share of projectable elements that are state-full in the next step's window."""
        total, full, _, _ = self._census()
        return full / total if total else 0.0

    def density_report(self) -> dict:
        """``requested`` density, ``realised`` state-full share of projectable elements (next
        step's window) and ``unit``, the share one selection unit moves (one of L equal blocks:
        1/L; column/row/randk/rank: one column/row/element/rank of every tensor). Blockwise
        selection rounds to whole blocks, so warn when |realised - requested| > unit / 2."""
        total, full, units, asked = self._census()
        return {"requested": asked, "realised": full / total if total else 0.0,
                "unit": units / total if total else 0.0}

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.step_count
        works = self._select(step)                                        # 1. select
        fast, single = [], []
        for w in works:
            reference = not w.group["foreach"] or self._rounds_stochastically(w)
            (single if reference else fast).append(w)
        for batch in self._batches(fast):
            for w in batch:
                self._split(w)                                            # 2. split
            self._update_state_full(batch)                                # 3. state-full update
            self._update_state_free(batch)                                # 4. state-free update
            for w in batch:
                self._write_back(w)                                       # 5. write back
        for w in single:
            update_tensor(w.param, w.grad, w.group, w.state, w.role, w.ident, step, w.window)
        self._set_step(step + 1)
        return loss

    def _set_step(self, step: int) -> None:
        for group in self.param_groups:
            group["step"] = step

    def _select(self, step: int) -> list[Work]:
        """Phase 1. Tensors leaving the state-full set (and state-free ones) drop their state
        first, whether or not they have a gradient; state is allocated only in later phases."""
        layout = self._get_layout()
        clock = self._clock(layout, step, commit=True)
        active = self._active(layout, step, clock)
        roles = []
        for gi, group in enumerate(self.param_groups):
            group = self._effective(group, clock)
            for pi, p in enumerate(group["params"]):
                role = self._role(group, layout.block_of[gi][pi], active)
                if role == FREE:
                    self.state.pop(p, None)  # a state-free tensor owns no state
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError("FRUGAL does not support sparse gradients (got one for a tensor "
                                     f"of shape {tuple(p.shape)}); valid choices: dense gradients")
                roles.append((gi, pi, group, p, role))
        return [Work(p, local(p), local(p.grad), group, self.state[p] if role != FREE else {}, role,
                     layout.idents[gi][pi], self._window(group, step, clock))
                for gi, pi, group, p, role in roles if p.grad is not None]

    @staticmethod
    def _rounds_stochastically(w: Work) -> bool:
        return w.group["stochastic_rounding"] and w.param.dtype == torch.bfloat16

    @staticmethod
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

    def _split(self, w: Work) -> None:
        """Phase 2: state-full subspace, ``full_grad``/``target`` and ``free_grad`` of one tensor."""
        group, rule = w.group, STATE_FULL[w.group["state_full"]]
        if w.role == FREE:
            w.free_grad = w.grad
            return
        if w.role == FULL:
            rule.init_state(w.state, w.param)
            w.target, w.full_grad = w.local, w.grad
            return
        p, projection, transposed = w.local, group["projection"], group["transposed"]
        free = STATE_FREE[group["state_free"]]
        if projection in proj.MATRIX:
            grad, moved = w.grad, None
            if group["error_feedback"]:  # LDAdam: the split reads g + e (the buffer holds it)
                grad, moved = state_management.feedback_begin(w.state, w.grad), {}
            w.subspace = state_management.matrix(w.state, rule, p, grad, group, w.window, w.ident, moved)
            w.full_grad = proj.project(grad, projection, transposed, w.subspace)
            if group["error_feedback"]:
                state_management.feedback_end(w.state, group, p, w.full_grad, w.subspace, moved)
            w.target = torch.zeros_like(w.full_grad)  # collects the state-full update
            w.additive = True
            w.free_grad = w.grad
            if group["state_free"] != "none":
                w.free_grad = grad - proj.project_back(w.full_grad, p.shape, projection, transposed,
                                                       w.subspace)
        else:
            w.subspace = state_management.coordinates(w.state, rule, p, group, w.window, w.ident,
                                                      shard_key(w.param, group))
            w.subspace = w.subspace.long()  # once, not in each of the gathers/scatters below
            w.full_grad = proj.project(w.grad, projection, transposed, w.subspace)
            w.free_grad = w.grad  # phase 5 overwrites the state-full coordinates
            if free.contextual is not None:  # it reads the residual itself (norms, statistics)
                w.free_grad = proj.write_coordinates_(w.grad.clone(), projection, transposed, w.subspace,
                                                      torch.zeros_like(w.full_grad))
            if free.reads_update:
                w.target, w.additive = torch.zeros_like(w.full_grad), True
            else:
                w.target = proj.project(p, projection, transposed, w.subspace)
        if free.reads_update:  # phase 3 runs at lr 1 so that target = -psi; phase 5 scales it
            w.write_scale = group["lr"] * group["projectable_lr_scale"]
        if free.init_state is not None:
            self._init_free_state(w.state, p, group)

    def _update_state_full(self, works: list[Work]) -> None:
        """Phase 3: the state-full rule on every target, one call per bucket of equal settings."""
        buckets: dict[FullKey, tuple] = {}
        for w in works:
            if w.role == FREE:
                continue
            group = w.group
            lr, wd = group["lr"], group["weight_decay"]
            lr_full = lr * group["projectable_lr_scale"] if group["projectable"] else lr
            if w.role == SPLIT and STATE_FREE[group["state_free"]].reads_update:
                lr_full = 1.0  # the target (zeros) then holds -psi exactly (module docstring)
            # Decoupled decay (lr * wd) happens inside the rule when the target holds weights;
            # an additive target collects only the update (phase 4 decays the weights).
            holds_weights = w.role == FULL or not w.additive
            wd_full = wd * lr / lr_full if holds_weights and lr_full else 0.0
            if wd and holds_weights and not lr_full:
                w.target.mul_(1.0 - lr * wd)
            rule = STATE_FULL[group["state_full"]]
            key = FullKey(group["state_full"], lr_full, wd_full, tuple(group["betas"]), group["eps"], group["momentum"],
                          w.target.device, w.target.dtype,
                          tuple(tuple(v) if isinstance(v, list) else v for v in (group[k] for k in rule.options)))
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
                         **dict(zip(rule.options, key.options)))

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
            if rule.contextual is not None:
                self._contextual_update(w, rule)
                continue
            key = FreeKey(group["state_free"], group["lr"] * group["state_free_lr_scale"],
                          1.0 - group["lr"] * group["weight_decay"], group["sign_update"], p.device, p.dtype)
            params, grads = buckets.setdefault(key, ([], []))
            params.append(p)
            grads.append(w.free_grad)
        for key, (params, grads) in buckets.items():
            STATE_FREE[key.rule].foreach(params, grads, lr=key.lr, decay=key.decay,
                                         sign_update=key.sign_update)

    @staticmethod
    def _contextual_update(w: Work, rule) -> None:
        """p <- p * (1 - lr wd) - lr * state_free_lr_scale * d, d = rule(residual, its state, the split)."""
        group, p = w.group, w.local
        dim, transposed = proj.reduced_dim(group["projection"], p.shape, group["transposed"])
        residual = w.free_grad.t() if transposed else w.free_grad
        update = torch.neg(w.target) if rule.reads_update else None  # the target holds -psi
        d = rule.contextual(residual, w.state, FreeContext(w.full_grad, update, dim, group))
        if group["weight_decay"]:
            p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.sub_(d.t() if transposed else d, alpha=group["lr"] * group["state_free_lr_scale"])

    @staticmethod
    def _write_back(w: Work) -> None:
        """Phase 5, and the end of the batch's temporaries."""
        if w.role == SPLIT:
            group, p = w.group, w.local
            if w.additive:
                p.add_(proj.project_back(w.target, p.shape, group["projection"], group["transposed"], w.subspace),
                       alpha=w.write_scale)
            else:
                proj.write_coordinates_(p, group["projection"], group["transposed"], w.subspace, w.target)
        w.target = w.full_grad = w.free_grad = w.subspace = None
