"""How a run is named: unique run directories, the optimizer option chosen, wandb names and groups.

configs/config.yaml names run dirs `outputs/${launch_time:%Y-%m-%d}/${launch_time:%H-%M-%S}-<model>-
<optimizer option>-${launch_id:}` (two runs started in the same second must not share metrics.jsonl).
Hydra resolves it in every process, so every rank of a launch computes the same name on its own:
`launch_id` is torchrun's run id (8 hex digits of a --standalone uuid), else the SLURM job (array task,
step) id, else 8 random hex digits; `launch_time` is the start time of the ranks' parent (torchrun agent,
SLURM step daemon), else the first call's. Multi-node runs should pass `hydra.run.dir` (train.py also
broadcasts rank 0's). Both are cached in the config, so a sweep's jobs keep its directory.
`optimizer_option` is Hydra's choice (frugal_rho0), `optimizer.name` the registry entry (frugal);
`run_name` is `<model>-<option>` plus the swept values or the run dir's name; `run_group` gathers a
sweep's jobs under one wandb group.
"""
from __future__ import annotations

import datetime
import functools
import os
import re
import secrets
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

GROUP_KEYS = ("model", "optimizer")  # already in every run name


@functools.cache
def launch_id() -> str:
    """An id every process of one launch computes alike, different for every launch."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", run_id):
            return run_id[:8]  # torchrun --standalone's uuid: 8 hex digits, like a plain run's
        return re.sub(r"[^A-Za-z0-9_.]", "", run_id)[:12]  # a --rdzv-id someone chose
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
            job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        step = os.environ.get("SLURM_STEP_ID")
        return f"{job}.{step}" if step else job
    return secrets.token_hex(4)  # os.urandom: the seeded RNGs stay untouched


def _one_of_several_ranks() -> bool:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return True
    return bool(os.environ.get("SLURM_STEP_ID")) and int(os.environ.get("SLURM_NTASKS", "1")) > 1


@functools.cache
def _launch_timestamp() -> float:
    if _one_of_several_ranks():
        try:
            import psutil

            return psutil.Process(os.getppid()).create_time()
        except Exception:  # psutil missing or the parent gone: the rank's own time
            pass
    return time.time()


def launch_time(fmt: str) -> str:
    """The launch's start time formatted with `fmt` (strftime)."""
    return datetime.datetime.fromtimestamp(_launch_timestamp()).strftime(fmt)


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("launch_id", launch_id, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True, replace=True)


def _hydra(hydra_cfg):
    if hydra_cfg is not None:
        return hydra_cfg
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _select(hydra_cfg, key: str):
    """`key` of Hydra's config (this run's when `hydra_cfg` is None), None where it is not set."""
    hc = _hydra(hydra_cfg)
    return OmegaConf.select(hc, key, default=None) if hc is not None else None


def is_multirun(hydra_cfg=None) -> bool:
    """True inside a job of a Hydra multirun (`-m`)."""
    mode = _select(hydra_cfg, "mode")
    return str(getattr(mode, "name", mode)).endswith("MULTIRUN")


def optimizer_option(cfg: DictConfig, hydra_cfg=None) -> str:
    """The configs/optimizer option of the run (frugal_rho0, galore_original, ...); the registry
    entry `optimizer.name` when the config was composed without Hydra's runtime information."""
    return str(_select(hydra_cfg, "runtime.choices.optimizer") or cfg.optimizer.name)


def debug_option(hydra_cfg=None) -> str | None:
    """The configs/debug option of the run (`toy`), or None."""
    choice = _select(hydra_cfg, "runtime.choices.debug")
    return str(choice) if choice else None


def parse_overrides(lines) -> dict[str, str]:
    """{key or group: value text} of Hydra override strings ('optimizer.density=0.25', '+x=1')."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = {}
    for line in lines or []:
        override = parser.parse_override(str(line))
        out[override.key_or_group] = str(line).split("=", 1)[1] if "=" in str(line) else ""
    return out


def swept_keys(task_overrides, sweeper_params) -> list[str]:
    """Keys a multirun gives more than one value: the sweeper's params (a preset's
    `hydra.sweeper.params`) overlaid with the command line's overrides, last one winning per key,
    as Hydra's basic sweeper combines them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    lines = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + [str(o) for o in task_overrides or []]
    counts: dict[str, int] = {}
    for line in lines:
        override = parser.parse_override(line)
        n = len(list(override.sweep_string_iterator())) if override.is_sweep_override() else 1
        counts.pop(override.key_or_group, None)  # keep the command line's order for a key set twice
        counts[override.key_or_group] = n
    return [k for k, n in counts.items() if n > 1]


def short_labels(keys: list[str]) -> dict[str, str]:
    """Each key's last component (update_gap), or the whole key where two would look alike."""
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: leaf if leaves.count(leaf) == 1 else k for k, leaf in zip(keys, leaves)}


def launch_sweep(hc) -> tuple[list, dict]:
    """(the launch's command-line overrides, its sweeper's params): in a multirun job those of
    multirun.yaml in the sweep dir (written by the sweeper before any job starts), else no overrides
    and this config's `hydra.sweeper.params` (a preset's)."""
    task, params = [], OmegaConf.select(hc, "sweeper.params", default=None)
    master = Path(str(OmegaConf.select(hc, "sweep.dir", default=""))) / "multirun.yaml"
    if is_multirun(hc) and master.is_file():
        saved = OmegaConf.load(master).hydra
        task, params = OmegaConf.to_container(saved.overrides.task), saved.sweeper.get("params")
    return task, OmegaConf.to_container(params) if params is not None else {}


def sweep_values(hydra_cfg=None) -> dict[str, str]:
    """{swept key: this job's value} in a multirun job; {} otherwise."""
    hc = _hydra(hydra_cfg)
    if not is_multirun(hc):
        return {}
    task, params = launch_sweep(hc)
    job = parse_overrides(hc.overrides.task)
    return {k: job[k] for k in swept_keys(task, params) if k in job}


def run_name(cfg: DictConfig, run_dir: str, hydra_cfg=None) -> str:
    """`<model>-<option>-<swept key=value>...` for a multirun job, `<model>-<option>-<run dir name>`
    otherwise; `wandb.name` wins when set."""
    if OmegaConf.select(cfg, "wandb.name", default=None):
        return str(cfg.wandb.name)
    base = f"{cfg.model.name}-{optimizer_option(cfg, hydra_cfg)}"
    values = {k: v for k, v in sweep_values(hydra_cfg).items() if k not in GROUP_KEYS}
    # train.state_free_comm=vote (frugal.comm's one-bit vote) is in the name: <model>-<option>-vote-...
    vote = "-vote" if OmegaConf.select(cfg, "train.state_free_comm", default="exact") == "vote" else ""
    if not values:
        return f"{base}{vote}-{os.path.basename(os.path.normpath(run_dir)).replace(f'-{base}-', '-')}"  # not twice
    labels = short_labels(list(values))
    return "-".join([base + vote] + [f"{labels[k]}={v}" for k, v in values.items()])


def run_group(cfg: DictConfig, hydra_cfg=None) -> str | None:
    """The wandb group: `<table or sweep>-<sweep dir name>` for a multirun's jobs, the paper table for
    a single preset run, else None; `wandb.group` wins when set."""
    if OmegaConf.select(cfg, "wandb.group", default=None):
        return str(cfg.wandb.group)
    table = OmegaConf.select(cfg, "paper.table", default=None)
    hc = _hydra(hydra_cfg)
    if is_multirun(hc):
        return f"{table or 'sweep'}-{os.path.basename(os.path.normpath(str(hc.sweep.dir)))}"
    return table
