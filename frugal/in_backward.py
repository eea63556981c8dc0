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
        print(float(stepper.grad_norm))     # the global norm before clipping (frugal.grad_norm's)
    stepper.remove()                        # back to the ordinary step

What runs when (``StepInBackward``; docs/in_backward.md has the guarantees and the refusals): a
block's tensors take one call of the optimizer's phases (``FRUGAL._apply``) once the block's gradients
are complete, the last block when backward ends; each tensor's role is fixed once per step. With
``max_norm``, ``scale_invariant`` rules run at once and the others wait for ``optimizer.step()``, which
clips them with the exact global norm (``grad_norm``). A non-finite gradient is found by the next
block's check (one host sync per block): nothing of the step is applied from then on and
``optimizer.step()`` raises ``NonFiniteGradientError``. ``accumulating()`` is exact; ``abort()``
(``optimizer.zero_grad()`` calls it) abandons a step after an error inside backward.
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


def tensor_norms(grads: list[Tensor]) -> list[Tensor]:
    """Each gradient's 2-norm in float32 (an FSDP2 shard: its local part), whatever its dtype."""
    return list(torch._foreach_norm([local(g) for g in grads], 2.0, dtype=torch.float32))


def total_norm(norms: list[Tensor], sharded: bool = False) -> Tensor:
    """The norm of per-tensor norms (float32); ``sharded``: of every rank's parts (one all-reduce)."""
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if sharded:
        import torch.distributed as dist

        total = total.square()
        dist.all_reduce(total)
        total = total.sqrt()
    return total


