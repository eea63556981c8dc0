"""The state-free part on the wire as one bit per element: a majority vote under DDP (opt-in).

With the vote, each rank sends only the signs of its state-free gradient, packed 8 to a byte, and
the update is ``sign(sum_i sign(g_i))`` (signSGD with majority vote, Bernstein et al., 2019) instead
of the sign of the exact all-reduced mean; state-full and split tensors keep the exact all-reduce.

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = frugal.FRUGAL(model, lr=1e-3, density=0.25)
    vote = frugal.comm.attach_vote(ddp, optimizer)  # DDP's communication hook (None on one process)
    loss.backward()                                  # the hook votes, bucket by bucket
    norm = vote.clip_grad_norm_(model.parameters(), 1.0)  # never reads the votes
    optimizer.step()                                 # refused if the roles changed since

docs/communication.md, "What is voted, and how", defines it all; ``majority_vote`` is the
one-process reference. In brief: a rank's sign is +1 where its gradient is > 0 and -1 elsewhere
(zero, NaN), so the vote is never 0; a tie takes the sign of rank (i + k) mod W for element i of
the optimizer's parameter k (``tie_ranks``: independent of DDP's buckets). Voted: tensors wholly
state-free in the step's window (``FRUGAL.next_roles()``) with rule ``signsgd``; the others are
reduced as DDP does (x 1/W, summed). Per bucket, an all-to-all of packed signs and an all-gather of
packed votes, (W-1) e/8 bytes per rank and phase. ``grad_norm`` is sqrt(exact norm^2 + B^2), B the
mean of the ranks' local norms of their voted gradients. The step pre-hook raises
``RoleMismatchError`` when the roles differ from those voted with. ``VoteHook.last`` (``CommStats``)
counts the bytes sent. Not here: FSDP2, the step inside backward, non-FRUGAL optimizers, error feedback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .windows import FREE

VOTED_RULES = ("signsgd",)  # state-free rules whose update is sign(g): sign(vote) = vote
_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)  # bit 7 of a byte is its first element


class RoleMismatchError(RuntimeError):
    """The optimizer's roles at ``step()`` are not those the communication hook voted with."""


# ---- packing --------------------------------------------------------------------------------------
def _shifts(device) -> Tensor:
    return torch.tensor(_SHIFTS, dtype=torch.uint8, device=device)


def pack_bits(bits: Tensor) -> Tensor:
    """Booleans (length a multiple of 8) packed 8 to a byte, the first in the highest bit."""
    if bits.numel() % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 booleans, got {bits.numel()}")
    as_bytes = bits.reshape(-1, 8).view(torch.uint8) if bits.dtype == torch.bool else bits.reshape(-1, 8)
    return (as_bytes << _shifts(bits.device)).sum(1, dtype=torch.uint8)


_TABLES: dict = {}


def _table(device, dtype) -> Tensor:
    """(256, 8): the 8 elements a byte packs, as 0/1 (uint8) or -1/+1 (a float dtype)."""
    key = (str(device), dtype)
    if key not in _TABLES:
        bits = (torch.arange(256, dtype=torch.int32).reshape(-1, 1) >> torch.tensor(_SHIFTS, dtype=torch.int32)) & 1
        _TABLES[key] = (bits.to(torch.uint8) if dtype == torch.uint8 else (bits * 2 - 1).to(dtype)).to(device)
    return _TABLES[key]


def unpack_bits(packed: Tensor, n: int | None = None) -> Tensor:
    """The booleans of ``pack_bits`` (the first ``n``; all without ``n``)."""
    bits = unpack_table(packed, torch.uint8).view(torch.bool)
    return bits if n is None else bits[:n]


def unpack_table(packed: Tensor, dtype) -> Tensor:
    """Every element ``packed`` holds, looked up a byte at a time: 0/1 for uint8, -1/+1 for a float dtype."""
    return _table(packed.device, dtype).index_select(0, packed.reshape(-1).int()).reshape(-1)


def sign_bits(x: Tensor) -> Tensor:
    """A rank's one-bit signs: True (+1) where ``x > 0``, False (-1) elsewhere (zeros, NaN)."""
    return x > 0


