"""Every experiment preset (one per paper table) composes, its sweep is valid, and it trains two steps.

Parametrised over configs/experiment/*.yaml, so a new preset is tested without touching this file.
Checks per preset:
- composed as written (the paper's model), every interpolation resolves: steps, cycle length and
  micro batch are known for the preset's model, and the paper's protocol holds (batch 512, 256 tokens,
  >= 10M validation tokens that must really be there);
- every method runs at the paper's learning rate (AdamW's best rate for all, GaLore included);
- every value of the preset's multirun (`hydra.sweeper.params`) composes and its optimizer config is
  accepted by frugal.build_optimizer (a key that does not apply to a method is an error there);
- two training steps with `model=llama_tiny data=synthetic` and a small batch, in process.
The optimizer options themselves: each is its registry entry plus only what it changes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from _train_helpers import compose_once
from hydra.errors import HydraException
from omegaconf import OmegaConf

import frugal
import models
from frugal import registry

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PRESETS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
# Presets outside the paper's protocol (the 512-sequence batch on 8 GPUs): one GPU, checked on their own.
SINGLE_GPU = ["llama7b_single_gpu", "llama7b_single_gpu_rho025"]
PAPER_PRESETS = [p for p in PRESETS if p not in SINGLE_GPU]
OPTIONS = sorted(p.stem for p in (CONFIGS / "optimizer").glob("*.yaml"))
# data.num_workers=0: the presets' C4 worker counts would start 4 processes per preset here.
TINY = ["model=llama_tiny", "data=synthetic", "data.num_workers=0", "train.steps=2", "train.batch_size=2",
        "train.micro_batch_size=1", "train.eval_every=0", "train.eval_tokens=64", "data.seq_len=32",
        "checkpoint.every=0", "train.plot=false", "train.progress_bar=false", "wandb.mode=disabled"]


def _compose(overrides, hydra_cfg=False):
    # Once per session for each override list (a sweep's job recurs here and in tests/test_tables.py); a copy.
    return compose_once(*overrides, hydra_cfg=hydra_cfg)


def test_every_table_has_a_preset():
    expected = {"table1_projection", "table2", "table3_precision", "table4_state_free_modules", "table5_3b",
                "table8_beta2", "table10_pure_bf16", "table11_state_free_rule", "table12_lion",
                "table13_gpt2", "table14_block_order", "table15_update_gap", "tables6_7_schedules",
                "table16_density", "table17_concurrent"}
    assert expected <= set(PRESETS)


def test_shared_settings_are_not_experiments():
    """setup/ holds what presets share; the experiment group holds presets only (issue 13)."""
    assert not [p for p in (CONFIGS / "experiment").rglob("*.yaml") if p.parent != CONFIGS / "experiment"]
    for name in ("common/paper", "setup/paper", "paper"):
        with pytest.raises(HydraException):
            _compose([f"experiment={name}"])


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_preset_composes_with_paper_settings(preset):
    cfg = _compose([f"experiment={preset}"])
    OmegaConf.resolve(cfg)
    assert cfg.paper.table == preset
    assert cfg.train.batch_size == 512 and cfg.data.seq_len == 256
    assert cfg.train.eval_tokens >= 10_000_000 and cfg.train.require_eval_tokens is True
    assert cfg.train.steps >= 100_000
    # The standard A100 node: 8 GPUs. A micro-batch above 512 / 8 would stop such a run at start-up.
    assert cfg.train.batch_size % (cfg.train.micro_batch_size * 8) == 0
    # Throughput settings every paper preset states (configs/setup/paper.yaml, issue 10): compiled on
    # GPUs, and C4's DataLoader workers per rank sized from the GPU's demand at start-up.
    assert cfg.train.compile == "auto"
    assert cfg.data.num_workers == "auto"
    assert cfg.train.parallelism == ("fsdp" if cfg.model.name == "llama_7b" else "ddp")


@pytest.mark.slow
def test_presets_take_throughput_and_memory_settings_per_model():
    by_model = {m: _compose(["experiment=table2", f"model={m}"]) for m in ("llama_60m", "llama_130m", "llama_1b",
                                                                          "llama_3b", "llama_7b", "gpt2_124m")}
    from train_utils.measure import device_peak, workers_needed

    def workers(gpu: str) -> dict:  # data.num_workers=auto's demand on that GPU (train.peak_flops: its peak)
        return {m: workers_needed(OmegaConf.merge(c, {"train": {"peak_flops": device_peak(gpu)[1]}}),
                                  torch.device("cpu")) for m, c in by_model.items()}

    # The A100 counts of docs/data_pipeline.md (the paper's GPUs); an H100 SXM consumes 3.2x as much.
    assert workers("NVIDIA A100-SXM4-80GB") == {
        "llama_60m": 4, "llama_130m": 1, "llama_1b": 1, "llama_3b": 1, "llama_7b": 1, "gpt2_124m": 1}
    assert workers("NVIDIA H100 80GB HBM3") == {
        "llama_60m": 8, "llama_130m": 4, "llama_1b": 1, "llama_3b": 1, "llama_7b": 1, "gpt2_124m": 4}
    assert {m: (c.train.micro_batch_size, c.train.parallelism, c.train.activation_checkpointing)
            for m, c in by_model.items() if m in ("llama_1b", "llama_3b", "llama_7b")} == {
        "llama_1b": (32, "ddp", False), "llama_3b": (16, "ddp", False), "llama_7b": (32, "fsdp", False)}


# Appendix A.1 and Section 5 ("Main results"): the best AdamW rate (1e-3) for every method, GaLore
# included ("using this same learning rate produced better results than the originally suggested rate").
PAPER_LR = {"adamw": 1e-3, "frugal": 1e-3, "frugal_rho0": 1e-3, "badam": 1e-3, "galore": 1e-3, "signsgd": 1e-3}


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in PAPER_PRESETS if p != "table5_3b"])  # 3B: one lr (5e-4) for all
@pytest.mark.parametrize("option", sorted(PAPER_LR))
def test_preset_runs_each_method_at_the_papers_lr(preset, option):
    from train_utils.validation import ConfigError, check_known_keys

    cfg = _compose([f"experiment={preset}", f"optimizer={option}"], hydra_cfg=True)
    try:
        check_known_keys(cfg)
    except ConfigError as err:
        # The preset sets an optimizer key this method does not take (e.g. Table 14's density for
        # adamw): refused at start-up, naming the key, instead of running something else.
        assert "is not a config key" in str(err) and "valid keys of optimizer" in str(err), err
        assert option not in str(cfg.hydra.sweeper.params)
        return
    assert cfg.optimizer.lr == pytest.approx(PAPER_LR[option]), (preset, option, cfg.optimizer.lr)


@pytest.mark.slow
def test_galores_own_recipe_is_an_option_no_preset_uses():
    own = _compose(["optimizer=galore_original"]).optimizer
    assert own.name == "galore" and own.lr == pytest.approx(1e-2) and own.projectable_lr_scale == 0.25
    for preset in PRESETS:
        params = _compose([f"experiment={preset}"], hydra_cfg=True).hydra.sweeper.params  # None: one run
        sweep = OmegaConf.to_container(params) if params is not None else {}
        assert "galore_original" not in str(sweep.get("optimizer", "")), preset


@pytest.mark.parametrize("option", OPTIONS)
def test_optimizer_option_is_its_registry_entry_plus_what_it_changes(option):
    cfg = _compose([f"optimizer={option}"])
    opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
    entry = opt.pop("name")
    assert set(opt) == set(registry.accepted_keys(entry)), "every key the entry takes is settable without +"
    raw = yaml.safe_load((CONFIGS / "optimizer" / f"{option}.yaml").read_text())
    if option in registry.OPTIMIZERS:  # written by scripts/write_optimizer_configs.py (tests/test_config.py)
        assert option == entry and "defaults" not in raw
        return
    assert raw["defaults"] == [entry, "_self_"], "a variant names its entry's file, then what it changes"
    defaults = registry.defaults(entry)
    for key, value in raw.items():
        if key != "defaults":
            assert value != (list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key]), \
                f"{option}.yaml restates the registry's default {key}={value!r}"


def _sweep_runs(preset):
    """Override lists covering every value of every axis of the preset's multirun.

    One run per value (not the cartesian product): the axes of a table are independent (model size
    never changes which optimizer keys are valid), and composing ~100 products would cost minutes.
    """
    cfg = _compose([f"experiment={preset}"], hydra_cfg=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params) if cfg.hydra.sweeper.params is not None else {}
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    runs = []
    for key, values in params.items():
        override = parser.parse_override(f"{key}={values}")
        choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [str(values)]
        runs += [[f"{key}={v}"] for v in choices]
    return runs or [[]]


# Table 2's sweep (AdamW, GaLore, BAdam, FRUGAL, FRUGAL rho=0) and Table 17's (the concurrent methods) in the
# fast tier; every other preset (~1 s of composing and building each) in the full suite.
FAST_SWEEPS = ("table2", "table17_concurrent")


@pytest.mark.parametrize("preset", [p if p in FAST_SWEEPS else pytest.param(p, marks=pytest.mark.slow)
                                    for p in PRESETS])
@pytest.mark.slow
def test_preset_sweep_runs_build_and_run_the_authors_algorithm(preset):
    """Every run of the preset's sweep builds its optimizer and schedule; every FRUGAL-family row runs the
    pseudocode's restart and the authors' blocks (setup/algorithm=authors), BAdam the badam package's
    options; GaLore keeps its state. Each run as the sweep composes it (its model's steps and schedule; the
    job tests/test_tables.py composes too), its optimizer built on llama_tiny (a model sets no optimizer key)."""
    runs = _sweep_runs(preset)
    model = models.build_model(OmegaConf.load(CONFIGS / "model" / "llama_tiny.yaml"))
    for overrides in runs:
        cfg = _compose([f"experiment={preset}", *overrides])
        opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
        if opt["name"] in ("frugal", "frugal_muon"):
            assert (opt["reset_state"], opt["block_granularity"]) == ("reset_all", "tensor"), (preset, overrides)
        if opt["name"] == "badam":  # the badam package's BlockOptimizer (tests/test_badam_package.py)
            assert (opt["reset_state"], opt["window_offset"], opt["master_weights"], opt["block_granularity"]) == (
                "reset_everything", 1, True, "layer_floor"), (preset, overrides)
        if opt["name"] == "galore":
            assert opt["reset_state"] == "keep" and opt["projectable_lr_scale"] == 0.25, (preset, overrides)
        optimizer = frugal.build_optimizer(model, **opt)  # raises on keys a method does not take
        sched = OmegaConf.to_container(cfg.schedule, resolve=True)
        frugal.build_scheduler(optimizer, total_steps=cfg.train.steps, **sched)


# Table 16 on LLaMA-130M: the authors' selection (block_granularity=tensor from setup/algorithm=authors)
# makes Python's round(rho x 84) of its 84 weight tensors state-full; rho = 1 is AdamW itself and
# "signSGD only" has no state. What each row of the preset's multirun realises (k of L blocks):
TABLE16_ROWS = {"rho_0": (0.0, 0, 84), "rho_0.0625": (0.0625, 5, 84), "rho_0.125": (0.125, 10, 84),
                "rho_0.25": (0.25, 21, 84), "rho_1_3": (1 / 3, 28, 84), "rho_0.5": (0.5, 42, 84)}


@pytest.mark.slow
def test_table16_every_density_is_a_distinct_run():
    runs = _sweep_runs("table16_density")
    assert [o[0].split("=")[0] for o in runs] == ["setup/table16"] * 8
    names = {}
    for overrides in runs:
        row = overrides[0].split("=")[1]
        cfg = _compose(["experiment=table16_density", *overrides])
        assert cfg.model.name == "llama_130m" and cfg.model.num_hidden_layers == 12
        opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
        names[row] = opt["name"]
        if row not in TABLE16_ROWS:
            continue
        assert (opt["reset_state"], opt["block_granularity"]) == ("reset_all", "tensor"), row
        with torch.device("meta"):
            model = models.build_model(cfg.model)
        report = frugal.build_optimizer(model, **opt).density_report()
        density, k, n = TABLE16_ROWS[row]
        assert opt["density"] == pytest.approx(density) and report["blocks"] == [k, n], (row, report)
        assert report["realised"] == pytest.approx(k / n)
    assert names == {"adamw": "adamw", "signsgd": "signsgd", **{r: "frugal" for r in TABLE16_ROWS}}


def test_outside_a_preset_the_librarys_algorithm_holds():
    """(Inside the paper presets: test_preset_sweep_runs_build_and_run_the_authors_algorithm.)"""
    plain = _compose(["optimizer=frugal"]).optimizer
    assert (plain.reset_state, plain.block_granularity) == ("reset", "layer")
    library = _compose(["experiment=table2", "optimizer=frugal", "setup/algorithm=library"]).optimizer
    assert (library.reset_state, library.block_granularity) == ("reset", "layer")


@pytest.mark.slow
def test_table1_rows_without_state_free_update_are_galore():
    rows = {o[0].split("=")[1]: _compose(["experiment=table1_projection", *o]).optimizer
            for o in _sweep_runs("table1_projection")}
    assert set(rows) == {"svd_galore", "random_galore", "random", "svd", "randk", "block", "adamw"}
    for row, projection in (("svd_galore", "svd"), ("random_galore", "random")):
        opt = rows[row]
        assert (opt.name, opt.projection, opt.state_free, opt.reset_state, opt.projectable_lr_scale) == \
            ("galore", projection, "none", "keep", 0.25)
        assert opt.lr == pytest.approx(1e-3)
    for row in ("random", "svd", "randk", "block"):
        assert (rows[row].name, rows[row].projection, rows[row].state_free) == ("frugal", row, "signsgd")
    assert rows["adamw"].name == "adamw"


def test_protocol_sweeps():
    """Appendix A.1: AdamW's lr grid, GaLore at its own lr (0.01) and at AdamW's (1e-3)."""
    grid = _compose(["experiment=lr_grid_adamw"], hydra_cfg=True)
    assert grid.optimizer.name == "adamw" and str(grid.hydra.sweeper.params["optimizer.lr"]) == "1e-4,3e-4,1e-3,3e-3"
    galore = _compose(["experiment=lr_galore"], hydra_cfg=True)
    assert galore.optimizer.name == "galore" and str(galore.hydra.sweeper.params["optimizer.lr"]) == "1e-2,1e-3"
    assert str(galore.hydra.sweeper.params["model"]) == "llama_60m,llama_130m,llama_350m,llama_1b"


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_two_steps(preset, tmp_path):
    import train

    cfg = _compose([f"experiment={preset}", *TINY])
    status = train.train(cfg, str(tmp_path))
    assert not status
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["event"] == "start" and rows[-1]["event"] == "end"
    assert rows[-1]["step"] == 2 and torch.isfinite(torch.tensor(rows[-1]["val_loss"]))


# The figures configs/setup/paper.yaml states for its 1B/3B/7B presets: per-rank GiB required (peak +
# CUDA context and fragmentation allowance) of the worst method, on 8 x A100 80 GB.
PRESET_MEMORY = {"llama_1b": ("table2", 51.0), "llama_3b": ("table5_3b", 69.2), "llama_7b": ("table2", 68.1)}


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(PRESET_MEMORY))
def test_large_presets_fit_an_80gb_a100_with_the_margin_stated(model):
    """The planner (train_utils/memory_plan.py) on each preset as composed (its micro-batch,
    parallelism, checkpointing) for every method of its sweep that the parallelism takes: it fits with
    at least 10% of the device free, and the worst method needs what paper.yaml says."""
    from train_utils.memory_plan import DEVICES, GIB, plan_memory

    preset, stated = PRESET_MEMORY[model]
    device = DEVICES["a100-80gb"]
    required = {}
    for overrides in _sweep_runs(preset):
        if not overrides[0].startswith("optimizer="):
            continue
        cfg = _compose([f"experiment={preset}", f"model={model}", *overrides])
        opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
        if cfg.train.parallelism == "fsdp" and opt.get("projection") in ("svd", "random"):
            continue  # GaLore's bases need whole matrices: refused on FSDP2 shards (tests/test_fsdp.py)
        plan = plan_memory(cfg.model, opt, micro_batch_size=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
                           world_size=8, parallelism=cfg.train.parallelism, precision=cfg.train.precision,
                           activation_checkpointing=cfg.train.activation_checkpointing)
        required[opt["name"] + str(opt.get("density", ""))] = plan.required
    assert len(required) >= 3, required
    worst = max(required.values())
    assert device - worst >= 0.1 * device, {k: v / GIB for k, v in required.items()}
    assert round(worst / GIB, 1) == stated, {k: round(v / GIB, 2) for k, v in required.items()}


def test_llama7b_on_one_24gb_gpu_is_the_authors_recipe_and_fits():
    """experiment=llama7b_single_gpu: the authors' 7B script's settings (PAPER_NOTES.md), the step in
    backward without accumulation, and a plan that leaves >= 10% of a 24 GB card free and fits an L4."""
    from train_utils.memory_check import in_backward_settings
    from train_utils.memory_plan import DEVICES, plan_memory

    cfg = _compose(["experiment=llama7b_single_gpu"])
    OmegaConf.resolve(cfg)
    opt, tc = cfg.optimizer, cfg.train
    assert (opt.name, opt.density, opt.lr, opt.update_gap, opt.state_free) == ("frugal", 0.0, 5e-4, 500, "signsgd")
    assert opt.projectable_lr_scale == opt.state_free_lr_scale == 0.3 and opt.stochastic_rounding is True
    assert (cfg.schedule.name, cfg.schedule.cycle_length, cfg.schedule.warmup_steps) == ("cosine_restarts", 150000,
                                                                                          15000)
    assert (tc.grad_clip, tc.precision, tc.activation_checkpointing, tc.optimizer_in_backward) == (1.0, "bf16", True,
                                                                                                   True)
    assert tc.batch_size == tc.micro_batch_size == 16 and tc.parallelism == "ddp"
    settings = in_backward_settings(cfg, 1)
    assert settings == {"optimizer_in_backward": True, "grad_clip": True, "accumulation": 1}
    plan = plan_memory(cfg.model, OmegaConf.to_container(opt), micro_batch_size=16, seq_len=cfg.data.seq_len,
                       precision="bf16", activation_checkpointing=True, **settings)
    assert plan.required <= 0.9 * DEVICES["rtx-24gb"], plan.format(DEVICES["rtx-24gb"])
    assert plan.fits(DEVICES["l4"]) and plan.fits(DEVICES["a10"])
    bigger = plan_memory(cfg.model, OmegaConf.to_container(opt), micro_batch_size=64, seq_len=cfg.data.seq_len,
                         precision="bf16", activation_checkpointing=True, **settings)
    assert not bigger.fits(DEVICES["rtx-24gb"])  # the next sizes up do not leave the margin (32: 1 GiB)


# ---------------------------------------------------------------- debug=toy keeps a sweep's meaning
# configs/debug/toy.yaml and train_utils/toy.py: every cell of a paper preset's sweep under debug=toy switches
# its state-full subspace at least twice, distinct update gaps stay distinct, distinct model sizes stay
# distinct models. From the composed configs (train_utils.toy.fit, what train() applies), no training.
PAPER_SIZES = ["llama_20m", "llama_35m", "llama_60m", "llama_130m", "llama_350m", "llama_1b", "llama_3b", "llama_7b"]
# The issue's two sweeps: Table 15's seven gaps are seven toy gaps (k = 11, 200 steps: switching 199, 99, 39,
# 19, 10, 4 and 2 times); Table 2's four sizes are four toy models (layers, hidden), 130M docs/reproducing.md's 4 x 128.
TOY_CELLS = {"table15_update_gap": {10: 1, 20: 2, 50: 5, 100: 10, 200: 19, 500: 46, 1000: 91},
             "table2": {"llama_60m": (4, 96), "llama_130m": (4, 128), "llama_350m": (6, 128), "llama_1b": (6, 160)}}


def _toy_params(model_cfg, vocab: int = 512) -> int:  # 512: the synthetic corpus's symbols
    with torch.device("meta"):
        return sum(p.numel() for p in models.build_model(model_cfg, vocab_size=vocab).parameters())


# The two sweeps in the fast tier; every other preset (about 1.5 s of composing each) in the full suite.
@pytest.mark.parametrize("preset", [p if p in TOY_CELLS else pytest.param(p, marks=pytest.mark.slow)
                                    for p in PAPER_PRESETS])
@pytest.mark.slow
def test_debug_toy_keeps_the_sweeps_cells_apart(preset):
    """Each value of each axis of the preset's multirun, composed with debug=toy (the axes are independent:
    an update gap depends on the optimizer option and the swept gaps, not on the model)."""
    from train_utils import toy

    gaps, sizes, shapes = {}, {}, {}
    for overrides in _sweep_runs(preset):
        cfg = _compose([f"experiment={preset}", *overrides, "debug=toy"], hydra_cfg=True)
        toy.fit(cfg, cfg.hydra)
        gap, steps = OmegaConf.select(cfg, "optimizer.update_gap", default=None), cfg.train.steps
        assert steps == 200, (preset, overrides)  # no paper sweep needs a longer toy run
        if gap is not None:
            assert toy.switches(steps, gap) >= toy.SWITCHES, (preset, overrides, gap, steps)
        key, _, value = overrides[0].partition("=") if overrides else ("", "", "")
        if key == "optimizer.update_gap":
            gaps[int(value)] = gap
        if key == "model":
            sizes[value] = _toy_params(cfg.model, cfg.data.vocab_size)
            shapes[value] = (cfg.model.num_hidden_layers, cfg.model.hidden_size)
    assert len(set(gaps.values())) == len(gaps), gaps
    assert sorted(gaps.values()) == [gaps[g] for g in sorted(gaps)], gaps  # in the paper's order
    assert len(set(sizes.values())) == len(sizes), sizes
    assert sorted(sizes.values()) == [sizes[m] for m in PAPER_SIZES if m in sizes], sizes  # larger stays larger
    if preset in TOY_CELLS:
        assert (gaps or shapes) == TOY_CELLS[preset]


def test_debug_toy_ladder_covers_every_paper_size():
    from train_utils import toy

    ladder = yaml.safe_load((CONFIGS / "debug" / "toy.yaml").read_text())["paper"]["toy_model"]
    assert list(ladder) == PAPER_SIZES
    tiny = OmegaConf.load(CONFIGS / "model" / "llama_tiny.yaml")
    params = [_toy_params(OmegaConf.merge(tiny, {"num_hidden_layers": r["layers"], "hidden_size": r["hidden"],
                                                 "intermediate_size": r["intermediate"]})) for r in ladder.values()]
    assert params == sorted(params) and len(set(params)) == len(params)
    assert params[-1] < 4.5 * params[PAPER_SIZES.index("llama_130m")]  # the largest toy stays minutes on a CPU
    m = _compose(["model=llama_7b", "debug=toy"]).model
    assert _toy_params(m) == params[-1]  # what a run composes is the ladder's rung
    # a model not in the ladder (GPT-2, llama_tiny, one's own) shrinks to 4 x 128; a gap of 200: 67 (k = 3)
    for model in ("gpt2_124m", "llama_tiny"):
        cfg = _compose([f"model={model}", "optimizer=galore", "debug=toy"], hydra_cfg=True)
        assert (cfg.model.num_hidden_layers, cfg.model.hidden_size, cfg.model.intermediate_size) == (4, 128, 352)
        assert toy.fit(cfg, cfg.hydra)["changed"] == {"optimizer.update_gap": (200, 67)}


def test_debug_toy_gap_rule():
    from train_utils.toy import switches, toy_gaps

    assert toy_gaps([10, 20, 50, 100, 200, 500, 1000], 200) == (
        11, {10: 1, 20: 2, 50: 5, 100: 10, 200: 19, 500: 46, 1000: 91}, 200)
    assert toy_gaps([50], 200) == (1, {50: 50}, 200)  # already switches twice: kept
    # gaps one apart would meet at k = 11: k drops until they are distinct, and the run grows so that the
    # largest still switches twice; unless its length was given (then it is kept)
    k, mapping, steps = toy_gaps([998, 999, 1000], 200)
    assert len(set(mapping.values())) == 3 and switches(steps, mapping[1000]) >= 2 and steps > 200
    assert toy_gaps([998, 999, 1000], 200, steps_fixed=True)[2] == 200
    assert toy_gaps([1000], 2, steps_fixed=True) == (1, {1000: 1000}, 2)  # too short to switch: left alone
    assert [switches(200, g) for g in (99, 100, 199, 200)] == [2, 1, 1, 0]


def test_debug_toy_fit_follows_the_command_line(tmp_path):
    from train_utils import toy

    plain = _compose(["experiment=table15_update_gap", "optimizer.update_gap=1000"], hydra_cfg=True)
    assert toy.fit(plain, plain.hydra) == {} and plain.optimizer.update_gap == 1000  # only under debug=toy
    fixed = _compose(["experiment=table15_update_gap", "optimizer.update_gap=1000", "debug=toy", "train.steps=2"],
                     hydra_cfg=True)
    assert toy.fit(fixed, fixed.hydra) == {} and fixed.optimizer.update_gap == 1000  # README's 2-step toy
    # a multirun's own sweep of gaps (multirun.yaml in the sweep dir) replaces the preset's
    job = _compose(["experiment=table15_update_gap", "optimizer.update_gap=300", "debug=toy",
                    f"hydra.sweep.dir={tmp_path}"], hydra_cfg=True)
    OmegaConf.save({"hydra": {"overrides": {"task": ["optimizer.update_gap=299,300", "debug=toy"]},
                              "sweeper": {"params": OmegaConf.to_container(job.hydra.sweeper.params)}}},
                   tmp_path / "multirun.yaml")
    from hydra.types import RunMode

    job.hydra.mode = RunMode.MULTIRUN
    assert toy.fit(job, job.hydra)["gaps"] == {299: 299, 300: 300}  # any k > 1 would make them one gap...
    assert (job.optimizer.update_gap, job.train.steps) == (300, 601)  # ...so the run grows: 2 switches


def test_debug_toy_run_records_what_it_trains(tmp_path):
    """The run's saved config (.hydra/config.yaml, which make_tables reads) holds the toy gap and shape."""
    from train_utils import toy

    cfg = _compose(["experiment=table15_update_gap", "optimizer.update_gap=500", "debug=toy"], hydra_cfg=True)
    saved = tmp_path / ".hydra" / "config.yaml"
    saved.parent.mkdir()
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.save(task, saved)
    cfg.hydra.runtime.output_dir = str(tmp_path)
    toy.record(cfg, toy.fit(cfg, cfg.hydra), cfg.hydra)
    written = OmegaConf.load(saved)
    assert written.optimizer.update_gap == 46 and written.train.steps == 200
    assert (written.model.num_hidden_layers, written.model.hidden_size) == (4, 128)  # plain numbers
    assert written.train.micro_batch_size == cfg.train.micro_batch_size  # the rest as it was
