"""Start-up validation of the train/wandb/checkpoint sections: every error names the bad value and
the valid choices, before a model is built or a step is lost. (Unknown config-group options such as
`optimizer=adamx` are rejected earlier by Hydra itself, with the list of available options; model,
optimizer and data values are validated by `models`, `frugal` and `data` when they are built.)"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

PRECISIONS = ("bf16-mixed", "bf16", "fp32")
WANDB_MODES = ("online", "offline", "disabled")


class ConfigError(ValueError):
    """A bad configuration value; the message says which key, what was given and what is allowed."""


def _int(cfg: DictConfig, key: str, minimum: int) -> int:
    value = OmegaConf.select(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}={value!r} is invalid: expected an integer >= {minimum}")
    return value


def validate(cfg: DictConfig, world_size: int) -> int:
    """Check the loop's settings; return the number of gradient-accumulation micro-steps."""
    _int(cfg, "train.steps", 1)
    batch = _int(cfg, "train.batch_size", 1)
    micro = _int(cfg, "train.micro_batch_size", 1)
    _int(cfg, "train.eval_every", 0)
    _int(cfg, "train.eval_tokens", 1)
    _int(cfg, "train.log_every", 1)
    _int(cfg, "train.seed", 0)
    _int(cfg, "checkpoint.every", 0)
    _int(cfg, "checkpoint.keep", 1)
    per_pass = micro * world_size
    if batch % per_pass:
        options = ", ".join(str(per_pass * k) for k in range(1, 5))
        divisors = [m for m in range(1, batch + 1) if batch % (m * world_size) == 0]
        raise ConfigError(
            f"train.batch_size={batch} must equal train.micro_batch_size ({micro}) x gradient "
            f"accumulation steps x world size ({world_size}), but {batch} is not a multiple of "
            f"{micro} x {world_size} = {per_pass}. Valid train.batch_size values for this micro batch: "
            f"{options}, ...; valid train.micro_batch_size values for this batch size: {divisors or 'none'}."
        )
    if cfg.train.precision not in PRECISIONS:
        raise ConfigError(f"train.precision={cfg.train.precision!r} is invalid; choose one of {', '.join(PRECISIONS)}")
    if cfg.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} is invalid; choose one of {', '.join(WANDB_MODES)}")
    clip = cfg.train.grad_clip
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise ConfigError(f"train.grad_clip={clip!r} is invalid: expected null (no clipping) or a number >= 0")
    resume = cfg.train.resume
    if not isinstance(resume, str) or not resume:
        raise ConfigError(f"train.resume={resume!r} is invalid; choose auto, never or a checkpoint/run directory")
    return batch // per_pass