def grad_norm(params) -> Tensor:
    """The global gradient norm of ``params`` (in this order), the one formula of both schedules:
    float32 per-tensor norms, then their float32 norm (all-reduced over FSDP2 shards). Over bf16
    gradients it does not round to bf16 as ``torch.nn.utils.get_total_norm`` does. No host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    return total_norm(tensor_norms(grads), any(is_dtensor(g) for g in grads))


def waiting_numel(optimizer, clipping: bool = True) -> int:
    """Elements whose gradients wait for ``optimizer.step()`` after the next step's backward (with
    ``clipping``: every tensor whose rule is not ``scale_invariant``): gradients the planner counts as held."""
    if not clipping:
        return 0
    layout = optimizer._get_layout()
    window = optimizer._window(optimizer.step_count, commit=False)
    return sum(t.param.numel() for t in layout.tensors(optimizer.param_groups, window)
               if t.param.requires_grad and _waits_for_norm(t))


def _waits_for_norm(slot) -> bool:
    return slot.role != FREE or not STATE_FREE[slot.group["state_free"]].scale_invariant


class NonFiniteGradientError(FloatingPointError):
    """A non-finite gradient (or norm) reached the step inside backward; the message names the first
    bad tensor and says which tensors had already taken the step."""


def step_in_backward(optimizer, max_norm: float | None = None, model=None) -> "StepInBackward":
    """Attach ``StepInBackward`` to a ``frugal.FRUGAL`` optimizer (module docstring) and return it;
    ``model`` (optional) names the tensors in its messages, and a DDP-wrapped one is refused."""
    return StepInBackward(optimizer, max_norm, model)


def _refuse_reduction_after_hooks(model, params: list[Tensor]) -> None:
    """DDP (and any all-reduce after backward) reduces gradients after the hooks have used them."""
    import torch.distributed as dist

    why = ("its all-reduce runs after the gradient hooks, so each rank would step from its own gradient; valid "
           "choices: FSDP2 (torch.distributed.fsdp.fully_shard, whose hooks see the reduced shards), one process, "
           "or the ordinary step")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"the step inside backward cannot drive a DDP-wrapped model: {why}")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
            and not all(is_dtensor(p) for p in params):
        raise ValueError(f"the step inside backward over {dist.get_world_size()} processes needs FSDP2-sharded "
                         f"parameters (got plain tensors: DDP, or an all-reduce after backward): {why}")


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
        growth = max(g.get("update_gap_growth", 1.0) for g in optimizer.param_groups)
        if growth > 1.0:  # its clock reads the step's loss (observe_loss) before the window is chosen
            raise ValueError(f"update_gap_growth={growth!r}: the plateau-grown update gap chooses a step's window from "
                             f"that step's loss, which is known only after the backward in which the step inside "
                             f"backward must already choose it; valid choices: update_gap_growth=1.0, or the ordinary "
                             f"step")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        _refuse_reduction_after_hooks(model, params)
        self.optimizer, self.max_norm = optimizer, max_norm
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._position = {id(p): i for i, p in enumerate(params)}  # the norm's order: grad_norm(params)'s
        self.grad_norm: Tensor | None = None  # the last step's global norm (before clipping)
        self._skip = False
        self._reset()
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

    def abort(self) -> None:
        """Abandon the current step after an exception inside backward: free its gradients, do not count it
        (tensors already ``applied`` keep their update). ``optimizer.zero_grad()`` calls this."""
        for slot in (self._slots or {}).values():
            slot.param.grad = None
        self._reset()

    @property
    def applied(self) -> int:
        """Tensors that took the current step's update so far."""
        return len(self._applied)

    @property
    def deferred_bytes(self) -> int:
        """Bytes of the gradients waiting for ``optimizer.step()`` right now (this rank's)."""
        return sum(local(p.grad).nbytes for p in self._deferred if p.grad is not None)

    def _reset(self) -> None:
        self._slots = None  # id(param) -> windows.Slot of this step, fixed before its first update
        self._deferred: list[Tensor] = []
        self._seen: set[int] = set()  # parameters whose gradient this step has already taken
        self._norms: dict[int, Tensor] = {}  # position in the optimizer -> the gradient's norm (this rank's part)
        self._unchecked: list[tuple] = []  # (slot, norm) taken since the last finiteness check, in order
        self._sharded = False
        self._applied: list = []  # the slots that took the step's update so far
        self._bad: str | None = None  # the first non-finite gradient of the step
        self._norm: Tensor | None = None
        self._ready: list = []  # slots of one block, applied together
        self._ready_block = None  # the block of the ready gradients (tensors outside blocks join any)
        self._in_pass = False  # a backward of this step has begun and its end callback has not run

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
            raise RuntimeError(self._second_backward(param, slot))
        if not self._in_pass:  # the block that completes last is applied when backward ends
            self._in_pass = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self._take(slot)

    def _take(self, slot) -> None:
        """Count one complete gradient in the norm; apply it with its block, or keep it for the norm."""
        param = slot.param
        self._seen.add(id(param))
        self._sharded |= is_dtensor(param.grad)
        norm = tensor_norms([param.grad])[0]
        self._norms[self._position[id(param)]] = norm
        self._unchecked.append((slot, norm))
        if self._waits(slot):
            self._deferred.append(param)
            return
        # A new block starts a new batch; tensors outside blocks (norms, head) join the current one, or
        # make batches of their own of at most BATCH tensors (a model without blocks holds no more)
        if self._ready and (slot.block not in (None, self._ready_block)
                            or (self._ready_block is None and len(self._ready) == BATCH)):
            self._flush()
        self._ready.append(slot)
        self._ready_block = slot.block if slot.block is not None else self._ready_block

    def _second_backward(self, param: Tensor, slot) -> str:
        name, moved = self._name(param, slot), f"{self.applied} tensors had taken the step"
        if self._in_pass:
            return (f"a backward reached {name} again while an earlier backward of this step had not finished (it "
                    f"stopped with an error after {moved}): call stepper.abort() or optimizer.zero_grad() to abandon "
                    f"that step first")
        return (f"a second backward reached {name} before optimizer.step() ({moved}): call optimizer.step() after "
                f"each step's last backward, and run the backward passes of the other micro-batches inside "
                f"stepper.accumulating()")

    def _end_of_backward(self) -> None:
        self._in_pass = False
        with torch.no_grad():
            self._flush()

    def _check(self) -> None:
        """One finiteness check (one host sync) of every gradient taken since the last one."""
        unchecked, self._unchecked = self._unchecked, []
        if self._bad is None and unchecked:
            finite = torch.isfinite(torch.stack([norm for _, norm in unchecked])).tolist()
            if not all(finite):
                slot = unchecked[finite.index(False)][0]
                self._bad = self._name(slot.param, slot)

    def _flush(self) -> None:
        """Apply the ready gradients (one block's) in one call of the optimizer's phases, after one
        finiteness check of them and of the waiting ones taken before them; free them."""
        ready, self._ready, self._ready_block = self._ready, [], None
        if not ready:
            return
        self._check()
        if self._bad is None:
            opt = self.optimizer
            opt._apply([opt._work(slot) for slot in ready], opt.step_count)
            self._applied += ready
        for slot in ready:
            slot.param.grad = None

    def _name(self, param: Tensor, slot) -> str:
        name = self._names.get(id(param), f"parameter {slot.ident} of the optimizer")
        return f"{name} (shape {tuple(param.shape)})"

    def compute_grad_norm(self) -> Tensor:
        """The step's global gradient norm, ``grad_norm(params)``'s formula and order (no host sync), after
        the step's last backward (it takes the gradients backward did not reach); ``optimizer.step()`` calls it."""
        if self._norm is None:
            self._take_the_rest()
            self._norm = total_norm([self._norms[i] for i in sorted(self._norms)], self._sharded)
        return self._norm

    def _take_the_rest(self) -> None:
        """Gradients accumulated in earlier micro-batches for tensors the last backward did not reach."""
        if self._slots is None:  # no gradient this step (or only parameters it does not hold)
            self._begin()
        for slot in self._slots.values():
            if id(slot.param) not in self._seen and slot.param.grad is not None and slot.param.requires_grad:
                self._take(slot)
        with torch.no_grad():
            self._flush()  # also what backward ran outside the autograd engine's callbacks

    def _moved(self) -> str:
        if not self._applied:
            return "no tensor had taken it (the weights are those before the step)"
        names = [self._name(s.param, s) for s in self._applied]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"{len(names)} of the step's tensors had already taken it, those applied before it in backward "
                f"({shown}; their weights are one step ahead of the others)")

    def finish(self) -> None:
        """``optimizer.step()``: apply the deferred tensors (clipped) and count the step."""
        opt, step = self.optimizer, self.optimizer.step_count
        if self._in_pass and self._slots is not None:
            raise RuntimeError(f"optimizer.step() after a backward that did not finish (it stopped with an error after "
                               f"{self.applied} tensors had taken the step): call stepper.abort() or "
                               f"optimizer.zero_grad() to abandon the step")
        norm = self.compute_grad_norm()
        written = [self._name(s.param, s) for s in self._applied if s.param.grad is not None]
        if written:
            self.abort()
            raise RuntimeError(f"gradients were written after the step inside backward had applied them ({written[0]}"
                               f" and {len(written) - 1} more): something reduces or accumulates gradients after the "
                               f"hooks (DDP?); valid choices: FSDP2, one process, or the ordinary step")
        bad = self._bad
        if bad is None and not bool(torch.isfinite(norm)):  # the step's one host sync here
            self._check()  # the tensors taken since the last block's check: which one
            bad = self._bad or "the global gradient norm (every gradient is finite: their norm overflows)"
        self.grad_norm = norm
        if bad is not None:
            moved = self._moved()
            self.abort()
            raise NonFiniteGradientError(f"non-finite gradient in step {step + 1}: {bad}; the step stopped there: "
                                         f"{moved}")
        deferred = self._deferred
        if deferred:
            if self.max_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(deferred, self.max_norm, norm, foreach=True)
            opt._apply([opt._work(self._slots[id(p)]) for p in deferred], step)
            for p in deferred:
                p.grad = None
        opt._set_step(step + 1)
        self._reset()
