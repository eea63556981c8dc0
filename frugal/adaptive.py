r"""Opt-in adaptations beyond the paper: a density schedule and an update gap that grows on plateaus.

Both are off by default (wiring: docs/concurrent_methods.md); nothing here reads the global RNG or the host.
:func:`scheduled_density` decays :math:`\rho` from ``start`` to ``end`` over ``steps`` (``linear``,
``cosine``, ``step``), read at each window's first step, :math:`\rho_w = \rho(w T)`: a pure function of
the window. :class:`PlateauGap` (AdaFRUGAL) multiplies :math:`T` by ``factor`` (up to ``max_gap``) when
the window's mean loss has not improved by a relative ``threshold`` for ``patience`` windows; then
:class:`WindowClock` keeps the window index, its first step, the gap and the window's losses as plain
numbers (``state_dict`` round-trips them) and decides each new window's gap when it starts.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from . import projections as proj
from .checks import HyperparameterError, check_integer
from .windows import BLOCK_SHARED, Layout, Window

DENSITY_KINDS = ("constant", "linear", "cosine", "step")


def scheduled_density(step: int, *, start: float, end: float, steps: int, kind: str = "linear") -> float:
    """Density at ``step``: ``start`` at step 0, ``end`` from ``steps`` on (``constant``: always
    ``start``; ``step``: ``start`` before ``steps``, ``end`` after)."""
    if kind not in DENSITY_KINDS:
        raise ValueError(f"Invalid density schedule kind: {kind!r}; valid choices: {', '.join(DENSITY_KINDS)}")
    for name, value in (("start", start), ("end", end)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"Invalid density schedule {name}: {value!r} (must be in [0, 1])")
    check_integer("density schedule steps", steps, 1, error=ValueError)
    if kind == "constant":
        return start
    f = min(max(step, 0) / steps, 1.0)
    if kind == "step":
        return start if f < 1.0 else end
    if kind == "linear":
        return start + (end - start) * f
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * f))


class WindowClock:
    """Which window each step belongs to when the update gap may change between windows (module
    docstring). ``tick(step)`` moves the clock to the window holding the 0-based step about to be taken;
    at a window change the finished window's mean loss goes to ``plateau`` for the new gap, and
    ``blocks(start)`` (the state-full blocks of the new window) advances the block walk's ``offset``.
    With a constant gap the window is ``step // update_gap``; the state is plain numbers."""

    def __init__(self, update_gap: int):
        _check_gap(update_gap)
        self.update_gap, self.window, self.start, self.offset = update_gap, 0, 0, 0
        self.loss_sum, self.loss_count = 0.0, 0

    def observe(self, loss: float) -> None:
        """One training loss of the current window (non-finite values are the loop's to handle)."""
        if math.isfinite(loss):
            self.loss_sum += float(loss)
            self.loss_count += 1

    def tick(self, step: int, *, blocks=None, plateau: "PlateauGap | None" = None) -> list[dict]:
        """Advance to the window holding ``step``; returns one event per change of the gap."""
        events = []
        while step - self.start >= self.update_gap:  # a loop, so a skipped step cannot lose a window
            if blocks is not None:
                self.offset += blocks(self.start)
            gap = self.update_gap
            if plateau is not None and self.loss_count:
                mean = self.loss_sum / self.loss_count
                gap = plateau.observe(mean, self.update_gap)
                if gap != self.update_gap:
                    events.append({"event": "update_gap", "window": self.window + 1, "update_gap": gap,
                                   "previous_update_gap": self.update_gap, "window_loss": mean})
            self.start += self.update_gap
            self.window += 1
            self.update_gap = gap
            self.loss_sum, self.loss_count = 0.0, 0
        return events

    def state_dict(self) -> dict:
        return {"update_gap": self.update_gap, "window": self.window, "start": self.start,
                "offset": self.offset, "loss_sum": self.loss_sum, "loss_count": self.loss_count}

    def load_state_dict(self, state: dict) -> None:
        self.update_gap, self.window = int(state["update_gap"]), int(state["window"])
        self.start, self.offset = int(state["start"]), int(state["offset"])
        self.loss_sum, self.loss_count = float(state["loss_sum"]), int(state["loss_count"])


