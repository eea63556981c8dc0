"""Start-up validation of a composed config, and how an expected error ends a run.

`validate_config` runs before a model is built: undeclared keys (schema.py), then the loop's settings;
every error names the key, the value and what is valid. Model, optimizer and data values are checked
when built, unknown group options by Hydra. `stop_with_error` ends an expected error in one line: on
stderr with an exit code, or in a multirun job as a compact Hydra error the sweep prints last.
"""
from __future__ import annotations

import os
import sys

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from frugal.checks import check_integer

from . import state_free_comm
from .naming import is_multirun
from .schema import unknown_key_line, unknown_keys

PRECISIONS = ("bf16-mixed", "bf16", "fp32")  # bf16 autocast over fp32 weights | pure bf16 | fp32
AUTO = "auto"  # train.micro_batch_size, train.precision: chosen for the run's device at start-up
WANDB_MODES = ("online", "offline", "disabled")


class ConfigError(ValueError):
    """A bad configuration value; the message says which key, what was given and what is allowed."""


class JobError(CompactHydraException):
    """An expected error of a multirun job; Hydra prints its message alone. The sweep exits with
    `exit_code` (what the job would have had alone; train.py's __main__), not Hydra's 1."""
    exit_code = 1


def _integer(cfg: DictConfig, key: str, minimum: int) -> int:
    return check_integer(key, OmegaConf.select(cfg, key), minimum, error=ConfigError)


def check_precision(precision, allow_auto: bool = False) -> None:
    """train.precision is one of PRECISIONS (train.py and eval.py), or `auto` before it is resolved."""
    choices = (*PRECISIONS, AUTO) if allow_auto else PRECISIONS
    if precision not in choices:
        raise ConfigError(f"train.precision={precision!r} is invalid; choose one of {', '.join(choices)}")


def native_bf16(device) -> bool:
    """Does `device` compute bf16 matmuls natively: a CUDA GPU with bf16, or a CPU with AVX512-BF16 or
    AMX whose bf16 matmuls go to oneDNN (torch's check, honouring ONEDNN_MAX_CPU_ISA; docs/measurements.md).
    Elsewhere bf16 is emulated (an AVX2 CPU: a llama_tiny bf16-mixed step ~6x an fp32 one)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    if not ("avx512_bf16" in flags or "amx_bf16" in flags):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: bf16 matmuls are emulated
        return False


def resolve_precision(precision, device, debug: str | None = None) -> str:
    """train.precision `auto`: bf16-mixed where the device computes bf16 natively, fp32 elsewhere; other
    values are checked and kept. Under `debug=toy` bf16-mixed counts as `auto` too (pure bf16 and fp32
    cells keep theirs: Tables 3 and 10 stay sweeps of different regimes)."""
    check_precision(precision, allow_auto=True)
    if precision == "bf16-mixed" and debug == "toy":
        precision = AUTO
    if precision != AUTO:
        return precision
    return "bf16-mixed" if native_bf16(device) else "fp32"


def check_known_keys(cfg: DictConfig) -> None:
    """Raise ConfigError naming every key no YAML file declares, its node's valid keys and the closest
    (one line). The optimizer also takes the options of rules its `optimizer.plugins` register."""
    from frugal import registry

    registry.load_plugins(OmegaConf.select(cfg, "optimizer.plugins", default=None))
    name = OmegaConf.select(cfg, "optimizer.name", default=None)
    taken = {f"optimizer.{k}" for k in registry.accepted_keys(name)} if name in registry.OPTIMIZERS else set()
    unknown = [(key, valid) for key, valid in unknown_keys(cfg) if key not in taken]
    if not unknown:
        return
    lines = [unknown_key_line(key, valid) for key, valid in unknown]
    raise ConfigError("; ".join(lines) + ". (A new key is declared in the YAML file of its section; the "
                      "optimizer's are written from its frugal registry entry by scripts/write_optimizer_configs.py.)")


def check_loop_settings(tc) -> None:
    """The loop's own keys, checked before the process group exists (its timeout is one of them)."""
    timeout = tc.collective_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ConfigError(f"train.collective_timeout_s={timeout!r} is invalid: expected a number of seconds > 0")
    peak = tc.peak_flops
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0):
        raise ConfigError(f"train.peak_flops={peak!r} is invalid: expected null (the device's table entry) or "
                          f"the device's peak FLOP/s, e.g. 312e12")
    for key in ("require_eval_tokens", "activation_checkpointing", "tf32", "memory_check", "optimizer_in_backward"):
        if not isinstance(tc[key], bool):
            raise ConfigError(f"train.{key}={tc[key]!r} is invalid: expected true or false")
    if tc.compile not in (True, False, "auto"):
        raise ConfigError(f"train.compile={tc.compile!r} is invalid; choose true, false or auto (compile on GPUs only)")
    from .distributed import PARALLELISMS

    if tc.parallelism not in PARALLELISMS:
        raise ConfigError(f"train.parallelism={tc.parallelism!r} is invalid; choose one of {', '.join(PARALLELISMS)}")
    changes = tc.resume_changes
    if changes is not None and (isinstance(changes, str) or not all(isinstance(k, str) for k in changes)):
        raise ConfigError(f"train.resume_changes={changes!r} is invalid: expected a list of dotted config keys, "
                          f"e.g. train.resume_changes=[optimizer.lr,train.steps]")


