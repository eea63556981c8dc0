"""The declared config keys (train_utils/schema.py), start-up validation (validation.py) and run naming
(naming.py): unknown keys are refused in every section (train.py: exit 2, with the closest key), every
optimizer key is settable without `+`, the optimizer option files are what the registry says, configs
compose with plain Hydra, composed configs pickle, run directories are unique per launch and shared
by the ranks of one launch, and sweep jobs get names that say what was swept."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _forkserver import run_python
from _train_helpers import subprocess_env
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from frugal import registry
from train_utils import naming
from train_utils.validation import ConfigError, JobError, stop_with_error, validate_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def _compose(*overrides, config_dir=CONFIGS, hydra_cfg=False):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_cfg)


@pytest.mark.parametrize("key, section, a_valid_key", [
    ("train.stepz", "train", "steps"),
    ("wandb.projekt", "wandb", "project"),
    ("checkpoint.evry", "checkpoint", "keep"),
    ("paper.tabel", "paper", "table"),
    ("model.hidden", "model", "hidden_size"),
    ("data.seqlen", "data", "seq_len"),
    ("schedule.warmup", "schedule", "warmup_fraction"),
    ("optimizer.densty", "optimizer", "density"),
    ("stepz", "the top level", "train"),
])
@pytest.mark.parametrize("plus", ["+", "++"])
def test_unknown_key_is_refused_with_the_sections_valid_keys(key, section, a_valid_key, plus):
    cfg = _compose(f"{plus}{key}=10")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=1)
    message = str(err.value)
    assert f"{key} is not a config key" in message and f"; valid keys of {section}: " in message
    assert a_valid_key in message.split("valid keys of")[1]


def test_train_refuses_an_unknown_key_before_any_work(tmp_path):
    import train

    with pytest.raises(ConfigError, match=r"train\.stepz is not a config key"):
        train.train(_compose("+train.stepz=10", "wandb.mode=disabled"), str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_known_keys_pass():
    assert validate_config(_compose("experiment=table2", "model=llama_tiny", "train.micro_batch_size=64"), 1) == 8


@pytest.mark.parametrize("overrides", [
    ["optimizer.block_granularity=tensor"],
    ["optimizer.state_free_modules=[norms,output]"],
    ["optimizer=galore", "optimizer.state_full=lion", "optimizer.betas=[0.9,0.99]"],  # Table 12's GaLore + Lion
    ["optimizer=badam", "optimizer.reset_state=keep"],
    ["schedule.warmup_steps=100"],
])
def test_every_declared_key_is_settable_without_plus(overrides):
    cfg = _compose(*overrides)
    validate_config(cfg, world_size=1)
    for o in overrides:
        key, value = o.split("=", 1)
        if "." in key:
            assert str(OmegaConf.select(cfg, key)).replace(" ", "").replace("'", "") == value


@pytest.mark.parametrize("entry", sorted(registry.OPTIMIZERS))
def test_optimizer_option_files_are_the_registry_defaults(entry):
    """configs/optimizer/<entry>.yaml shows every key of registry.defaults(entry) with its value (as
    data.DEFAULTS and configs/data agree), and is the text scripts/write_optimizer_configs.py writes."""
    from scripts import write_optimizer_configs as writer

    path = CONFIGS / "optimizer" / f"{entry}.yaml"
    assert path.is_file(), f"no option file for registry entry {entry!r}: run python -m scripts.write_optimizer_configs"
    assert path.read_text() == writer.render(entry, path), "run python -m scripts.write_optimizer_configs"
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    expected = {k: list(v) if isinstance(v, tuple) else v for k, v in registry.defaults(entry).items()}
    if "seed" in expected:
        assert raw.pop("seed") == "${train.seed}"
        expected.pop("seed")
    assert raw == {"name": entry, **expected}
    composed = _compose(f"optimizer={entry}").optimizer
    assert OmegaConf.to_container(composed, resolve=True) == {
        "name": entry, **{k: list(v) if isinstance(v, tuple) else v for k, v in registry.defaults(entry).items()}}


def test_a_registry_default_change_is_caught_until_the_files_are_rewritten(monkeypatch, tmp_path):
    from scripts import write_optimizer_configs as writer

    real = registry.defaults
    monkeypatch.setattr(registry, "defaults",
                        lambda name: {**real(name), "density": 0.5} if name == "frugal" else real(name))
    monkeypatch.setattr(writer, "OPTIMIZER_DIR", tmp_path)
    for path in (CONFIGS / "optimizer").glob("*.yaml"):
        shutil.copy(path, tmp_path / path.name)
    assert writer.main(["--check"]) == 1
    assert writer.main([]) == 0 and writer.main(["--check"]) == 0
    text = (tmp_path / "frugal.yaml").read_text()
    assert "\ndensity: 0.5\n" in text and text.startswith("# FRUGAL (paper default, Table 2)")  # the prose is kept


def test_configs_compose_with_plain_hydra():
    """No import of train_utils or frugal is needed to compose (no schema registered at import)."""
    code = ("import sys; from hydra import compose, initialize_config_dir\n"
            f"with initialize_config_dir(config_dir={str(CONFIGS)!r}, version_base=None):\n"
            "    cfg = compose('config', overrides=['experiment=table2', 'optimizer=frugal_rho0'])\n"
            "assert not any(m.startswith(('train_utils', 'frugal')) for m in sys.modules)\n"
            "print(cfg.optimizer.density, cfg.optimizer.update_gap)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.0", "200"]


def _train_py(*args):
    env = {**subprocess_env(), "WANDB_MODE": "disabled"}  # the CLI tests' environment: one fork server for them
    return run_python([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, timeout=300)


@pytest.mark.slow
def test_train_py_names_a_mistyped_key_with_the_closest_and_exits_2(tmp_path):
    """A plain override of an undeclared key (no +), in any node: one line with the key, the node's
    valid keys and the closest one, exit 2, before any model is built (no metrics written)."""
    cases = {"optimizer.densty=0.3": ("optimizer.densty", "optimizer", "optimizer.density"),
             "train.stepz=5": ("train.stepz", "train", "train.steps"),
             "data.seqlen=5": ("data.seqlen", "data", "data.seq_len"),
             "optimzer=adamw": ("optimzer", "the top level", "optimizer")}
    # One command with all of them (one train.py start-up, not four): each is named in the one line.
    out = _train_py(*cases, "+model.hiden=3", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "schema" not in out.stderr
    assert "model.hiden is not a config key" in last  # a forced key too, in the same line
    for override, (key, node, near) in cases.items():
        assert f"{key} is not a config key (did you mean {near}?); valid keys of {node}: " in last, key
        assert "+" + override not in out.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_wrong_group_value_is_one_line_with_the_choices_and_the_closest(tmp_path):
    """model=llama_70m, or one bad value of a sweep: one line, exit 2, in train.py, eval.py and the
    memory planner, before Hydra composes anything (a sweep starts no job: no sweep dir)."""
    import eval as eval_py
    from bench import memory_plan
    from train_utils.schema import bad_group_choice
    from train_utils.validation import ConfigError

    assert bad_group_choice(["model=llama_70m"]) == (
        "model='llama_70m' is not an option of configs/model/ (did you mean llama_60m?); valid options: gpt2_124m, "
        "llama_130m, llama_1b, llama_20m, llama_350m, llama_35m, llama_3b, llama_60m, llama_7b, llama_tiny")
    assert "setup/algorithm='author' is not an option of configs/setup/algorithm/ (did you mean authors?)" in \
        bad_group_choice(["setup/algorithm=author"])
    assert "did you mean" not in bad_group_choice(["schedule=zzz"])
    ok = ["model=llama_7b", "optimizer=adamw,frugal", "experiment=table2", "setup/algorithm=authors",
          "hydra/launcher=local", "train.steps=3", "+model.x=1", "optimizer=choice(adamw,lion)", "debug=toy"]
    assert bad_group_choice(ok) is None
    out = _train_py("-m", "optimizer=adamw,frugall", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: optimizer='frugall' is not an option of "
                                                          "configs/optimizer/ (did you mean frugal?); valid options: ")
    assert not (tmp_path / "sweep").exists()
    assert memory_plan.main(["model=llama_70m"]) == 2
    with pytest.raises(ConfigError, match="data='c44' is not an option of configs/data/ \\(did you mean c4\\?\\)"):
        eval_py.main(["checkpoint=nowhere", "data=c44"])


@pytest.mark.slow
def test_a_sweep_stopped_by_a_jobs_own_error_exits_2(tmp_path):
    """An error only the job itself meets (its data: the sweep's check before the first job reads
    none, tests/test_sweep_check.py) ends the sweep with the job's one line, and the sweep exits as that
    job would alone: 2 for a config error (Hydra's own exit is 1; a run's own failure stays 1)."""
    nowhere = tmp_path / "nowhere"
    out = _train_py("-m", "data=local", f"data.path={nowhere}", f"hydra.sweep.dir={tmp_path / 'a'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: data.path={str(nowhere)!r} does not exist" in out.stderr, out.stderr[-2000:]
    assert "sweep not started" not in out.stderr and (tmp_path / "a" / "0").is_dir()


def test_only_overrides_that_may_name_an_undeclared_key_are_forced():
    """Keys a node has whatever its option stay as typed (Hydra's sweep listing shows them so)."""
    from train_utils.schema import force_add_key_overrides

    argv = ["-m", "optimizer=adamw,frugal", "train.steps=3", "optimizer.lr=1e-3", "hydra.run.dir=x", "-cn", "config",
            "+train.new=1", "~train.plot", "train.stepz=3", "optimizer.density=0.3", "optimzer=adamw"]
    assert force_add_key_overrides(argv) == argv[:-3] + ["++train.stepz=3", "++optimizer.density=0.3",
                                                         "++optimzer=adamw"]


@pytest.mark.slow
def test_train_py_help_lists_no_internal_groups():
    out = _train_py("--help")
    assert out.returncode == 0, out.stderr
    assert "optimizer: " in out.stdout and "schema" not in out.stdout


def test_a_preset_setting_an_undeclared_key_is_refused_at_start_up(tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    (configs / "experiment" / "typo.yaml").write_text("# @package _global_\ntrain:\n  stepz: 10\n")
    cfg = _compose("experiment=typo", config_dir=configs)
    with pytest.raises(ConfigError, match=r"train\.stepz is not a config key \(did you mean train\.steps\?\)"):
        validate_config(cfg, world_size=1)


def test_a_key_of_another_option_is_refused_for_the_chosen_one():
    """With Hydra's runtime choices, a group's valid keys are its chosen option's: adamw takes no density."""
    cfg = _compose("optimizer=adamw", "++optimizer.density=0.3", hydra_cfg=True)
    with pytest.raises(ConfigError, match=r"optimizer\.density is not a config key; valid keys of optimizer: "
                                          r"name, lr, betas, eps, weight_decay, seed, plugins\."):
        validate_config(cfg, world_size=1)


def test_composed_config_pickles_into_a_fresh_process(tmp_path):
    """The submitit launchers pickle composed configs; they must unpickle elsewhere."""
    cfg = _compose("experiment=table2", "optimizer=frugal_rho0", hydra_cfg=True)
    blob = tmp_path / "cfg.pkl"
    blob.write_bytes(pickle.dumps(cfg))
    assert pickle.loads(blob.read_bytes()) == cfg
    code = ("import pickle, sys; from omegaconf import OmegaConf; cfg = pickle.load(open(sys.argv[1], 'rb')); "
            "print(cfg.optimizer.name, cfg.optimizer.density)")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["frugal", "0.0"]


RUN_DIR_SCRIPT = """
import train_utils
from hydra import compose, initialize_config_dir
with initialize_config_dir(config_dir={configs!r}, version_base=None):
    cfg = compose("config", return_hydra_config=True)
print(cfg.hydra.run.dir, cfg.hydra.sweep.dir)
"""


def _run_dirs(extra_env: dict, n: int = 2) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(extra_env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    code = RUN_DIR_SCRIPT.format(configs=str(CONFIGS))
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    return [o[0].strip() for o in outs]


@pytest.mark.slow
def test_run_dirs_are_unique_per_launch_and_shared_by_its_ranks():
    alone = _run_dirs({})
    assert alone[0] != alone[1], "two launches (started together) must not share a run directory"
    for line in alone:
        run_dir, sweep_dir = line.split()
        assert run_dir.startswith("outputs/") and sweep_dir.startswith("multirun/")
    # Two ranks of one torchrun launch (same TORCHELASTIC_RUN_ID, same parent): one directory.
    ranks = _run_dirs({"TORCHELASTIC_RUN_ID": "3f9a1c2e-77b0-4d7e-9a55-0123456789ab"})
    assert ranks[0] == ranks[1] and ranks[0].split()[0].endswith("-llama_tiny-frugal-3f9a1c2e")
    job = _run_dirs({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"})
    assert job[0] == job[1] and job[0].split()[0].endswith("-4242.0")


def test_launch_id_is_8_hex_digits(monkeypatch):
    """A plain launch's id: 8 random hex digits (4 collide for two launches in the same second with
    probability 1/65536); a torchrun --standalone uuid gives its first 8, so ranks agree."""
    import re

    for key in [k for k in os.environ if k.startswith(("TORCHELASTIC_", "SLURM_"))]:
        monkeypatch.delenv(key)
    fresh = naming.launch_id.__wrapped__  # past the per-process cache
    ids = {fresh() for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch(r"[0-9a-f]{8}", i) for i in ids), ids
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f9a1c2e-77b0-4d7e-9a55-0123456789ab")
    assert fresh() == "3f9a1c2e"


def _fake_multirun(tmp_path, master_task, job_task, params, option="frugal"):
    sweep = tmp_path / "12-00-00-abc"
    sweep.mkdir()
    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": master_task}, "sweeper": {"params": params}}}),
                   sweep / "multirun.yaml")
    return OmegaConf.create({"mode": "MULTIRUN", "sweep": {"dir": str(sweep)}, "sweeper": {"params": params},
                             "overrides": {"task": job_task}, "runtime": {"choices": {"optimizer": option}}})


def test_sweep_jobs_are_named_by_option_and_swept_values(tmp_path):
    cfg = _compose("experiment=table2", "model=llama_60m", "optimizer=frugal_rho0")
    params = {"optimizer": "adamw,galore,badam,frugal,frugal_rho0", "model": "llama_60m,llama_130m"}
    hc = _fake_multirun(
        tmp_path,
        master_task=["experiment=table2", "model=llama_60m", "optimizer.density=0.125,0.25",
                     "optimizer.update_gap=100,200"],
        job_task=["optimizer=frugal_rho0", "model=llama_60m", "experiment=table2", "optimizer.density=0.125",
                  "optimizer.update_gap=100"],
        params=params, option="frugal_rho0")
    assert naming.swept_keys(["model=llama_60m", "optimizer.density=0.125,0.25"], params) == \
        ["optimizer", "optimizer.density"]
    assert naming.sweep_values(hc) == {"optimizer": "frugal_rho0", "optimizer.density": "0.125",
                                       "optimizer.update_gap": "100"}
    assert naming.run_name(cfg, "multirun/x/3", hc) == "llama_60m-frugal_rho0-density=0.125-update_gap=100"
    assert naming.run_group(cfg, hc) == "table2-12-00-00-abc"
    assert naming.optimizer_option(cfg, hc) == "frugal_rho0"


def test_single_runs_are_named_by_option_and_run_dir():
    cfg = _compose("optimizer=frugal_rho0")
    single = OmegaConf.create({"mode": "RUN", "runtime": {"choices": {"optimizer": "frugal_rho0"}}})
    assert naming.run_name(cfg, "outputs/2026-01-01/12-00-00-77-ab12", single) == \
        "llama_tiny-frugal_rho0-12-00-00-77-ab12"
    # the default run dir already says model and option: the name does not repeat them
    assert naming.run_name(cfg, "outputs/2026-01-01/12-00-00-llama_tiny-frugal_rho0-ab12", single) == \
        "llama_tiny-frugal_rho0-12-00-00-ab12"
    assert naming.run_group(cfg, single) is None
    assert naming.run_group(_compose("experiment=table2"), single) == "table2"
    # Without Hydra's runtime information (configs composed in tests): the registry entry.
    assert naming.run_name(cfg, "runs/a", None) == "llama_tiny-frugal-a"
    named = _compose("wandb.name=mine", "wandb.group=g")
    assert naming.run_name(named, "runs/a", single) == "mine" and naming.run_group(named, single) == "g"


def test_stop_with_error_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as stop:
        stop_with_error(ConfigError("train.steps=0 is invalid"), 2)
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: train.steps=0 is invalid\n"
    monkeypatch.setattr(naming, "_hydra", lambda hc=None: OmegaConf.create({"mode": "MULTIRUN"}))
    with pytest.raises(JobError, match=r"^error: train.steps=0 is invalid$"):
        stop_with_error(ConfigError("train.steps=0 is invalid"), 2)


@pytest.mark.slow
def test_precision_auto_is_bf16_mixed_only_where_bf16_is_native():
    """train.precision=auto: bf16-mixed on a CPU whose flags list AVX512-BF16 or AMX (read here from
    /proc/cpuinfo on its own) and whose oneDNN may use them, fp32 on other CPUs, and fp32 where
    oneDNN is held to AVX2 (ONEDNN_MAX_CPU_ISA, the AVX2-only kind's timing, docs/measurements.md);
    a set value is kept; a bad one names the choices."""
    import torch

    from train_utils.validation import ConfigError, resolve_precision

    try:
        with open("/proc/cpuinfo") as f:
            flags = set(" ".join(line for line in f if line.startswith("flags")).split())
    except OSError:
        flags = set()
    native = bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_precision("auto", "cpu") == ("bf16-mixed" if native else "fp32")
    held = subprocess.run(
        [sys.executable, "-c", "from train_utils.validation import resolve_precision as r; print(r('auto', 'cpu'))"],
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
        cwd=ROOT, capture_output=True, text=True, check=True)
    assert held.stdout.strip() == "fp32", held.stderr
    for kept in ("bf16-mixed", "bf16", "fp32"):
        assert resolve_precision(kept, "cpu") == kept
    # debug=toy: a preset's bf16-mixed is this CPU's auto; pure bf16 and fp32 cells keep theirs
    assert resolve_precision("bf16-mixed", "cpu", "toy") == resolve_precision("auto", "cpu")
    assert [resolve_precision(p, "cpu", "toy") for p in ("bf16", "fp32")] == ["bf16", "fp32"]
    with pytest.raises(ConfigError,
                       match="train.precision='fp16' is invalid; choose one of bf16-mixed, bf16, fp32, auto"):
        resolve_precision("fp16", "cpu")
