"""Tables 9 and 17 run every row: the presets compose the paper's settings per row, the new options
train, make_tables prints both tables with all rows and the memory estimate, and mini_repro has the
optional rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import frugal
from scripts import make_tables, mini_repro
from scripts.paper_tables import GIB, SPECS, TABLE9, TABLE17

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TINY = ["model=llama_tiny", "data=synthetic", "train.steps=2", "train.batch_size=2",
        "train.micro_batch_size=1", "train.eval_every=0", "train.eval_tokens=64", "data.seq_len=32",
        "checkpoint.every=0", "train.plot=false", "train.progress_bar=false", "wandb.mode=disabled"]


def _compose(overrides, hydra_cfg=False):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _sweep(preset):
    params = _compose([f"experiment={preset}"], hydra_cfg=True).hydra.sweeper.params
    return {k: str(v).split(",") for k, v in params.items()}


def test_table17_rows_clip_or_limit_and_decay_as_the_paper_says():
    sweep = _sweep("table17_concurrent")
    assert sweep == {"optimizer": ["adamw", "fira", "ldadam", "frugal"], "model": ["llama_130m", "llama_350m"]}
    for option in sweep["optimizer"]:
        cfg = _compose(["experiment=table17_concurrent", f"optimizer={option}"])
        OmegaConf.resolve(cfg)
        assert cfg.optimizer.weight_decay == 0.1, option
        if option == "fira":  # the norm-growth limiter instead of clipping
            assert cfg.train.grad_clip == 0.0 and cfg.optimizer.fira_gamma == pytest.approx(1.01)
            assert cfg.optimizer.lr == pytest.approx(1e-2)  # Fira's own scripts
        else:
            assert cfg.train.grad_clip == 1.0
    ldadam = _compose(["experiment=table17_concurrent", "optimizer=ldadam"]).optimizer
    assert (ldadam.projection, ldadam.update_gap, ldadam.reset_state, ldadam.error_feedback) == \
        ("power", 1, "transport", True)
    assert list(ldadam.betas) == [0.908, 0.99] and ldadam.subspace_momentum == 0.908


@pytest.mark.slow
def test_table9_runs_every_row_on_table2_sizes():
    sweep = _sweep("table9_adamem")
    assert sweep == {"optimizer": ["adamw", "adamem", "frugal", "frugal_rho0"],
                     "model": ["llama_60m", "llama_130m", "llama_350m"]}
    cfg = _compose(["experiment=table9_adamem"])
    assert cfg.optimizer.name == "adamem" and cfg.train.grad_clip == 0.0 and cfg.optimizer.weight_decay == 0.0
    from scripts.paper_tables import method

    labels = {method(OmegaConf.to_container(_compose(["experiment=table9_adamem", f"optimizer={o}"]).optimizer))
              for o in sweep["optimizer"]}
    assert labels == set(TABLE9)
    labels17 = {method(OmegaConf.to_container(_compose(["experiment=table17_concurrent", f"optimizer={o}"]).optimizer))
                for o in _sweep("table17_concurrent")["optimizer"]}
    assert labels17 == set(TABLE17)


@pytest.mark.parametrize("preset,option", [("table17_concurrent", "fira"), ("table17_concurrent", "ldadam"),
                                           ("table9_adamem", "adamem")])
@pytest.mark.slow
def test_new_rows_train_two_steps(preset, option, tmp_path):
    import train

    cfg = _compose([f"experiment={preset}", f"optimizer={option}", *TINY])
    assert not train.train(cfg, str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start, end = rows[0], rows[-1]
    assert end["event"] == "end" and end["step"] == 2
    assert start["optimizer"] == option and start["optimizer_state_bytes_estimate"] > 0


def fake_run(root: Path, name: str, preset: str, option: str, model: str, ppl: float, state_bytes: int):
    """A finished run directory with the config Hydra would save for this cell."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    cfg = _compose([f"experiment={preset}", f"optimizer={option}", f"model={model}"])
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create([f"optimizer={option}", f"model={model}"]), run / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": {"optimizer": option, "model": model}}}}),
                   run / ".hydra" / "hydra.yaml")
    rows = [{"event": "start", "step": 0, "optimizer_state_bytes": state_bytes},
            {"event": "end", "step": 200000, "val_loss": 3.0, "val_ppl": ppl,
             "optimizer_state_bytes": state_bytes}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_make_tables_prints_tables_9_and_17_with_every_row_and_the_estimate(tmp_path, capsys):
    fake_run(tmp_path, "a", "table9_adamem", "adamem", "llama_60m", 23.90, int(0.28 * GIB))
    fake_run(tmp_path, "b", "table17_concurrent", "ldadam", "llama_130m", 17.60, int(0.85 * GIB))
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    sections = {s.split("\n", 1)[0]: s for s in out.split("### ")[1:]}
    t9 = next(v for k, v in sections.items() if k.startswith("Table 9"))
    t17 = next(v for k, v in sections.items() if k.startswith("Table 17"))
    assert "60M state GiB estimate" in t9 and "350M state GiB estimate" in t9
    lines9 = {line.split(" | ")[0].lstrip("| "): line for line in t9.splitlines() if line.startswith("| ")}
    assert set(TABLE9) <= set(lines9)
    # AdaMeM at 60M: ours 23.90 vs 23.81, measured 0.28 GiB, estimate 0.28 (from the run's config)
    assert "| AdaMeM, rho=0.25 | 23.90 | 23.81 | +0.09 | 0.28 | 0.28 |" in lines9["AdaMeM, rho=0.25"]
    # a row no run fills: the paper's number and the estimate of its option (AdamW 60M: 0.43 GiB)
    assert "| AdamW |  | 22.73 |  |  | 0.43 |" in lines9["AdamW"]
    lines17 = {line.split(" | ")[0].lstrip("| "): line for line in t17.splitlines() if line.startswith("| ")}
    assert set(TABLE17) <= set(lines17)
    assert "| LDAdam, rho=0.25 | 17.60 | 17.54 | +0.06 | 0.85 | 0.85 |" in lines17["LDAdam, rho=0.25"]
    assert "| 1.10 |" in lines17["Fira, rho=0.25"]  # 350M, no run: Fira's estimate (= GaLore's + 1 float)
    assert SPECS["table17_concurrent"]["estimate"]["Fira, rho=0.25"] == "fira"


@pytest.mark.slow
def test_estimates_of_the_new_rows_match_the_design_table():
    """docs/concurrent_methods.md's whole-model numbers (fp32, density 0.25, Appendix D's layout; LDAdam
    at 350M is 2.2249 GiB)."""
    from scripts.memory_table import model_config, optimizer_config

    expected = {"fira": [0.30, 0.54, 1.10], "ldadam": [0.39, 0.85, 2.22], "adamem": [0.28, 0.49, 0.94]}
    for option, gib in expected.items():
        got = [make_tables.estimate_bytes(optimizer_config(option), model_config(m)) / GIB
               for m in ("llama_60m", "llama_130m", "llama_350m")]
        assert [round(x, 2) for x in got] == gib, option


# ---- mini_repro's optional rows ---------------------------------------------------------------
ASSET = Path(__file__).parent / "assets" / "tinyshakespeare_slice.txt"



def test_mini_repro_optional_rows_run_or_are_skipped_with_a_note(fake_train, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mini_repro, "missing_package", lambda key: "apollo-torch" if key == "apollo" else None)
    import scripts.plot_runs  # the stand-in runs leave no config to plot from: the plot is not under test here
    monkeypatch.setattr(scripts.plot_runs, "plot", lambda *a, **k: None)
    md = tmp_path / "report.md"
    args = ["--corpus", str(ASSET), "--workdir", str(tmp_path / "w"), "--vocab", "300", "--lr-grid", "3e-3",
            "--extras", "all", "--md", str(md), "--out", str(tmp_path / "r.json")]
    assert mini_repro.main(args) == 0
    options = [c["optimizer"] for c in fake_train]
    assert options[-6:] == ["fira", "ldadam", "adamem", "adam_mini", "muon", "frugal_muon"]  # apollo skipped
    by_option = {c["optimizer"]: c for c in fake_train}
    assert by_option["fira"]["optimizer.update_gap"] == "20" and by_option["adamem"]["optimizer.update_gap"] == "20"
    assert "optimizer.update_gap" not in by_option["ldadam"]  # a new basis every step, by definition
    report = md.read_text()
    assert "| APOLLO | skipped: the apollo-torch package is not installed (pip install apollo-torch) |" in report
    assert "| AdaMeM, rho=0.25 | 4.0000 |" in report and "23.81 (Table 9)" in report
    results = json.loads((tmp_path / "r.json").read_text())
    assert "apollo" not in results and {"fira", "ldadam", "adamem", "adam_mini", "muon", "frugal_muon"} <= set(results)
    with pytest.raises(SystemExit, match="unknown --extras \\['galore'\\]"):
        mini_repro.parse_extras("fira,galore")


@pytest.mark.parametrize("key", sorted(mini_repro.EXTRAS))
def test_mini_repro_optional_rows_compose_and_build(key, tmp_path):
    """Each optional row's train.py command line is a valid config whose optimizer builds on the
    mini model (the packages of apollo / adam_mini: skipped where not installed)."""
    import models

    if mini_repro.missing_package(key):
        pytest.skip(f"{mini_repro.missing_package(key)} not installed")
    ap = mini_repro.argparse.Namespace(hidden=32, intermediate=64, layers=2, heads=2, vocab=300, seq_len=16,
                                       corpus=ASSET, val_stride=20, steps=4, batch=2, evals=2, eval_tokens=64,
                                       seed=0, update_gap=2)
    opt, extra, _, _ = mini_repro.EXTRAS[key]
    overrides = mini_repro.overrides_for(opt, extra, 3e-3, ap, tmp_path, tmp_path / "run")
    cfg = _compose([o for o in overrides if not o.startswith("hydra.")])
    model = models.build_model(cfg.model)
    hp = OmegaConf.to_container(cfg.optimizer, resolve=True)
    optimizer = frugal.build_optimizer(model, hp.pop("name"), **hp)
    assert optimizer is not None and cfg.optimizer.lr == 3e-3


@pytest.fixture(scope="module")
def mini_tokenizer(tmp_path_factory):
    work = tmp_path_factory.mktemp("mini")
    return mini_repro.train_tokenizer(mini_repro.read_text(ASSET), work, 300)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["fira", "ldadam", "adamem"])
def test_mini_repro_new_rows_train_at_toy_size(key, mini_tokenizer, tmp_path):
    """The optional rows' own command line (local text, the corpus' tokenizer, packed rows) trains
    a few steps with the real loop, in process."""
    import train

    ap = mini_repro.argparse.Namespace(hidden=32, intermediate=64, layers=2, heads=2, vocab=300, seq_len=32,
                                       corpus=ASSET, val_stride=20, steps=3, batch=2, evals=1, eval_tokens=256,
                                       seed=0, update_gap=2)
    opt, extra, _, _ = mini_repro.EXTRAS[key]
    overrides = mini_repro.overrides_for(opt, extra, 3e-3, ap, mini_tokenizer, tmp_path)
    cfg = _compose([o for o in overrides if not o.startswith("hydra.")])
    assert not train.train(cfg, str(tmp_path))
    end = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["step"] == 3 and end["optimizer_state_bytes"] > 0