class PlateauGap:
    """Grow the update gap when the loss stops improving: ``observe(loss, gap)`` takes a window's loss
    (the same on every rank) and returns the next window's gap. An EMA of the loss (``smoothing``) below
    ``(1 - threshold)`` times the best so far is an improvement; after ``patience`` windows without one
    the gap is multiplied by ``factor`` (capped at ``max_gap``) and the count restarts."""

    def __init__(self, *, patience: int = 3, threshold: float = 0.01, factor: float = 2.0,
                 max_gap: int = 1000, smoothing: float = 0.0):
        check_integer("patience", patience, 1, error=ValueError)
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"Invalid threshold: {threshold!r} (must be in [0, 1))")
        if not factor > 1.0:
            raise ValueError(f"Invalid factor: {factor!r} (must be > 1)")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"Invalid smoothing: {smoothing!r} (must be in [0, 1))")
        _check_gap(max_gap)
        self.patience, self.threshold, self.factor = patience, threshold, factor
        self.max_gap, self.smoothing = max_gap, smoothing
        self.ema = self.best = None
        self.bad = 0

    def observe(self, loss: float, gap: int) -> int:
        if not math.isfinite(loss):
            return gap  # a non-finite loss is the training loop's to handle, not a plateau
        self.ema = loss if self.ema is None else self.smoothing * self.ema + (1 - self.smoothing) * loss
        if self.best is None or self.ema < (1.0 - self.threshold) * self.best:
            self.best, self.bad = self.ema, 0
            return gap
        self.bad += 1
        if self.bad < self.patience:
            return gap
        self.bad = 0
        return min(self.max_gap, max(gap + 1, int(round(gap * self.factor))))

    def state_dict(self) -> dict:
        return {"ema": self.ema, "best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        self.ema, self.best, self.bad = state["ema"], state["best"], int(state["bad"])


def _check_gap(gap) -> None:
    check_integer("update_gap", gap, 1, error=ValueError)


# ---- the optimizer's clock: plain numbers in its first param group --------------------------------
def density_at(settings: Mapping, start: int) -> float:
    """The density of the window starting at step ``start`` under ``settings``' density keys."""
    if settings["density_schedule"] == "constant":
        return settings["density"]
    return scheduled_density(start, start=settings["density"], end=settings["density_end"],
                             steps=settings["density_steps"], kind=settings["density_schedule"])


def _load(holder: dict, settings: Mapping) -> WindowClock:
    """The clock as ``holder["clock"]`` keeps it (FRUGAL: ``param_groups[0]``; written only by a step
    or a loss, so a fresh optimizer has none and a resume that renews hyperparameters keeps the saved one)."""
    clock = WindowClock(settings["update_gap"])
    if holder.get("clock") is not None:
        clock.load_state_dict(holder["clock"])
    return clock


# Settings one window clock serves every projected group with (FRUGAL keeps them equal across groups).
CLOCK_SHARED = ("update_gap", "update_gap_growth", "plateau_patience", "plateau_threshold", "max_update_gap")


def clocked(group: Mapping) -> bool:
    """Whether ``group``'s windows need a clock (a density schedule or a growing gap)."""
    return group["density_schedule"] != "constant" or group["update_gap_growth"] > 1.0


def check_shared(groups: list[Mapping]) -> None:
    """The settings projected groups must share: every block-projected group the block walk's
    (``BLOCK_SHARED``); every projected group the clock's (``CLOCK_SHARED``) once one needs a clock.
    Raises HyperparameterError naming the key and both values."""
    split = [g for g in groups if g["projectable"] and not g["always_state_free"]]
    blocks = [g for g in split if g["projection"] == "block"]
    for members, keys, why in ((blocks, BLOCK_SHARED, "All block-projected groups must share"),
                               (split if any(clocked(g) for g in split) else [], CLOCK_SHARED,
                                "With a density schedule or a growing update gap all projected groups share "
                                "one window clock, so they must share")):
        for g in members[1:]:
            for k in keys:
                if g[k] != members[0][k]:
                    raise HyperparameterError(f"{why} {k}: got {members[0][k]!r} and {g[k]!r}")


def clock_settings(groups: list[Mapping]) -> dict | None:
    """The window clock's settings (None: no group needs one, windows are ``step // update_gap``)."""
    split = [g for g in groups if g["projectable"] and not g["always_state_free"] and clocked(g)]
    return {k: split[0][k] for k in CLOCK_SHARED + BLOCK_SHARED} if split else None


def advance_clock(holder: dict, settings: Mapping, step: int, *, blocks: Callable[[int], int] | None,
                  commit: bool) -> tuple[WindowClock, list[dict]]:
    """The clock kept in ``holder`` moved to ``step``, and the events of the move.

    ``settings`` holds the clock's settings (``update_gap``, ``update_gap_growth``, ``plateau_*``,
    ``max_update_gap``, the density keys); ``blocks(start)`` counts a window's state-full blocks.
    ``commit``: store the clock, let the plateau controller choose each new window's gap, report
    ``update_gap`` and ``density`` events. Without it nothing is decided or stored (the window and its
    first step do not depend on the decision, only the window's length does)."""
    clock = _load(holder, settings)
    if not commit:
        clock.tick(step, blocks=blocks)
        return clock, []
    plateau = None
    if settings["update_gap_growth"] > 1.0:
        plateau = PlateauGap(patience=settings["plateau_patience"], threshold=settings["plateau_threshold"],
                             factor=settings["update_gap_growth"], max_gap=settings["max_update_gap"] or sys.maxsize)
        saved = (holder.get("clock") or {}).get("plateau")
        if saved is not None:
            plateau.load_state_dict(saved)
    window, density = clock.window, density_at(settings, clock.start)
    events = clock.tick(step, blocks=blocks, plateau=plateau)
    holder["clock"] = {**clock.state_dict(), "plateau": None if plateau is None else plateau.state_dict()}
    new_density = density_at(settings, clock.start)
    if clock.window != window and new_density != density:
        event = {"event": "density", "window": clock.window, "density": new_density}
        if blocks is not None:
            event["state_full_blocks"] = blocks(clock.start)
        events.append(event)
    return clock, events


@dataclass
class ClockedLayout(Layout):
    """``windows.Layout`` whose windows a clock moves (a density schedule, a growing update gap)."""
    clock: dict | None = None  # the clock's settings (``clock_settings``)

    @classmethod
    def of(cls, groups: list[dict]) -> ClockedLayout:
        layout = super().of(groups)
        layout.clock = clock_settings(groups)
        return layout

    def window(self, holder: dict, step: int, commit: bool) -> tuple[Window, list[dict]]:
        """The window holding ``step`` and the schedules' events of reaching it. The clock lives in
        ``holder`` (FRUGAL: its first param group). ``commit`` (only a step) stores the clock and
        lets the plateau controller decide; a query never decides anything, so asking (e.g.
        ``active_blocks()``) cannot change a run."""
        blocks = None
        if self.blocks is not None:
            n, shared = len(self.blocks), self.block_settings
            blocks = lambda start: proj.block_count(n, density_at(shared, start), shared["block_granularity"])  # noqa: E731
        clock, events = advance_clock(holder, self.clock, step, blocks=blocks, commit=commit)
        return Window(step, clock, self._active(step, clock)), events

    def observe_loss(self, holder: dict, loss: float) -> None:
        if self.clock["update_gap_growth"] > 1.0:  # the loss goes to the current window of the kept clock
            clock = _load(holder, self.clock)
            clock.observe(loss)
            holder["clock"] = {"plateau": None, **(holder.get("clock") or {}), **clock.state_dict()}

    def _index(self, group: dict, step: int, clock) -> int:
        return super()._index(group, step, clock) if clock is None else clock.window

    def _group(self, group: dict, clock) -> dict:
        if clock is None or group["density_schedule"] == "constant":
            return group
        return {**group, "density": density_at(group, clock.start)}

    def _density(self, clock) -> float:
        return density_at(self.block_settings, clock.start)


def layout_of(groups: list[dict]) -> Layout:
    """The layout of ``groups``: a clocked one where a group needs a clock, else ``windows.Layout``."""
    return ClockedLayout.of(groups) if clock_settings(groups) is not None else Layout.of(groups)
