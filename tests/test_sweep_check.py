"""A multirun checks every job's config before its first job (train_utils/sweep_check.py): a bad value in
any job stops the sweep with exit code 2 and the line that job's own run would print, after the job's
number and overrides, with nothing started, written or queued. The checks of one job as its launcher
runs it (processes, device) are tested in-process; two train.py sweeps (basic and local launcher, forked
from the warm interpreter) test the whole path. The SLURM launcher's (nothing submitted) is in tests/test_slurm.py,
and the good sweeps that still run are tests/test_tables.py's real_sweep and test_slurm.py's launches."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode

from train_utils import memory_check, schema, startup, sweep_check
from train_utils.memory_plan import GIB
from train_utils.schema import force_add_key_overrides

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
LOCAL = ["hydra/launcher=local", "hydra.launcher.tasks_per_node=2"]
SLURM = ["hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.gpus_per_node=null",
         "hydra.launcher.tasks_per_node=2"]


def _check(*argv: str, config_dir: Path = CONFIGS) -> str | None:
    """check_sweep on the multirun train.py would compose from `argv` (its plain key overrides forced
    in as train.py forces them)."""
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        hydra = GlobalHydra.instance().hydra
        cfg = hydra.compose_config("config", force_add_key_overrides(list(argv)), run_mode=RunMode.MULTIRUN)
        return sweep_check.check_sweep(cfg, hydra.config_loader)


def _single_run_error(run_dir: Path, *overrides: str) -> str:
    """The one line (without `error: `) a single run of `overrides` stops with: train.train's own
    error, raised before its first step."""
    from hydra import compose

    import train

    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("config", overrides=force_add_key_overrides(list(overrides)), return_hydra_config=True)
    with pytest.raises(startup.CONFIG_ERRORS) as err:
        train.train(cfg, str(run_dir))
    assert not (run_dir / "metrics.jsonl").exists()
    return str(err.value)


@pytest.mark.slow
def test_a_bad_job_is_named_with_its_overrides_and_its_runs_own_line(tmp_path):
    """The first bad job, whatever its place, with its overrides as typed (without the `++` train.py
    adds) and the exact line its own run stops with: a value, a key, the model's, the schedule's."""
    assert set(sweep_check.config_errors()) == set(startup.CONFIG_ERRORS)
    assert _check("optimizer.density=0.25,0.5", "optimizer.update_gap=100,200") is None
    for i, (argv, job, bad) in enumerate([
        (["optimizer.density=0.25,1.5", "debug=toy"], "#1 (optimizer.density=1.5 debug=toy)",
         ["optimizer.density=1.5", "debug=toy"]),
        (["optimizer.densty=0.3,0.5"], "#0 (optimizer.densty=0.3)", ["optimizer.densty=0.3"]),
        (["model.hidden_size=128,130"], "#1 (model.hidden_size=130)", ["model.hidden_size=130"]),
        (["schedule.warmup_fraction=0.1,2", "train.steps=5"], "#1 (schedule.warmup_fraction=2 train.steps=5)",
         ["schedule.warmup_fraction=2", "train.steps=5"]),
    ]):
        single = _single_run_error(tmp_path / str(i), *bad, "wandb.mode=disabled", "data.seq_len=32")
        assert _check(*argv) == f"sweep not started: job {job}: {single}"
        assert single.split()[0] in {"Invalid", "optimizer.densty", "model.hidden_size=130", "schedule:"}, single


def test_a_presets_sweep_with_an_option_no_group_has_is_one_line(tmp_path, monkeypatch):
    """train.py checks its command line's group values before Hydra composes (schema.bad_group_choice);
    a preset's own sweep (hydra.sweeper.params) gets the same line, before any job."""
    import shutil

    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    monkeypatch.setattr(schema, "CONFIG_DIR", configs)
    (configs / "experiment" / "typo.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      optimizer: adamw,frugall\n")
    assert _check("experiment=typo", config_dir=configs) == (
        "sweep not started: job #1 (optimizer=frugall experiment=typo): optimizer='frugall' is not an option of "
        "configs/optimizer/ (did you mean frugal?); valid options: " + ", ".join(
            sorted(p.stem for p in (CONFIGS / "optimizer").glob("*.yaml"))))


@pytest.mark.slow
def test_each_job_is_checked_with_its_launchers_processes():
    """8 sequences per step: a micro-batch of 8 fits 1 process (basic launcher), not 2 (local, 2 tasks);
    4 does not fit SLURM's 2 nodes x 2 tasks."""
    assert _check("train.batch_size=8", "train.micro_batch_size=4,8") is None
    local = _check(*LOCAL, "train.batch_size=8", "train.micro_batch_size=4,8")
    assert local.startswith("sweep not started: job #1 (train.batch_size=8 train.micro_batch_size=8): "
                            "train.batch_size=8 must equal train.micro_batch_size (8) x gradient accumulation "
                            "steps x world size (2)"), local
    slurm = _check(*SLURM, "train.batch_size=8", "train.micro_batch_size=2,4")
    assert "job #1 (train.batch_size=8 train.micro_batch_size=4)" in slurm and "world size (4)" in slurm, slurm