def check_auto_batch(cfg: DictConfig, world_size: int) -> int:
    """train.micro_batch_size=auto: the batch must split evenly over the processes; return it."""
    batch = _integer(cfg, "train.batch_size", 1)
    if batch % world_size:
        valid = ", ".join(str(world_size * k) for k in range(1, 5))
        raise ConfigError(f"train.batch_size={batch} cannot be split over {world_size} processes "
                          f"(train.micro_batch_size=auto): valid train.batch_size values: {valid}, ...")
    return batch


def validate_config(cfg: DictConfig, world_size: int) -> int:
    """Check the run's config; return the gradient-accumulation micro-steps (1 while
    train.micro_batch_size is `auto`: train.py resolves it first, memory_check.auto_micro_batch)."""
    check_known_keys(cfg)
    if cfg.train.micro_batch_size == AUTO:
        cfg = OmegaConf.merge(cfg, {"train": {"micro_batch_size": check_auto_batch(cfg, world_size) // world_size}})
    for key in ("train.steps", "train.batch_size", "train.micro_batch_size", "train.eval_tokens",
                "train.log_every", "checkpoint.keep"):
        _integer(cfg, key, 1)
    for key in ("train.eval_every", "train.seed", "checkpoint.every"):
        _integer(cfg, key, 0)
    batch, micro = cfg.train.batch_size, cfg.train.micro_batch_size
    per_pass = micro * world_size
    if batch % per_pass:
        options = ", ".join(str(per_pass * k) for k in range(1, 5))
        divisors = [m for m in range(1, batch + 1) if batch % (m * world_size) == 0]
        raise ConfigError(
            f"train.batch_size={batch} must equal train.micro_batch_size ({micro}) x gradient "
            f"accumulation steps x world size ({world_size}), but {batch} is not a multiple of "
            f"{micro} x {world_size} = {per_pass}. Valid train.batch_size values for this micro batch: "
            f"{options}, ...; valid train.micro_batch_size values for this batch size: {divisors or 'none'}.")
    check_precision(cfg.train.precision, allow_auto=True)  # train() resolves auto before it is used
    if cfg.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} is invalid; choose one of {', '.join(WANDB_MODES)}")
    clip = cfg.train.grad_clip
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise ConfigError(f"train.grad_clip={clip!r} is invalid: expected null (no clipping) or a number >= 0")
    growth = OmegaConf.select(cfg, "optimizer.update_gap_growth", default=None)
    if OmegaConf.select(cfg, "train.parallelism") == "fsdp" and isinstance(growth, (int, float)) and growth > 1.0:
        # Its windows depend on the losses; a sharded load needs the window's state shape before loading.
        raise ConfigError(f"optimizer.update_gap_growth={growth} (the plateau-growing update gap) cannot resume from "
                          f"sharded checkpoints; with train.parallelism=fsdp keep update_gap_growth=1.0, or use "
                          f"train.parallelism=ddp")
    check_in_backward(cfg, world_size)
    check_state_free_comm(cfg)
    check_optimizer_values(cfg)
    resume = cfg.train.resume
    if not isinstance(resume, str) or not resume:
        raise ConfigError(f"train.resume={resume!r} is invalid; choose auto, never or a checkpoint/run directory")
    return batch // per_pass


def check_optimizer_values(cfg: DictConfig) -> None:
    """The optimizer's keys and values, checked by the registry before the memory planner meets them."""
    from frugal import registry

    opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
    registry.resolve(opt.pop("name"), opt)  # HyperparameterError: one line naming the value and the choices


def check_in_backward(cfg: DictConfig, world_size: int) -> None:
    """train.optimizer_in_backward=true needs a FRUGAL-based optimizer, and no DDP over several
    processes: DDP all-reduces a gradient after its hook has already used it (FSDP2 reduces first)."""
    if not OmegaConf.select(cfg, "train.optimizer_in_backward", default=False):
        return
    _check_frugal_based(cfg, "train.optimizer_in_backward=true runs FRUGAL's step inside backward",
                        "train.optimizer_in_backward=false")
    growth = OmegaConf.select(cfg, "optimizer.update_gap_growth", default=1.0)
    if growth is not None and growth > 1.0:
        raise ConfigError(f"train.optimizer_in_backward=true with optimizer.update_gap_growth={growth}: the plateau-"
                          f"grown gap chooses a step's window from that step's loss, known only after the backward "
                          f"in which the step inside backward chooses it; valid choices: optimizer.update_gap_growth="
                          f"1.0 or train.optimizer_in_backward=false")
    if world_size > 1 and cfg.train.parallelism == "ddp":
        raise ConfigError(f"train.optimizer_in_backward=true cannot run under DDP ({world_size} processes): each "
                          f"tensor's update would run on its gradient before DDP all-reduces it; use "
                          f"train.parallelism=fsdp (FSDP2 reduces each gradient before the update) or "
                          f"train.optimizer_in_backward=false")


def check_state_free_comm(cfg: DictConfig) -> None:
    """train.state_free_comm's value, and the setups the vote cannot run in (one line each)."""
    value, modes = state_free_comm.mode(cfg), state_free_comm.MODES
    if value not in modes:
        raise ConfigError(f"train.state_free_comm={value!r} is invalid; choose one of {', '.join(modes)}")
    if value == "exact":
        return
    if OmegaConf.select(cfg, "train.parallelism") == "fsdp":
        raise ConfigError("train.state_free_comm=vote is a DDP communication hook, and FSDP2 (train.parallelism=fsdp) "
                          "reduce-scatters gradients without one; valid choices: train.parallelism=ddp or "
                          "train.state_free_comm=exact")
    if OmegaConf.select(cfg, "train.optimizer_in_backward", default=False):
        raise ConfigError("train.state_free_comm=vote cannot run with train.optimizer_in_backward=true: the step "
                          "inside backward updates each tensor before its gradient is communicated; valid choices: "
                          "train.optimizer_in_backward=false or train.state_free_comm=exact")
    _check_frugal_based(cfg, "train.state_free_comm=vote votes on FRUGAL's state-free tensors",
                        "train.state_free_comm=exact")


def _check_frugal_based(cfg: DictConfig, setting: str, instead: str) -> None:
    """A ConfigError when `setting` (what it does, said first) meets an optimizer not built on FRUGAL."""
    from frugal.registry import frugal_based

    name = OmegaConf.select(cfg, "optimizer.name")
    if name not in frugal_based():
        raise ConfigError(f"{setting}, but optimizer.name={name!r} is not built on FRUGAL; valid choices: "
                          f"{', '.join(frugal_based())} (or {instead})")


def stop_with_error(err: BaseException, exit_code: int, in_job: bool | None = None) -> None:
    """End the run on an expected error, its message the last line (never returns): in a multirun job
    (`in_job`, default Hydra's config; False for a sweep's launcher) raise JobError; else print
    `error: <message>` on rank 0 and exit with `exit_code`.
    """
    if is_multirun() if in_job is None else in_job:
        JobError.exit_code = exit_code
        raise JobError(f"error: {err}") from None
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun: its failure summary then shows this line, not "To enable traceback see ..."
        import json
        import time

        with open(error_file, "w") as f:  # torch.distributed.elastic's error-file format
            json.dump({"message": {"message": f"error: {err}", "extraInfo": {
                "py_callstack": f"error: {err}", "timestamp": str(int(time.time()))}}}, f)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {err}", file=sys.stderr)
    sys.exit(exit_code)
