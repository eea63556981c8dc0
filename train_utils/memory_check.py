"""Start-up memory check: refuse, with the figures, a run that cannot fit, before anything large exists
(else the kernel kills it with no output). Asks the memory planner (memory_plan.py, nothing allocated):
GPU: the planned per-rank peak plus allowance must fit the device, and local processes x (4 bytes per
parameter, the fp32 model built on the host, + PROCESS_BYTES) the host's available RAM; CPU: local
processes x (planned peak + PROCESS_BYTES) the host's RAM. `train.memory_check=false` skips it; a run
the planner cannot plan is said and goes on.
"""
from __future__ import annotations

import os

import torch

from omegaconf import DictConfig, OmegaConf

from train_utils.memory_plan import GIB, device_memory, largest_micro_batch, plan_memory
from train_utils.validation import ConfigError, check_auto_batch, resolve_precision

# Resident memory of a training process besides its tensors: the interpreter, torch, transformers,
# the data pipeline (measured ~0.6-0.9 GiB on CPU for the test models).
PROCESS_BYTES = GIB


class MemoryCheckError(ConfigError):
    """The planned memory need exceeds what the device or host has; the message gives both figures."""


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _planner_settings(cfg, world: int, device: torch.device, precision: str, vocab_size: int | None) -> dict:
    """What `check` and `auto_micro_batch` pass the planner besides the micro-batch: the run's sequence
    length, processes, precision, checkpointing, vocabulary, device type and step inside backward."""
    tc = cfg.train
    return dict(seq_len=cfg.data.seq_len, world_size=world, parallelism=tc.parallelism, precision=precision,
                activation_checkpointing=tc.activation_checkpointing, vocab_size=vocab_size,
                device_type=device.type, **in_backward_settings(cfg, world))


def _budget(world: int, device: torch.device, host: int | None = None) -> int:
    """Memory one process may plan for: a GPU's capacity, or on CPU this host's available RAM (`host`,
    read here when not given) shared by the local processes, less what each needs besides its tensors."""
    if device.type == "cuda":
        return device_memory(device)
    host = device_memory("cpu") if host is None else host
    return host // int(os.environ.get("LOCAL_WORLD_SIZE", world)) - PROCESS_BYTES


def in_backward_settings(cfg, world: int) -> dict:
    """The planner's keywords for the step inside backward (train.optimizer_in_backward), from the config."""
    tc = cfg.train
    micro = tc.micro_batch_size
    accumulation = max(1, int(tc.batch_size) // (int(micro) * world)) if isinstance(micro, int) else 1
    return dict(optimizer_in_backward=bool(tc.get("optimizer_in_backward", False)), grad_clip=bool(tc.grad_clip),
                accumulation=accumulation)


def check(cfg, optimizer_cfg: dict, vocab_size: int, world: int, device: torch.device,
          compiled: bool = False) -> dict:
    """Plan this rank's memory and refuse the run if it cannot fit; return what the start row logs
    ({"memory_planned_bytes", "memory_available_bytes"} or {"memory_check": why it was skipped})."""
    tc = cfg.train
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    settings = dict(_planner_settings(cfg, world, device, tc.precision, vocab_size), compiled_loss=compiled)
    try:
        plan = plan_memory(cfg.model, optimizer_cfg, micro_batch_size=tc.micro_batch_size, **settings)
    except (ValueError, NotImplementedError, RuntimeError, TypeError) as err:
        return {"memory_check": f"skipped: the memory planner cannot plan this run ({err})"}
    host = device_memory("cpu")
    what = f"{cfg.model.name} + {cfg.optimizer.name} (micro-batch {tc.micro_batch_size}, {tc.parallelism})"
    parts = ", ".join(f"{p.replace('_', ' ')} {getattr(plan, p) / GIB:.1f}" for p in plan.PARTS if getattr(plan, p))
    if device.type == "cuda":
        params = plan.settings["params"]
        build = local_world * (params * 4 + PROCESS_BYTES)
        if build > host:
            raise MemoryCheckError(
                f"building {cfg.model.name} needs about {_gib(build)} of host RAM ({local_world} processes x 4 bytes x "
                f"{params:,} parameters + {_gib(PROCESS_BYTES)} each) but {_gib(host)} is available. "
                f"Use fewer processes per node, a machine with more RAM, or train.memory_check=false to skip the check")
        need, available = plan.required, device_memory(device)
        where = f"the memory of the GPU ({torch.cuda.get_device_name(device)})"
        per_process = need
    else:
        per_process = plan.total + PROCESS_BYTES
        need, available, where = local_world * per_process, host, "this host's available RAM"
    if need <= available:
        return {"memory_planned_bytes": need, "memory_available_bytes": available}
    micro, _ = largest_micro_batch(cfg.model, optimizer_cfg, device_bytes=max(_budget(world, device, host), 1),
                                   global_batch=tc.batch_size, **settings)
    remedy = (f"train.micro_batch_size={micro} (the largest that fits)" if micro else
              "no micro-batch fits: weights, gradients and optimizer state alone are too large")
    processes = (f" ({local_world} processes x {_gib(per_process)})" if local_world > 1 and device.type != "cuda"
                 else "")
    raise MemoryCheckError(
        f"{what} needs about {_gib(need)}{processes} (planned peak: {parts} GiB, at the {plan.phase}) but "
        f"{where} is {_gib(available)}. Options: {remedy}; train.activation_checkpointing=true; "
        f"train.parallelism=fsdp over more processes; or train.memory_check=false to skip this check "
        f"(docs/memory_plan.md explains the estimate)")


def agreed_check(cfg, optimizer_cfg: dict, vocab_size: int, world: int, device: torch.device, compiled: bool,
                 accelerator) -> dict:
    """`check` on every rank at the same moment, with one verdict: the ranks meet first (so that none
    is already building its model while another reads the free memory), and if any rank refuses,
    every rank stops with its message (instead of the others waiting in the next collective)."""
    from accelerate.utils import gather_object

    accelerator.wait_for_everyone()
    try:
        memory, refusal = check(cfg, optimizer_cfg, vocab_size, world, device, compiled), None
    except MemoryCheckError as err:
        memory, refusal = None, str(err)
    refusals = gather_object([refusal]) if world > 1 else [refusal]
    first = next((r for r in refusals if r is not None), None)
    if first is not None:
        raise MemoryCheckError(first)
    return memory


def auto_micro_batch(cfg: DictConfig, world_size: int, device) -> int:
    """The micro-batch `auto` stands for: the largest divisor of train.batch_size / world_size whose
    memory plan fits the device (a GPU's capacity; on CPU this host's available RAM shared by the local
    processes), so no accumulation when the whole share fits. If the planner cannot plan the run, the
    whole share; if nothing fits, 1 (the memory check then says why)."""
    batch = check_auto_batch(cfg, world_size)
    device = torch.device(device)
    try:
        micro, _ = largest_micro_batch(
            cfg.model, OmegaConf.to_container(cfg.optimizer, resolve=True),
            device_bytes=max(_budget(world_size, device), 1), global_batch=batch,
            **_planner_settings(cfg, world_size, device, resolve_precision(cfg.train.precision, device),
                                cfg.model.vocab_size))
    except (ValueError, NotImplementedError, RuntimeError, TypeError, KeyError):
        return batch // world_size
    return micro or 1