def chunk_layout(n: int, world: int) -> tuple[int, int]:
    """(e, c): the elements of each rank's chunk of n voted elements (a multiple of 8, W e >= n)
    and its bytes (e / 8)."""
    e = max(8, -(-n // (8 * world)) * 8)
    return e, e // 8


def vote_chunk(bits: Tensor, tie: Tensor) -> Tensor:
    """The vote on one chunk: ``bits`` (W, e) are the ranks' signs (bool or 0/1), ``tie`` (e,) the rank
    whose sign breaks each element's tie. True: +1."""
    return _vote(bits, bits.gather(0, tie.reshape(1, -1)).reshape(-1))


def _vote(bits: Tensor, tie_bits: Tensor) -> Tensor:
    world = bits.shape[0]
    margin = 2 * bits.sum(0, dtype=torch.int16) - world
    return torch.where(margin == 0, tie_bits.bool(), margin > 0)


def tie_bits(bits: Tensor, numels: list[int], idents: list[int], world: int, start: int) -> Tensor:
    """What ``vote_chunk`` reads with ``tie_ranks``, without an index per element: the tie-breaking
    rank's bit of each element of the chunk ``bits`` (W, e) that starts at element ``start`` of
    parameters laid end to end; W strided copies per parameter in the chunk."""
    e = bits.shape[1]
    out = bits[0].clone()  # padding: any bit
    offset = 0
    for k, ident in zip(numels, idents):
        lo, hi = max(start, offset), min(start + e, offset + k)
        if lo < hi:
            first = (lo - offset + ident) % world  # the rank of the segment's first element
            for m in range(min(world, hi - lo)):
                out[lo - start + m:hi - start:world] = bits[(first + m) % world, lo - start + m:hi - start:world]
        offset += k
    return out


def vote_own_chunk(received: Tensor, world: int, numels: list[int], idents: list[int], rank: int) -> Tensor:
    """The hook's vote on this rank's chunk, from the all-to-all's packed bits of every rank; packed."""
    bits = unpack_table(received, torch.uint8).reshape(world, -1)
    e = bits.shape[1]
    return pack_bits(_vote(bits, tie_bits(bits, numels, idents, world, rank * e)))


def tie_ranks(numels: list[int], idents: list[int], world: int, start: int = 0, stop: int | None = None,
              device=None) -> Tensor:
    """The tie-breaking rank of elements ``start:stop`` of parameters laid end to end (their sizes
    ``numels``, their positions ``idents`` among the optimizer's): (i + ident) mod W for element i of
    its parameter; 0 past the end (padding)."""
    stop = sum(numels) if stop is None else stop
    out = torch.zeros(stop - start, dtype=torch.long, device=device)
    offset = 0
    for k, ident in zip(numels, idents):
        lo, hi = max(start, offset), min(stop, offset + k)
        if lo < hi:
            out[lo - start:hi - start] = (torch.arange(lo - offset, hi - offset, device=device) + ident) % world
        offset += k
    return out


def majority_vote(grads: list[Tensor] | Tensor, tie: Tensor | None = None) -> Tensor:
    """The one-process reference of the hook's vote: ``grads`` holds W ranks' flat gradients (equal
    lengths n; a (W, n) tensor or a list), ``tie`` (n,) each element's tie-breaking rank
    (``tie_ranks``; default: element i's is i mod W, one parameter at position 0). Returns the vote as
    float32 +-1 (n,), through the hook's padding and chunks."""
    stacked = grads if isinstance(grads, Tensor) else torch.stack([g.reshape(-1) for g in grads])
    world, n = stacked.shape
    tie = tie_ranks([n], [0], world, device=stacked.device) if tie is None else tie
    e, _ = chunk_layout(n, world)
    bits = torch.zeros(world, e * world, dtype=torch.bool, device=stacked.device)
    bits[:, :n] = sign_bits(stacked)
    ties = torch.zeros(e * world, dtype=torch.long, device=stacked.device)
    ties[:n] = tie
    votes = torch.cat([vote_chunk(bits[:, r * e:(r + 1) * e], ties[r * e:(r + 1) * e]) for r in range(world)])
    return votes[:n].float() * 2 - 1


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: a reduce-scatter and an all-gather,
    each (W-1) chunks of nbytes / W."""
    return 0 if world < 2 else 2 * (world - 1) * nbytes // world


# ---- the hook -------------------------------------------------------------------------------------
@dataclass
class CommStats:
    """What one rank sent in one step (bytes, by the collectives' algorithms) and what it voted."""
    exact_bytes: int = 0  # the all-reduce of exact tensors
    vote_bytes: int = 0  # the two phases of packed signs (padding included)
    norm_bytes: int = 0  # the scalar all-reduce of the state-free norm bound
    exact_elements: int = 0
    voted_elements: int = 0
    buckets: int = 0

    @property
    def bytes_sent(self) -> int:
        return self.exact_bytes + self.vote_bytes + self.norm_bytes


@dataclass
class _Record:
    step: int
    voted: dict  # {id of a voted parameter: its position among the optimizer's (ties)}
    stats: CommStats = field(default_factory=CommStats)
    free_sq: Tensor | None = None  # this rank's squared local norm of its voted gradients
    bound: Tensor | None = None  # the all-reduced bound B (after the last bucket)
    params: list = field(default_factory=list)  # every parameter whose gradient passed the hook
    layout: list = field(default_factory=list)  # per bucket, its voted parameters in order (what was voted on)


class VoteHook:
    """DDP communication hook: exact all-reduce of the exact tensors, majority vote of the voted
    ones (module docstring). ``attach_vote`` builds and registers it."""

    def __init__(self, optimizer, process_group=None):
        import torch.distributed as dist

        from . import unwrap
        from .optimizer import FRUGAL

        self.optimizer = unwrap(optimizer)
        if not isinstance(self.optimizer, FRUGAL):
            raise TypeError(f"the state-free vote needs an optimizer built on FRUGAL (it asks for each tensor's "
                            f"role); got {type(self.optimizer).__name__}")
        if getattr(self.optimizer, "_in_backward", None) is not None:
            raise ValueError("the state-free vote cannot run with the step inside backward: each tensor is "
                             "stepped before DDP reduces its gradient")
        self.dist = dist
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._record: _Record | None = None  # the iteration in flight, then the one the next step checks
        self._pending: list = []
        self.last: CommStats | None = None  # the last completed iteration's counts
        self.last_layout: list = []  # its buckets' voted parameters, in order (majority_vote's input)
        self._handle = self.optimizer.register_step_pre_hook(self._check_step)

    # ---- roles ---------------------------------------------------------------------------------
    def voted_params(self) -> dict:
        """{id: position among the optimizer's parameters} of those voted in the optimizer's next step."""
        return {id(t.param): t.ident for t in self.optimizer.next_roles()
                if t.role == FREE and t.group["state_free"] in VOTED_RULES}

    def _check_step(self, optimizer, args, kwargs) -> None:
        record, self._record = self._record, None
        if self._pending:
            raise RoleMismatchError("optimizer.step() before the communication hook finished its buckets")
        now = self.voted_params()
        if record is None:
            if any(t.param.grad is not None for t in optimizer.next_roles() if id(t.param) in now):
                raise RoleMismatchError("the state-free vote: this step's gradients did not pass the DDP "
                                        "communication hook (a backward under no_sync, or a second step)")
            return
        if record.step != optimizer.step_count or record.voted != now:
            raise RoleMismatchError(f"the state-free vote: the hook voted for step {record.step + 1} with "
                                    f"{len(record.voted)} voted tensors, but the optimizer is about to take step "
                                    f"{optimizer.step_count + 1} with {len(now)} (the roles changed between "
                                    f"backward and step: a load_state_dict, add_param_group or a skipped step); "
                                    f"the update would apply votes to state-full tensors or the reverse")

    def remove(self) -> None:
        """Detach the optimizer's check (the DDP hook itself cannot be unregistered)."""
        self._handle.remove()

    # ---- per bucket ----------------------------------------------------------------------------
    def hook(self, state, bucket):
        """DDP's communication hook (``register_comm_hook(None, vote.hook)``): a future of the bucket."""
        fut = torch.futures.Future()
        try:
            if not self._pending:  # the first bucket of an iteration
                self._record = _Record(self.optimizer.step_count, self.voted_params())
            self._pending.append((self._launch(bucket), fut))
            if bucket.is_last():
                self._finish()
        except Exception as err:  # every bucket's future fails, so DDP raises instead of waiting
            for _, f in self._pending:
                if not f.done():
                    f.set_exception(err)
            self._pending = []
            if not fut.done():
                fut.set_exception(err)
        return fut

    def _launch(self, bucket) -> dict:
        """Start the bucket's exact all-reduce and its all-to-all of packed signs (asynchronous)."""
        dist, record, world = self.dist, self._record, self.world
        buffer, params, grads = bucket.buffer(), bucket.parameters(), bucket.gradients()
        record.params.extend(params)
        record.stats.buckets += 1
        voted = [id(p) in record.voted for p in params]
        record.layout.append([p for p, v in zip(params, voted) if v])
        entry = {"buffer": buffer}
        exact = [g for g, v in zip(grads, voted) if not v]
        free = [g for g, v in zip(grads, voted) if v]
        if exact:
            # DDP's own reduction: scaled by 1/W (a multiplication, as its reducer does), then summed
            flat = buffer if not free else torch.cat([g.reshape(-1) for g in exact])
            flat.mul_(1.0 / world)
            entry["exact"] = (exact, flat, dist.all_reduce(flat, group=self.group, async_op=True))
            record.stats.exact_bytes += ring_bytes(flat.numel() * flat.element_size(), world)
            record.stats.exact_elements += flat.numel()
        if free:
            n = sum(g.numel() for g in free)
            e, c = chunk_layout(n, world)
            bits = torch.zeros(e * world, dtype=torch.bool, device=buffer.device)
            sq = torch.zeros((), dtype=torch.float64, device=buffer.device)
            offset = 0
            for g in free:
                k = g.numel()
                torch.gt(g.reshape(-1), 0, out=bits[offset:offset + k])
                sq += torch.linalg.vector_norm(g, dtype=torch.float64).square()
                offset += k
            record.free_sq = sq if record.free_sq is None else record.free_sq + sq
            packed = pack_bits(bits)
            received = torch.empty_like(packed)
            work = dist.all_to_all_single(received, packed, group=self.group, async_op=True)
            idents = [record.voted[id(p)] for p, v in zip(params, voted) if v]
            entry["free"] = (free, n, e, c, idents, received, work)
            record.stats.vote_bytes += 2 * (world - 1) * c  # this all-to-all and the all-gather
            record.stats.voted_elements += n
        return entry

    def _finish(self) -> None:
        """After the last bucket: every bucket's vote (in bucket order, the same on every rank), the
        norm bound, and the futures DDP waits for."""
        dist, record = self.dist, self._record
        for entry, fut in self._pending:
            if "free" in entry:
                free, n, e, c, idents, received, work = entry["free"]
                work.wait()
                votes = vote_own_chunk(received, self.world, [g.numel() for g in free], idents, self.rank)
                gathered = torch.empty(c * self.world, dtype=torch.uint8, device=votes.device)
                _all_gather(gathered, votes, self.group)
                _unflatten_into(free, unpack_table(gathered, free[0].dtype))  # +-1 in the gradients' dtype
        if record.free_sq is not None:  # B: the ranks' mean local norm of the voted gradients
            bound = record.free_sq.sqrt().reshape(1)
            dist.all_reduce(bound, group=self.group)
            record.bound = (bound / self.world).reshape(())
            record.stats.norm_bytes += ring_bytes(bound.element_size(), self.world)
        for entry, fut in self._pending:
            if "exact" in entry:
                exact, flat, work = entry["exact"]
                work.wait()
                if flat is not entry["buffer"]:
                    _unflatten_into(exact, flat)
            fut.set_result(entry["buffer"])
        self._pending = []
        self.last, self.last_layout = record.stats, record.layout

    # ---- the norm ------------------------------------------------------------------------------
    def grad_norm(self, params) -> Tensor:
        """The norm the state-full update is clipped with (module docstring): exact tensors' norm
        combined with the bound B of the voted ones; identical on every rank. Votes are not read."""
        record = self._record
        voted = record.voted if record is not None else {}
        exact = [p.grad for p in params if p.grad is not None and id(p) not in voted]
        parts = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in exact]
        if record is not None and record.bound is not None:
            parts.append(record.bound.to(torch.float32))
        if not parts:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack([p.to(parts[0].device) for p in parts]))

    def clip_grad_norm_(self, params, max_norm: float | None) -> Tensor:
        """``grad_norm``, and the exact tensors clipped to ``max_norm`` with it (when set)."""
        params = list(params)
        norm = self.grad_norm(params)
        if max_norm:
            record = self._record
            voted = record.voted if record is not None else {}
            exact = [p for p in params if p.grad is not None and id(p) not in voted]
            torch.nn.utils.clip_grads_with_norm_(exact, max_norm, norm, foreach=True)
        return norm


def _unflatten_into(grads: list[Tensor], flat: Tensor) -> None:
    """Copy consecutive slices of ``flat`` into ``grads``."""
    for g, part in zip(grads, flat[:sum(g.numel() for g in grads)].split([g.numel() for g in grads])):
        g.copy_(part.reshape(g.shape))


def _all_gather(out: Tensor, chunk: Tensor, group) -> None:
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, chunk, group=group)


