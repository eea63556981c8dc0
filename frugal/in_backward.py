"""FRUGAL's step inside backward: each block's tensors are updated as soon as their gradients are
complete, and the gradients are freed there, so the full set of gradients is never held at once.

    optimizer = frugal.FRUGAL(model, lr=5e-4, density=0.0, update_gap=500)
    stepper = frugal.step_in_backward(optimizer, max_norm=1.0)  # hooks on every parameter
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 1000))
    for batch in loader:
        for micro in batch[:-1]:            # gradient accumulation: the last micro-batch steps
            with stepper.accumulating():
                model(**micro).loss.backward()
        model(**batch[-1]).loss.backward()  # updates run here; the gradients are freed here
        optimizer.step()                    # the deferred tensors (clipping), the step count
        scheduler.step()
        print(float(stepper.grad_norm))     # the global norm before clipping, as clip_grad_norm_'s
    stepper.remove()                        # back to the ordinary step

What runs when (``StepInBackward``):

- **A block at a time.** A gradient that can be applied at once waits only for the rest of its block
  (a layer's weights and norms): the block's tensors then take one call of the optimizer's
  phases, with its multi-tensor kernels, instead of one call each; the block that completes last is
  applied when backward ends (an autograd engine callback). So at most one block's gradients are
  held besides those that wait for the clipping norm.
- **Selection at the step boundary.** Each tensor's role in the step (state-full, state-free or
  split: phase 1 of ``FRUGAL.step``) is fixed once per step, before the first tensor of that step
  is updated, with the window of the step's count; nothing about the subspace changes between two
  tensors of one backward.
- **Exact global clipping** (``max_norm``). A clipped gradient is ``c * g`` with ``c = max_norm /
  (norm + 1e-6)`` capped at 1 (``torch.nn.utils.clip_grads_with_norm_``), and ``c`` is known only
  once every gradient is. Rules whose update does not change when ``g`` is scaled
  (``StateFreeRule.scale_invariant``: signSGD, since sign(c g) = sign(g); ``none``) run at once;
  the others (state-full tensors, split tensors, an SGD state-free rule) keep their gradient until
  ``optimizer.step()``, which clips and applies them: their gradients are the memory the waiting
  costs (``deferred_bytes``). Without ``max_norm`` nothing waits. (One difference from clipping
  first: a subnormal gradient entry that ``c`` would round to zero keeps its sign here.)
- **Equal to the ordinary step.** Every tensor takes the same phases 2-5 as in ``FRUGAL.step``
  (``FRUGAL._apply``), with the step's learning rate (the scheduler steps after ``optimizer.step()``),
  so the weights equal ``backward(); clip_grad_norm_(); step()`` up to float rounding; one optimizer,
  one ``state_dict`` and one LR scheduler as before.
- **A bad gradient never half-applies silently.** Each block's gradients are checked before they
  are applied (their norms, one host sync per block); from the block holding the first
  non-finite one on, no tensor of the step is updated and ``optimizer.step()`` raises
  ``NonFiniteGradientError``, which says how many tensors had already taken the step (their weights
  are then one step ahead of the others).
- **Gradient accumulation** is exact: inside ``accumulating()`` the hooks do nothing, the
  gradients add up as usual, and the last micro-batch's backward steps on the sums (the memory
  saving then holds for that backward only: the accumulated gradients are full-size).
- **Data parallelism.** FSDP2 calls the hooks of its sharded parameters after the reduce-scatter,
  so each rank updates its shard from the reduced gradient, and the norm's partial sums are
  all-reduced once in ``optimizer.step()``. DDP's hooks fire before its all-reduce: do not combine
  it with this (train.py refuses it).
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.autograd import Variable

from .optimizer import _BATCH_TENSORS as BATCH
from .rules import STATE_FREE
from .sharding import is_dtensor, local
from .windows import FREE


def waiting_numel(optimizer, clipping: bool = True) -> int:
    """Elements whose gradients wait for ``optimizer.step()`` at the end of the next step's backward
    (with ``clipping``: every tensor whose rule is not ``scale_invariant``; without: none). The
    memory planner counts these gradients as held; block windows keep the count from window to
    window."""
    if not clipping:
        return 0
    layout = optimizer._get_layout()
    window = optimizer._window(optimizer.step_count, commit=False)
    return sum(t.param.numel() for t in layout.tensors(optimizer.param_groups, window)
               if t.param.requires_grad and _waits_for_norm(t))


def _waits_for_norm(slot) -> bool:
    return slot.role != FREE or not STATE_FREE[slot.group["state_free"]].scale_invariant


class NonFiniteGradientError(FloatingPointError):
    """A non-finite gradient (or norm) reached the step inside backward; the message says which
    tensors had already taken the step."""


def step_in_backward(optimizer, max_norm: float | None = None, model=None) -> "StepInBackward":
    """Attach ``StepInBackward`` to a ``frugal.FRUGAL`` optimizer (module docstring) and return it;
    ``model`` (optional) names the tensors in its messages."""
    return StepInBackward(optimizer, max_norm, model)


class StepInBackward:
    """Gradient hooks that run a FRUGAL optimizer's step a block at a time during backward."""

    def __init__(self, optimizer, max_norm: float | None = None, model=None):
        from .optimizer import FRUGAL

        if not isinstance(optimizer, FRUGAL):
            raise TypeError(f"the step inside backward needs a frugal.FRUGAL optimizer (got "
                            f"{type(optimizer).__name__}); valid choices: FRUGAL and the registry entries built on it")
        if optimizer._in_backward is not None:
            raise ValueError("this optimizer already steps inside backward; call .remove() on the first one")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r}: valid choices are None (no clipping) or a number > 0")
        self.optimizer, self.max_norm = optimizer, max_norm
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self.grad_norm: Tensor | None = None  # the last step's global norm (before clipping)
        self._skip = False
        self._reset()
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]
        optimizer._in_backward = self

    def remove(self) -> None:
        """Detach the hooks: ``optimizer.step()`` is the ordinary step again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.optimizer._in_backward is self:
            self.optimizer._in_backward = None

    @contextlib.contextmanager
    def accumulating(self):
        """Backward passes inside this block only accumulate gradients (no update)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    @property
    def applied(self) -> int:
        """Tensors that took the current step's update so far."""
        return self._applied

    @property
    def deferred_bytes(self) -> int:
        """Bytes of the gradients waiting for ``optimizer.step()`` right now (this rank's)."""
        return sum(local(p.grad).nbytes for p in self._deferred if p.grad is not None)

    def _reset(self) -> None:
        self._slots = None  # param -> windows.Slot of this step, fixed before its first update
        self._deferred: list[Tensor] = []
        self._seen: set[int] = set()  # parameters whose gradient this step has already taken
        self._norms: list[Tensor] = []  # each gradient's norm (this rank's part of it, sharded)
        self._sharded = False
        self._applied = 0
        self._bad: str | None = None  # the first non-finite gradient of the step
        self._norm: Tensor | None = None
        self._ready: list[tuple] = []  # (slot, gradient norm): gradients of one block, applied together
        self._ready_block = None  # the block of the ready gradients (tensors outside blocks join any)
        self._flush_queued = False

    def _begin(self) -> None:
        opt = self.optimizer
        self._slots = {id(t.param): t for t in opt._select(opt.step_count)}

    def _waits(self, slot) -> bool:
        return self.max_norm is not None and _waits_for_norm(slot)

    @torch.no_grad()
    def _hook(self, param: Tensor) -> None:
        if self._skip or param.grad is None:
            return
        if self._slots is None:
            self._begin()
        slot = self._slots.get(id(param))
        if slot is None:  # a parameter the optimizer does not hold
            return
        if id(param) in self._seen:
            raise RuntimeError(f"a second backward reached {self._name(param, slot)} before optimizer.step(): call "
                               f"optimizer.step() after each step's last backward, and run the backward passes of "
                               f"the other micro-batches inside stepper.accumulating()")
        self._seen.add(id(param))
        self._sharded |= is_dtensor(param.grad)
        norm = torch.linalg.vector_norm(local(param.grad))
        self._norms.append(norm)  # the global norm is taken as get_total_norm takes it: the same rounding
        if self._waits(slot):
            self._deferred.append(param)
            return
        # A new block starts a new batch; tensors outside blocks (norms, head) join the current one, or
        # make batches of their own of at most BATCH tensors (a model without blocks holds no more)
        if self._ready and (slot.block not in (None, self._ready_block)
                            or (self._ready_block is None and len(self._ready) == BATCH)):
            self._flush()
        self._ready.append((slot, norm))
        self._ready_block = slot.block if slot.block is not None else self._ready_block
        if not self._flush_queued:  # the block that completes last is applied when backward ends
            self._flush_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        with torch.no_grad():
            self._flush()

    def _flush(self) -> None:
        """Apply the ready gradients (one block's) in one call of the optimizer's phases, after one
        finiteness check of all of them; free them."""
        ready, self._ready, self._ready_block = self._ready, [], None
        if not ready:
            return
        if self._bad is None:
            finite = torch.isfinite(torch.stack([norm for _, norm in ready])).tolist()  # one host sync
            if not all(finite):
                slot = ready[finite.index(False)][0]
                self._bad = self._name(slot.param, slot)
        if self._bad is None:
            opt = self.optimizer
            opt._apply([opt._work(slot) for slot, _ in ready], opt.step_count)
            self._applied += len(ready)
        for slot, _ in ready:
            slot.param.grad = None

    def _name(self, param: Tensor, slot) -> str:
        name = self._names.get(id(param), f"parameter {slot.ident} of the optimizer")
        return f"{name} (shape {tuple(param.shape)})"

    def compute_grad_norm(self) -> Tensor:
        """The step's global gradient norm (a tensor, no host sync; sharded: one all-reduce). Call it
        after the last backward of the step; ``optimizer.step()`` calls it if you did not."""
        if self._norm is None:
            norms = self._norms or [torch.zeros(())]
            total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))  # as get_total_norm (fp32)
            if self._sharded:  # the ranks' parts: the norm of all of them
                import torch.distributed as dist

                total = total.float().square()
                dist.all_reduce(total)
                total = total.sqrt()
            self._norm = total
        return self._norm

    def finish(self) -> None:
        """``optimizer.step()``: apply the deferred tensors (clipped) and count the step."""
        opt, step = self.optimizer, self.optimizer.step_count
        if self._slots is None:  # no gradient this step (or only parameters it does not hold)
            self._begin()
        self._flush()  # in case backward ran outside the autograd engine's callbacks
        norm = self.compute_grad_norm()
        deferred, bad, applied = self._deferred, self._bad, self._applied
        if bad is None and not bool(torch.isfinite(norm)):
            bad = "the global gradient norm"
        self.grad_norm = norm
        if bad is not None:
            for p in deferred:
                p.grad = None
            self._reset()
            moved = (f"{applied} of the step's tensors had already taken it (their weights are one step ahead of the "
                     f"others)" if applied else "no tensor had taken it (the weights are those before the step)")
            raise NonFiniteGradientError(f"non-finite gradient in step {step + 1}: {bad}; the step stopped there: "
                                         f"{moved}")
        if deferred:
            if self.max_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(deferred, self.max_norm, norm, foreach=True)
            opt._apply([opt._work(self._slots[id(p)]) for p in deferred], step)
            for p in deferred:
                p.grad = None
        opt._set_step(step + 1)
        self._reset()
