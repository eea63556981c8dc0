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

    def _call(self, name: str, default, *args):
        own = getattr(self.optimizer, name, None)
        return own(*args) if own else default

    def active_blocks(self):
        """The state-full blocks of the next step's window (None: no windows)."""
        return self._call("active_blocks", None)

    def observe_loss(self, loss: float) -> None:
        """Hand the global loss to an optimizer that adapts to it (the plateau-growing update gap)."""
        self._call("observe_loss", None, loss)

    def pop_events(self) -> list[dict]:
        """Events since the last call (density / update-gap schedule changes); none for others."""
        return self._call("pop_events", [])

    def state_full_fraction(self) -> float | None:
        return self._call("state_full_fraction", None)

    def metrics(self) -> dict:
        """The optimizer's own numbers for the training row (`log_metrics()`: {name: number}); none for others."""
        return dict(self._call("log_metrics", {}))

    def density_report(self) -> dict | None:
        return self._call("density_report", None)

    def materialize_state(self, step: int) -> None:
        """Create the state a checkpoint of `step` holds, before torch.distributed.checkpoint loads
        into it (FRUGAL: which tensors hold state depends on the window); others: nothing to do."""
        self._call("materialize_state", None, step)