def attach_vote(ddp_model, optimizer, process_group=None) -> VoteHook | None:
    """Register the state-free vote on a DistributedDataParallel model; return the hook (None on one
    process: nothing to communicate, nothing changes). Call before the first backward."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return None
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"the state-free vote is a DDP communication hook; got {type(ddp_model).__name__} "
                        f"(FSDP2's reduce-scatter has no such hook)")
    hook = VoteHook(optimizer, process_group)
    ddp_model.register_comm_hook(None, hook.hook)
    return hook


def count_allreduce_hook(stats: list):
    """A DDP hook that reduces as DDP's built-in reduction does (x 1/W, summed) and appends each
    bucket's ring bytes to ``stats``: the ``exact`` mode's counter for measurements."""
    import torch.distributed as dist

    def hook(state, bucket):
        buffer = bucket.buffer()
        world = dist.get_world_size()
        buffer.mul_(1.0 / world)
        stats.append(ring_bytes(buffer.numel() * buffer.element_size(), world))
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook


def payload_ratio(full_elements: int, free_elements: int, element_size: int = 4) -> float:
    """Bytes of ``vote`` over bytes of ``exact`` for one step by the ring model, padding ignored:
    the state-full share plus 1/(8 element_size) of the state-free share (both exchanges cost the
    same factor 2 (W-1)/W)."""
    total = full_elements + free_elements
    return (full_elements + free_elements / (8 * element_size)) / total if total else math.nan
