"""Processes and devices for train.py: the Accelerator, parallelism, collective timeouts, a sweep guard.

accelerate picks the device and backend (NCCL on GPU, gloo on CPU: cpu=True makes it form a gloo group
under torchrun); precision is ours, so it adds no autocast. `wrap_model`: ddp keeps gradients as views
of its buckets (one fp32 copy only if zeroed in place: `zero_grad_sets_to_none`); fsdp applies FSDP2's
`fully_shard` to every block and the root (DTensor shards, FRUGAL steps on them: frugal/sharding.py),
bf16-mixed as bf16 weights with fp32 reduce-scatter into fp32 shards (autocast stays on), fp32 and pure
bf16 in their own dtype. FSDP2 reduce-scatters every micro-batch: skipping the sync would hold unsharded
fp32 gradients (25 GiB at 7B, docs/memory_plan.md). `train.collective_timeout_s` bounds the wait for a
frozen rank; it must exceed the longest legitimate wait (rank 0 writing a checkpoint, the slowest
evaluation). `name_unresponsive_ranks` then names the ranks that do not answer through the rendezvous
store every process already uses: a gloo side group would be one more rendezvous, which fails or hangs
where the hostname resolves to the wrong interface. (NCCL's watchdog may abort before Python sees it.)
"""
from __future__ import annotations

import datetime
import os

import torch

_MONITOR_WAIT_S = 30.0  # how long the diagnosis waits for the ranks that still answer


class CollectiveTimeout(RuntimeError):
    """A rank stopped answering; the message names it when the monitored barrier could."""


def make_accelerator(collective_timeout_s: float):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=collective_timeout_s)),
                DistributedDataParallelKwargs(gradient_as_bucket_view=True)]
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no", kwargs_handlers=handlers)


PARALLELISMS = ("ddp", "fsdp")


# The transformer blocks (FSDP2 units, compiled layers): frugal's one rule, from the module structure.
from frugal.grouping import transformer_blocks  # noqa: E402


def wrap_model(accelerator, model, parallelism: str = "ddp", precision: str = "bf16-mixed"):
    """To the device; with ddp a DDP wrapper when there are several processes (the module that runs
    the forward pass; the raw model stays `model`); with fsdp `model` itself, sharded in place."""
    if parallelism == "ddp":
        return accelerator.prepare_model(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch.distributed.is_initialized():
        # One process (accelerate forms no group then): FSDP2 still needs a process group and a mesh.
        # A private in-memory store: nothing to rendezvous with; accelerator.end_training() destroys it.
        torch.distributed.init_process_group("nccl" if accelerator.device.type == "cuda" else "gloo",
                                             store=torch.distributed.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    model.to(accelerator.device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16-mixed" else MixedPrecisionPolicy()
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_ddp(model) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def zero_grad_sets_to_none(model) -> bool:
    """How the loop clears gradients after a step: in place (False) for DDP with bucket views, where
    set_to_none makes each no_sync micro-batch allocate a second fp32 copy beside the buckets (measured:
    docs/memory_plan.md); None elsewhere (one process, FSDP2), freeing their memory between steps."""
    return not (is_ddp(model) and model.gradient_as_bucket_view)


def is_collective_timeout(err: BaseException) -> bool:
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, getattr(dist, "DistBackendError", ())) or "Timed out" in text or "timed out" in text


_ALIVE_KEY = "frugal/answered_after_timeout"


def name_unresponsive_ranks(world: int | None, rank: int, collective_timeout_s: float) -> str:
    """After a collective timed out: which ranks do not answer. Every rank that still runs writes
    `<key>/<rank>` to the default process group's store, then waits (up to 30 s) for the others'."""
    import time

    import torch.distributed as dist

    wait = min(_MONITOR_WAIT_S, collective_timeout_s)
    world = world or (dist.get_world_size() if dist.is_initialized() else 1)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=wait))  # a store on a frozen host must not hang us
        store.set(f"{_ALIVE_KEY}/{rank}", "1")
        deadline = time.monotonic() + wait
        while True:
            missing = [r for r in range(world) if not store.check([f"{_ALIVE_KEY}/{r}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception as err:  # the store itself is gone or frozen (it lives on rank 0 without torchrun)
        return (f"the rendezvous store did not answer a check either ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[0][:120] if str(err).strip() else ''}); without torchrun it "
                f"lives in rank 0, which may be the one that stopped")
    if not missing:
        return "every rank answered the check afterwards (a rank was slower than the timeout, not frozen)"
    ranks = ", ".join(map(str, missing))
    return f"rank{'s' if len(missing) > 1 else ''} {ranks} did not answer a check within {wait:.0f} s"


def collective_timeout_message(world: int, rank: int, collective_timeout_s: float, err: BaseException) -> str:
    who = name_unresponsive_ranks(world, rank, collective_timeout_s)
    return (f"[rank {rank}] a collective operation waited longer than train.collective_timeout_s="
            f"{collective_timeout_s:g} s: {who}. A rank that stops answering (frozen, stuck in I/O, or out of "
            f"memory) stops the others; raise train.collective_timeout_s if it was only slow. "
            f"({type(err).__name__}: {str(err).strip().splitlines()[0][:200]})")


def on_main(accelerator, fn, errors, share: bool = True):
    """Run `fn` on the main process only (collective: call on every rank; also a barrier). An exception
    of type `errors` that it raises is raised on every rank (same type and message), so all ranks fail
    together; otherwise returns its result on every rank (share=False: on the main process, None elsewhere)."""
    from accelerate.utils import broadcast_object_list

    outcome = None
    if accelerator.is_main_process:
        try:
            outcome = fn()
        except errors as err:
            outcome = err
    shared = broadcast_object_list([outcome if share or isinstance(outcome, BaseException) else None])[0]
    if isinstance(shared, BaseException):
        raise shared
    return shared if share else outcome


def torchrun_multirun_error(multirun: bool) -> str | None:
    """Under torchrun, a Hydra multirun runs its jobs one after another in the same processes; the
    first job's end destroys the process group the next one needs. Refuse it up front."""
    if multirun and int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        return ("a Hydra multirun (-m) under torchrun would run only its first job: run each job in its own "
                "processes instead: a launcher starts N processes per job "
                "(one machine: python train.py -m hydra/launcher=local "
                "hydra.launcher.tasks_per_node=N ...; a cluster: hydra/launcher=slurm), or run one torchrun command "
                "per job")
    return None


# ---- leaving a multi-process run -------------------------------------------------------------------
# Freeing a DDP model frees its reducer and its process group: gloo's destructor joins its threads under
# the interpreter lock, which on a loaded CPU can wait forever (seen in the tests' torchrun runs), and a
# gloo thread freeing tensors while the interpreter finalizes aborts the process ("terminate called
# without an active exception", ~1 in 10 vote runs of bench/comm.py). So a finished multi-process run
# keeps these objects and leaves with os._exit once its output is flushed.
_PARKED: list = []


def park(*objects) -> None:
    """Keep `objects` (the accelerator, the wrapped model) alive until `leave`."""
    _PARKED.extend(o for o in objects if o is not None)


def leave(code) -> None:
    """End the process with `code` (a SystemExit code) without freeing what `park` kept; returns
    at once when nothing was parked (single-process runs leave the usual way)."""
    if not _PARKED:
        return
    import logging
    import sys

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)
