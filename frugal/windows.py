"""Which tensors are state-full in a step's window (phase 1 of ``FRUGAL.step``).

A tensor's role in a step is ``FULL`` (non-projectable tensors, active blocks), ``FREE`` (inactive
blocks, ``always_state_free`` groups) or ``SPLIT`` (the other projections). ``Layout`` (rebuilt only
when the param groups change) holds each parameter's position (its subspace key), its block and the
settings block-projected groups share; ``Layout.window`` gives a step's window (``(step +
window_offset) // update_gap`` and its state-full blocks), ``Layout.tensors`` every parameter's role
in it. The opt-in schedules move windows by a clock (``frugal.adaptive.ClockedLayout``). The step, the
density report and ``materialize_state`` all read roles from here, so they cannot disagree.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from . import projections as proj

FULL, FREE, SPLIT = "state-full", "state-free", "split"
# Settings every block-projected group shares (one walk over all blocks); the opt-in clock reads them too.
BLOCK_SHARED = ("density", "update_gap", "window_offset", "block_order", "block_granularity", "seed",
                "density_schedule", "density_end", "density_steps")


class Window(NamedTuple):
    """One step's window: its clock (None: windows are ``step // update_gap``) and its state-full
    blocks (empty without block projection)."""
    step: int
    clock: object | None  # frugal.adaptive.WindowClock
    active: frozenset


class Slot(NamedTuple):
    """One parameter in one window."""
    group: dict  # its param group, with the window's density under a density schedule
    param: Tensor
    role: str  # FULL, FREE or SPLIT
    ident: int  # position among all parameters: keys the random subspace
    block: object  # its block (a layer index, or a position with granularity 'tensor'), or None
    window: int  # the subspace window index of the step


def role(group: dict, block, active: frozenset) -> str:
    """A tensor's role in a window whose state-full blocks are ``active``."""
    if group["always_state_free"]:
        return FREE
    if not group["projectable"]:
        return FULL
    if group["projection"] == "block":
        return FULL if block in active else FREE
    return SPLIT


@dataclass
class Layout:
    """Positions and blocks of the parameters; rebuilt when the param groups change."""
    idents: list[list[int]]
    block_of: list[list]  # per group, per parameter: its block, or None
    blocks: list | None  # sorted block ids; None without block projection
    block_settings: dict | None  # the settings every block-projected group shares
    active: tuple | None = None  # (window, frozenset of active blocks), memoised
    clock = None  # the settings of a window clock (frugal.adaptive.ClockedLayout); None: step // update_gap

    @classmethod
    def of(cls, groups: list[dict]) -> Layout:
        idents, block_of, n = [], [], 0
        for group in groups:
            idents.append(list(range(n, n + len(group["params"]))))
            block_of.append([None] * len(group["params"]))
            n += len(group["params"])
        blocked = [(gi, group) for gi, group in enumerate(groups)
                   if group["projectable"] and not group["always_state_free"] and group["projection"] == "block"]
        layout = cls(idents, block_of, None, None)
        if blocked:
            shared = {k: blocked[0][1][k] for k in BLOCK_SHARED}  # equal in every block group (add_param_group)
            count = 0
            for gi, group in blocked:
                for pi in range(len(group["params"])):
                    block_of[gi][pi] = count if shared["block_granularity"] == "tensor" else group["block"]
                    count += 1
            layout.blocks = sorted({b for row in block_of for b in row if b is not None})
            layout.block_settings = shared
        return layout

    def window(self, holder: dict, step: int, commit: bool) -> tuple[Window, list[dict]]:
        """The window holding ``step`` (and the schedules' events of reaching it: none here)."""
        return Window(step, None, self._active(step, None)), []

    def observe_loss(self, holder: dict, loss: float) -> None:
        """One training loss for the plateau-growing update gap (nothing without one)."""

    def _index(self, group: dict, step: int, clock) -> int:
        """The subspace window of ``step``: ``(step + window_offset) // update_gap`` (the offset at most
        ``update_gap - 1``: a first window shorter by it)."""
        gap = group["update_gap"]
        return (step + min(group.get("window_offset", 0), gap - 1)) // gap

    def _group(self, group: dict, clock) -> dict:
        """``group`` as the window sees it (a density schedule's density)."""
        return group

    def _density(self, clock) -> float:
        return self.block_settings["density"]

    def _active(self, step: int, clock) -> frozenset:
        """State-full blocks of the window holding ``step``."""
        if self.blocks is None:
            return frozenset()
        window = self._index(self.block_settings, step, clock)
        if self.active is None or self.active[0] != window:
            shared = self.block_settings
            chosen = proj.select_blocks(shared["block_order"], len(self.blocks), self._density(clock), window,
                                        shared["seed"], offset=None if clock is None else clock.offset,
                                        granularity=shared["block_granularity"])
            self.active = (window, frozenset(self.blocks[i] for i in chosen))
        return self.active[1]

    def tensors(self, groups: list[dict], window: Window) -> Iterator[Slot]:
        """Every parameter of ``groups`` (in order) with its role in ``window``."""
        for gi, group in enumerate(groups):
            group = self._group(group, window.clock)
            index = self._index(group, window.step, window.clock)
            for pi, p in enumerate(group["params"]):
                block = self.block_of[gi][pi]
                yield Slot(group, p, role(group, block, window.active), self.idents[gi][pi], block, index)