@pytest.mark.slow
def test_the_memory_check_runs_for_jobs_on_this_machine(monkeypatch):
    """The start-up memory check, from the planner alone (nothing built): with 1.5 GiB, llama_tiny
    fits and llama_130m + AdamW does not. A SLURM job's nodes are not this machine: checked there, at
    its start; train.memory_check=false skips it as in a run."""
    monkeypatch.setattr(memory_check, "device_memory", lambda device: int(1.5 * GIB))
    sweep = ["model=llama_tiny,llama_130m", "optimizer=adamw", "train.micro_batch_size=1"]
    message = _check(*sweep)
    assert message.startswith("sweep not started: job #1 (model=llama_130m optimizer=adamw train.micro_batch_size=1): "
                              "llama_130m + adamw (micro-batch 1, ddp) needs about "), message
    assert "or train.memory_check=false to skip this check" in message
    assert _check(*sweep, *SLURM) is None
    assert _check(*sweep, "train.memory_check=false") is None


def test_other_sweepers_and_torchrun(monkeypatch):
    """Another sweeper lists its jobs itself: they check themselves at start-up, as before. Under
    torchrun a multirun is refused before any job (distributed.torchrun_multirun_error)."""
    assert _check("hydra.sweeper._target_=some.OtherSweeper", "optimizer.density=1.5") is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert "would run only its first job" in _check("optimizer.density=0.25")


@pytest.mark.slow  # two train.py sweeps end to end; the checks themselves run in-process above
def test_train_py_stops_a_bad_sweep_before_any_job(tmp_path):
    """`python train.py -m optimizer.density=0.25,1.5 debug=toy`, with the basic launcher and with
    hydra/launcher=local (2 processes): exit 2, the last line names job #1 and its overrides, and
    nothing was started or written: no sweep dir, so no run dir, metrics, checkpoint or submitit job."""
    from _forkserver import run_python
    from _train_helpers import subprocess_env

    env = {**subprocess_env(), "WANDB_MODE": "disabled"}
    sweep = ["-m", "optimizer.density=0.25,1.5", "debug=toy"]
    line = ("error: sweep not started: job #1 (optimizer.density=1.5 debug=toy): Invalid density: 1.5 "
            "(expected a number in [0, 1])")
    for name, extra in {"basic": [], "local": LOCAL}.items():  # forked from the warm interpreter
        proc = run_python([sys.executable, "train.py", *sweep, *extra, f"hydra.sweep.dir={tmp_path / name}"],
                          cwd=ROOT, env=env, timeout=300)
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 2, (name, err[-3000:])
        assert err.strip().splitlines()[-1] == line, (name, err[-3000:])
        assert "Traceback" not in err and "Launching" not in out and "runs in" not in out, (name, out, err)
    assert list(tmp_path.iterdir()) == [], "a sweep dir was made: something started"


def test_the_command_line_s_sweep_of_a_key_replaces_the_preset_s():
    """A preset's sweep narrowed on the command line (`optimizer.update_gap=10,20`, which train.py forces in
    as `++optimizer.update_gap`) runs 2 jobs, not the product with the preset's 7 gaps (Hydra's basic
    sweeper keys on the prefixed text: 14 jobs, the command line's value in each); numbered as the
    preset orders its keys. hydra_plugins/frugal_sweeper/sweeper.py, configs/config.yaml's sweeper."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.frugal_sweeper.sweeper import CommandLineWinsSweeper
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    argv = force_add_key_overrides(["experiment=table15_update_gap", "optimizer.update_gap=10,20", "debug=toy"])
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        hydra = GlobalHydra.instance().hydra
        cfg = hydra.compose_config("config", argv, run_mode=RunMode.MULTIRUN)
        assert cfg.hydra.sweeper._target_ == sweep_check.SWEEPER
        jobs = sweep_check.sweep_jobs(cfg, hydra.config_loader)
    assert [job[0] for job in jobs] == ["++optimizer.update_gap=10", "++optimizer.update_gap=20"]
    lines = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()] + argv
    overrides = OverridesParser.create().parse_overrides(lines)
    assert len(BasicSweeper.split_arguments(overrides, None)[0]) == 14  # what it was
    assert len(CommandLineWinsSweeper.split_arguments(overrides, 1)) == 2  # batches of one, as max_batch_size asks


def test_the_launching_process_composes_each_job_once():
    """SweepCheck makes the loader's load_sweep_config compose a job once (Hydra asks three times: the
    check, the sweeper's batch validation, the launcher): later calls get a copy equal to a fresh
    composition that the caller may change without changing the next one."""
    from omegaconf import OmegaConf, open_dict

    argv = force_add_key_overrides(["optimizer.density=0.25,0.5", "debug=toy"])
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        hydra = GlobalHydra.instance().hydra
        cfg = hydra.compose_config("config", argv, run_mode=RunMode.MULTIRUN)
        calls = []
        real = hydra.config_loader.load_sweep_config
        hydra.config_loader.load_sweep_config = lambda *a: (calls.append(a[1]), real(*a))[1]
        sweep_check.SweepCheck().on_multirun_start(cfg)  # checks both jobs, composing each
        loader = hydra.config_loader.load_sweep_config
        assert isinstance(loader, sweep_check.ComposedOnce) and len(calls) == 2
        job = calls[1]
        assert "++optimizer.density=0.5" in job
        fresh = real(cfg, list(job))
        first = loader(cfg, list(job))
        with open_dict(first):
            first.hydra.job.num = 7  # as the launcher does
        second = loader(cfg, list(job))
        assert len(calls) == 2 and second is not first and OmegaConf.is_missing(second.hydra.job, "num")
        assert OmegaConf.to_container(second) == OmegaConf.to_container(fresh)
        assert OmegaConf.to_container(loader(cfg.copy(), list(job))) == OmegaConf.to_container(fresh)
        assert len(calls) == 3  # another master config: composed
