"""Check a whole sweep before its first job: every job's config, composed and checked as its run would
(docs/configuration.md, "Checks at start-up and before a sweep").

`SweepCheck`, a Hydra callback (configs/config.yaml, hydra.callbacks), runs in `on_multirun_start`,
before the sweep dir exists or anything is launched, queued or submitted. For the basic sweeper it lists
the jobs as the sweeper will (`sweep_jobs`), composes each as its launcher will, checks it with train()'s
start-up checks that need no data (`check_job`: loop settings, precision, micro_batch_size=auto, every
key and value, the memory check, model and schedule values), and stops at the first failing job:
`error: sweep not started: job #<n> (<its overrides>): <its run's line>`, exit code 2.
`job_processes` decides each job's processes and device from its launcher; a SLURM job's memory check
waits for its own start-up. Not checked here: the data, the run dir, a vocabulary read from files.
Remove with `~hydra.callbacks.sweep_check`. Cost: 0.12-0.15 s per job on 2 CPU cores, mostly composing
(done once per job: `ComposedOnce`), plus ~2-3 s once to import the model code.
"""
from __future__ import annotations

import logging
import time

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
SWEEPER = "hydra_plugins.frugal_sweeper.sweeper.CommandLineWinsSweeper"  # configs/config.yaml's
SWEEPERS = (BASIC_SWEEPER, SWEEPER)


def config_errors() -> tuple:
    """The errors train.py ends with one line and exit code 2 (train_utils.startup.CONFIG_ERRORS; imported
    when called, without the loop's libraries)."""
    import data
    import frugal
    import models

    from .validation import ConfigError

    return ConfigError, frugal.HyperparameterError, data.DataConfigError, models.ModelConfigError


