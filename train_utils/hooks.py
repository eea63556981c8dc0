"""FRUGAL's loop hooks for any torch optimizer: what train.py asks an optimizer besides step().

FRUGAL (and the registry's other FRUGAL-family entries) answers these itself; a plain torch optimizer
(torch.optim.AdamW, Lion, Adam-mini, ...) gets the no-op answer. One adapter instead of a `hasattr`
probe at every call site, so the loop reads the same for every method.
"""
from __future__ import annotations


class OptimizerHooks:
    """`optimizer`'s own hook where it has one, the neutral answer otherwise."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def _own(self, name: str):
        return getattr(self.optimizer, name, None)

    def active_blocks(self):
        """The state-full blocks of the next step's window (None: no windows)."""
        own = self._own("active_blocks")
        return own() if own else None

    def observe_loss(self, loss: float) -> None:
        """Hand the global loss to an optimizer that adapts to it (the plateau-growing update gap)."""
        own = self._own("observe_loss")
        if own:
            own(loss)

    def pop_events(self) -> list[dict]:
        """Events since the last call (density / update-gap schedule changes); none for others."""
        own = self._own("pop_events")
        return own() if own else []

    def state_full_fraction(self) -> float | None:
        own = self._own("state_full_fraction")
        return own() if own else None

    def metrics(self) -> dict:
        """The optimizer's own numbers for the training row (`log_metrics()`: {name: number}); none for others."""
        own = self._own("log_metrics")
        return dict(own()) if own else {}

    def density_report(self) -> dict | None:
        own = self._own("density_report")
        return own() if own else None

    def materialize_state(self, step: int) -> None:
        """Create the state a checkpoint of `step` holds, before torch.distributed.checkpoint loads
        into it (FRUGAL: which tensors hold state depends on the window); others: nothing to do."""
        own = self._own("materialize_state")
        if own:
            own(step)