def sweep_jobs(config, config_loader) -> list[list[str]] | None:
    """Each job's overrides, in the order (and so with the numbers) the basic sweeper gives them; None
    for another sweeper (which then launches unchecked: its jobs still check themselves)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.frugal_sweeper.sweeper import CommandLineWinsSweeper
    from omegaconf import OmegaConf

    target = OmegaConf.select(config, "hydra.sweeper._target_", default=None)
    if target not in SWEEPERS:
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    lines = [f"{k}={v}" for k, v in params.items()]
    lines += OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    overrides = OverridesParser.create(config_loader=config_loader).parse_overrides(lines)
    sweeper = CommandLineWinsSweeper if target == SWEEPER else BasicSweeper
    return [job for batch in sweeper.split_arguments(overrides, None) for job in batch]


def job_processes(job_cfg) -> tuple[int, object | None]:
    """(processes of the job, the torch device they train on if it is this machine's, else None),
    from the launcher that will run it (see the module docstring)."""
    import torch
    from omegaconf import OmegaConf

    launcher = OmegaConf.select(job_cfg, "hydra.launcher", default=None)
    kind = str(OmegaConf.select(job_cfg, "hydra.launcher._target_", default="")).rpartition(".")[2]
    if kind in ("LocalLauncher", "SlurmLauncher"):  # hydra-submitit-launcher's (ours extends the local one)
        world = int(launcher.get("nodes") or 1) * int(launcher.get("tasks_per_node") or 1)
        if kind == "SlurmLauncher":
            return world, None
        gpu = bool(launcher.get("gpus_per_node")) and torch.cuda.is_available()  # submitit_local: none visible at 0
        return world, torch.device("cuda" if gpu else "cpu")
    if kind == "BasicLauncher":  # the job runs in this process, on the device train.py's accelerator picks
        return 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return 1, None  # another launcher: values only


def check_job(cfg, world: int, device, debug: str | None = None) -> dict:
    """Run train()'s start-up checks that need no data, in its order, on the composed config of a job of
    `world` processes on `device` (None: not this machine's, no memory check); raise the error its run
    would stop with. Returns the memory check's entries ({} if not made). Changes `cfg` as train()
    does (precision, micro-batch): pass a copy you can spare."""
    from omegaconf import OmegaConf

    from frugal import HyperparameterError
    from frugal.schedules import build_lambda

    from . import memory_check
    from .loop import compile_wanted
    from .validation import AUTO, ConfigError, check_loop_settings, check_precision, resolve_precision, validate_config

    tc = cfg.train
    check_loop_settings(tc)
    if device is None:
        check_precision(tc.precision, allow_auto=True)
    else:
        tc.precision = resolve_precision(tc.precision, device, debug)
        if tc.micro_batch_size == AUTO:
            tc.micro_batch_size = memory_check.auto_micro_batch(cfg, world, device)
    validate_config(cfg, world)
    memory = {}
    # The data module's vocabulary (train.py passes dm.vocab_size): the synthetic language's, else the model's.
    synthetic = OmegaConf.select(cfg, "data.name", default=None) == "synthetic"
    vocab = OmegaConf.select(cfg, "data.vocab_size", default=None) if synthetic else None
    if device is not None and tc.memory_check:
        memory = memory_check.check(cfg, OmegaConf.to_container(cfg.optimizer, resolve=True), vocab, world, device,
                                    compile_wanted(tc.compile, device))
    if "memory_planned_bytes" not in memory:  # the planner did not build the model: its values unchecked yet
        import models
        import torch

        with torch.device("meta"):  # nothing allocated
            models.build_model(cfg.model, vocab_size=vocab)  # ModelConfigError, as train()'s build_model raises
    schedule = OmegaConf.to_container(cfg.schedule, resolve=True)
    try:
        build_lambda(schedule.pop("name"), tc.steps, **schedule)(0)  # as LambdaLR, which calls it at step 0
    except HyperparameterError as err:  # train.py's build_optimizer names the group of a bad schedule value too
        raise ConfigError(f"schedule: {err}") from err
    return memory


def _shown(overrides: list[str]) -> str:
    """A job's overrides as the user typed them: without hydra.* keys, and without the `++` train.py
    adds to plain key overrides (schema.force_add_key_overrides)."""
    from hydra.core.utils import filter_overrides

    from .schema import force_add_key_overrides

    return " ".join(o[2:] if o.startswith("++") and force_add_key_overrides([o[2:]]) == [o] else o
                    for o in filter_overrides(overrides))


def check_sweep(config, config_loader) -> str | None:
    """The one line (without `error: `) for the first job of the multirun `config` whose run would stop
    at start-up with a config error; None when all pass (or the sweeper is not the basic one)."""
    from .distributed import torchrun_multirun_error
    from .naming import debug_option
    from .schema import bad_group_choice

    refusal = torchrun_multirun_error(True)  # the one refusal a job makes before its config is checked
    if refusal:
        return refusal
    jobs = sweep_jobs(config, config_loader)
    if jobs is None:
        return None
    errors, started, planned = config_errors(), time.perf_counter(), 0
    for num, overrides in enumerate(jobs):
        bad_choice = bad_group_choice(list(overrides))  # a preset's sweep too (train.py checks the command line)
        if bad_choice:
            return f"sweep not started: job #{num} ({_shown(overrides)}): {bad_choice}"
        job_cfg = config_loader.load_sweep_config(config, list(overrides))
        world, device = job_processes(job_cfg)
        try:
            memory = check_job(job_cfg, world, device, debug_option(job_cfg.hydra))
        except errors as err:
            return f"sweep not started: job #{num} ({_shown(overrides)}): {err}"
        planned += "memory_planned_bytes" in memory
    log.info(f"Checked {len(jobs)} job config{'s' * (len(jobs) != 1)} before starting any ({planned} with the memory "
             f"check), {time.perf_counter() - started:.1f} s")
    return None


class ComposedOnce:
    """`load_sweep_config` composing each job once: Hydra composes every job three times in the launching
    process (this check, the sweeper's batch validation, the launcher), ~0.1 s each. Later calls get a
    deep copy (the launcher writes hydra.job.id/num into its config); at most MAX_JOBS are kept."""

    MAX_JOBS = 256

    def __init__(self, compose, master_config):
        self.compose, self.master, self.done = compose, master_config, {}

    def __call__(self, master_config, sweep_overrides):
        import copy

        key = tuple(sweep_overrides)
        if master_config is not self.master:
            return self.compose(master_config, sweep_overrides)
        if key not in self.done:
            cfg = self.compose(master_config, sweep_overrides)
            if len(self.done) >= self.MAX_JOBS:
                return cfg
            self.done[key] = cfg
        return copy.deepcopy(self.done[key])


class SweepCheck(Callback):
    """A Hydra callback: `check_sweep` before a multirun's first job; a bad job ends the sweep with its
    one line and exit code 2, before the sweep dir exists. It also makes the loader compose each job
    once for the sweep (`ComposedOnce`)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        from hydra.core.global_hydra import GlobalHydra

        from .validation import ConfigError, stop_with_error

        loader = GlobalHydra.instance().hydra.config_loader
        compose = loader.load_sweep_config
        loader.load_sweep_config = ComposedOnce(getattr(compose, "compose", compose), config)  # this sweep's
        message = check_sweep(config, loader)
        if message:  # `error: <message>` (rank 0 of a torchrun launch), exit 2: as a single run's error
            stop_with_error(ConfigError(message), 2, in_job=False)
