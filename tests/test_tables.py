"""scripts/make_tables.py puts runs in the paper's cells; plot_runs.py draws them; memory estimates match.

The table-format checks use run directories fabricated here (metrics.jsonl + .hydra/ with known
numbers), so the expected cells are exact; two checks run the real train.py on a tiny model, one of them
a real multirun (docs/reproducing.md's rho x T sweep) whose every run must come back as its own row.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from pathlib import Path

import pytest
from _forkserver import run_python
from omegaconf import OmegaConf

from scripts import make_tables, plot_runs
from scripts.paper_tables import GIB


ROOT = Path(__file__).resolve().parent.parent


def fake_run(root: Path, name: str, table: str, model: str, optimizer: dict, ppl_by_step: dict,
             state_bytes: int = 0, finished: bool = True, schedule: str = "cosine_restarts",
             overrides: list | None = None, option: str | None = None) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    cfg = {"paper": {"table": table}, "model": {"name": model}, "optimizer": optimizer,
           "schedule": {"name": schedule}, "train": {"precision": "bf16-mixed"}}
    OmegaConf.save(OmegaConf.create(cfg), run / ".hydra" / "config.yaml")
    if overrides is not None:  # what Hydra writes beside it
        OmegaConf.save(OmegaConf.create(overrides), run / ".hydra" / "overrides.yaml")
        choices = {"model": model, "optimizer": option or optimizer["name"], "schedule": schedule}
        OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": choices}}}), run / ".hydra" / "hydra.yaml")
    rows = [{"event": "start", "step": 0, "optimizer_state_bytes": state_bytes}]
    for step, ppl in sorted(ppl_by_step.items()):
        rows.append({"step": step, "loss": 3.0, "lr": 1e-3, "tokens": step * 1000,
                     "optimizer_state_bytes": state_bytes})
        rows.append({"step": step, "val_loss": 3.0, "val_ppl": ppl, "val_tokens": 100})
    if finished:
        last = max(ppl_by_step)
        rows.append({"event": "end", "step": last, "val_loss": 3.0, "val_ppl": ppl_by_step[last],
                     "optimizer_state_bytes": state_bytes})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.fixture
def table2_runs(tmp_path):
    fake_run(tmp_path, "a", "table2", "llama_60m", {"name": "adamw"}, {200000: 23.00}, int(0.43 * GIB))
    fake_run(tmp_path, "b", "table2", "llama_60m", {"name": "frugal", "density": 0.25}, {200000: 23.50},
             int(0.29 * GIB))
    fake_run(tmp_path, "c", "table2", "llama_130m", {"name": "frugal", "density": 0.0}, {150000: 19.40},
             finished=False)
    return tmp_path


def test_table2_cells(table2_runs, capsys):
    assert make_tables.main([str(table2_runs)]) == 0
    out = capsys.readouterr().out
    assert "### Table 2" in out
    lines = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| ")}
    # 60M AdamW: ours 23.00, paper 22.73, diff +0.27, state 0.43 vs 0.43
    assert "| AdamW | 23.00 | 22.73 | +0.27 | 0.43 | 0.43 |" in lines["AdamW"]
    assert "| FRUGAL, rho=0.25 | 23.50 | 23.59 | -0.09 | 0.29 | 0.29 |" in lines["FRUGAL, rho=0.25"]
    # an unfinished run is marked with * and its step
    assert "19.40 @150000*" in lines["FRUGAL, rho=0.0"]
    # rows of the paper without a run keep the paper's number
    assert "25.68" in lines["GaLore, rho=0.25"]


def test_csv_long_format(table2_runs, capsys):
    make_tables.main([str(table2_runs), "--format", "csv"])
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    header, body = rows[0], rows[1:]
    rec = {(r[header.index("row")], r[header.index("column")]): r for r in body}
    r = rec[("AdamW", "60M")]
    assert float(r[header.index("ours")]) == 23.0 and float(r[header.index("paper")]) == 22.73
    assert abs(float(r[header.index("diff")]) - 0.27) < 1e-9


def test_step_columns_and_sweep_rows(tmp_path, capsys):
    """Table 1's "SVD, No" row is GaLore (its 200k value is Table 2's GaLore): a GaLore run fills it; a
    FRUGAL run without a state-free update (state reset, scale 1) is no row of the paper and says so."""
    fake_run(tmp_path, "svd", "table1_projection", "llama_130m",
             {"name": "galore", "projection": "svd", "state_free": "none"}, {4000: 40.0, 40000: 25.0, 200000: 21.0})
    fake_run(tmp_path, "frugal_svd", "table1_projection", "llama_130m",
             {"name": "frugal", "projection": "svd", "state_free": "none"}, {4000: 41.0, 40000: 26.0, 200000: 22.0})
    for t, ppl in [(10, 18.9), (200, 18.5)]:
        fake_run(tmp_path, f"T{t}", "table15_update_gap", "llama_130m",
                 {"name": "frugal", "density": 0.25, "update_gap": t}, {200000: ppl})
    make_tables.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert ("| SVD, no state-free (GaLore) | 40.00 | 39.75 | +0.25 | 25.00 | 24.38 | +0.62 "
            "| 21.00 | 21.11 | -0.11 |") in out
    assert "| SVD, no state-free (FRUGAL): not a row of the paper | 41.00 |  |  | 26.00 |  |  | 22.00 |  |  |" in out
    assert "| T=10 | 18.90 | 18.82 | +0.08 |" in out
    assert "| T=200 | 18.50 | 18.60 | -0.10 |" in out


def test_plot_runs(table2_runs, tmp_path):
    out = tmp_path / "p.png"
    assert plot_runs.main([str(table2_runs), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000


@pytest.mark.slow
def test_memory_estimate_is_the_papers_column():
    from scripts import memory_table

    ok = memory_table.main(["--measure-max-params", "0"])
    assert ok == 0


@pytest.mark.slow
def test_real_tiny_runs(tmp_path, capsys):
    """Two real 3-step runs of train.py land in the Table 2 cells of llama_tiny, state measured."""
    import train
    from hydra import compose, initialize_config_dir

    configs = Path(__file__).resolve().parent.parent / "configs"
    for opt in ("adamw", "frugal"):
        with initialize_config_dir(config_dir=str(configs), version_base=None):
            cfg = compose("config", overrides=[
                "experiment=table2", f"optimizer={opt}", "model=llama_tiny", "data=synthetic",
                "train.steps=3", "train.batch_size=2", "train.micro_batch_size=2", "train.eval_every=0",
                "train.eval_tokens=64", "data.seq_len=32", "checkpoint.every=0", "train.plot=false",
                "train.progress_bar=false", "wandb.mode=disabled"])
        run = tmp_path / opt
        run.mkdir()
        (run / ".hydra").mkdir()
        OmegaConf.save(cfg, run / ".hydra" / "config.yaml")  # what Hydra writes for a real run
        assert not train.train(cfg, str(run))
    capsys.readouterr()  # drop train.py's own summary lines
    make_tables.main([str(tmp_path), "--format", "csv"])
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    header = rows[0]
    got = {r[header.index("row")]: r for r in rows[1:] if r[header.index("column")] == "llama_tiny"}
    assert set(got) == {"AdamW", "FRUGAL, rho=0.25"}
    for r in got.values():
        assert float(r[header.index("ours")]) > 1 and r[header.index("step")] == "3"
    assert float(got["FRUGAL, rho=0.25"][header.index("state_gib")]) < float(got["AdamW"][header.index("state_gib")])


def _csv(capsys, *args) -> list[dict]:
    capsys.readouterr()
    assert make_tables.main([*map(str, args), "--format", "csv"]) == 0
    return list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


def test_sweep_keeps_every_run_with_its_swept_values(tmp_path, capsys):
    """A rho x T sweep: four runs, four records; T (swept) is a column and tells the rows apart."""
    for rho, t, ppl in [(0.125, 100, 24.1), (0.125, 200, 24.0), (0.25, 100, 23.7), (0.25, 200, 23.6)]:
        fake_run(tmp_path, f"{rho}-{t}", "table2", "llama_60m", {"name": "frugal", "density": rho, "update_gap": t},
                 {200000: ppl}, overrides=["experiment=table2", "model=llama_60m", f"optimizer.density={rho}",
                                           f"optimizer.update_gap={t}"])
    rows = _csv(capsys, tmp_path)
    ours = [r for r in rows if r["ours"]]
    assert len(ours) == 4 and {r["run"] for r in ours} == {str(tmp_path / d) for d in
                                                           ("0.125-100", "0.125-200", "0.25-100", "0.25-200")}
    got = {(r["optimizer.density"], r["optimizer.update_gap"]): r for r in ours}
    assert float(got[("0.25", "200")]["ours"]) == 23.6 and float(got[("0.125", "100")]["ours"]) == 24.1
    assert got[("0.25", "200")]["row"] == "FRUGAL, rho=0.25, update_gap=200"
    assert got[("0.25", "200")]["paper"] == "23.59" and got[("0.25", "200")]["option"] == "frugal"
    assert "model=" not in got[("0.25", "200")]["row"]  # the model did not vary: not part of the label
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| FRUGAL, rho=0.25, update_gap=100 | 23.70 | 23.59 | +0.11 |" in out
    assert "| FRUGAL, rho=0.125, update_gap=200 | 24.00 |" in out


def test_options_with_the_same_method_are_told_apart(tmp_path, capsys):
    fake_run(tmp_path, "a", "table2", "llama_60m", {"name": "galore", "density": 0.25}, {200000: 25.0},
             overrides=["optimizer=galore"], option="galore")
    fake_run(tmp_path, "b", "table2", "llama_60m", {"name": "galore", "density": 0.25, "lr": 0.01}, {200000: 26.0},
             overrides=["optimizer=galore_original"], option="galore_original")
    rows = {r["option"]: r for r in _csv(capsys, tmp_path) if r["ours"]}
    assert rows["galore"]["row"] == "GaLore, rho=0.25, optimizer=galore"
    assert rows["galore_original"]["row"] == "GaLore, rho=0.25, optimizer=galore_original"


def test_a_run_of_another_model_is_flagged(tmp_path, capsys):
    fake_run(tmp_path, "tiny", "table15_update_gap", "llama_tiny",
             {"name": "frugal", "density": 0.25, "update_gap": 200}, {200000: 30.0})
    (row,) = [r for r in _csv(capsys, tmp_path) if r["ours"]]
    assert row["model_differs"] == "True" and row["table_model"] == "llama_130m" and row["diff"] == ""
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| T=200 | 30.00 [llama_tiny] | 18.60 |  |" in out
    assert "[model]: trained llama_tiny, not the table's llama_130m" in out


def test_a_run_without_an_evaluation_yet_is_listed(tmp_path, capsys):
    """A run that has not evaluated yet (just started, or stopped before its first evaluation) is a
    row saying so, not a silent gap."""
    fake_run(tmp_path, "done", "table2", "llama_60m", {"name": "adamw"}, {200000: 23.00})
    fake_run(tmp_path, "new", "table2", "llama_60m", {"name": "frugal", "density": 0.25}, {}, finished=False)
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| FRUGAL, rho=0.25 | no eval yet | 23.59 |  |" in out
    rows = [r for r in _csv(capsys, tmp_path) if r["run"].endswith("new")]
    assert len(rows) == 1 and rows[0]["ours"] == "" and rows[0]["column"] == "60M"


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory):
    """docs/reproducing.md's rho x T example as a real multirun at toy scale: 4 jobs of train.py."""
    sweep = tmp_path_factory.mktemp("sweep") / "t2"
    cmd = [sys.executable, "train.py", "-m", "experiment=table2", "model=llama_tiny", "optimizer=frugal",
           "optimizer.density=0.125,0.25", "optimizer.update_gap=100,200", f"hydra.sweep.dir={sweep}",
           "data=synthetic", "data.seq_len=32", "train.steps=2", "train.batch_size=2", "train.micro_batch_size=2",
           "train.eval_every=0", "train.eval_tokens=64", "checkpoint.every=0", "train.plot=false",
           "train.progress_bar=false", "wandb.mode=disabled"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = run_python(cmd, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


@pytest.mark.slow
def test_real_sweep_table_and_names(real_sweep, capsys):
    from train_utils import naming

    rows = [r for r in _csv(capsys, real_sweep) if r["ours"]]
    assert len(rows) == 4, rows
    assert {(r["optimizer.density"], r["optimizer.update_gap"]) for r in rows} == \
        {("0.125", "100"), ("0.125", "200"), ("0.25", "100"), ("0.25", "200")}
    assert len({r["row"] for r in rows}) == 4 and all(r["option"] == "frugal" for r in rows)
    names, groups = set(), set()
    for job in sorted(p for p in real_sweep.iterdir() if p.is_dir()):
        cfg = OmegaConf.load(job / ".hydra" / "config.yaml")
        hydra_cfg = OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra
        names.add(naming.run_name(cfg, str(job), hydra_cfg))
        groups.add(naming.run_group(cfg, hydra_cfg))
    assert names == {f"llama_tiny-frugal-density={d}-update_gap={t}" for d in ("0.125", "0.25") for t in (100, 200)}
    assert groups == {"table2-t2"}


@pytest.mark.slow
def test_real_sweep_plot_labels(real_sweep):
    runs = [make_tables.load_run(d) for d in make_tables.find_runs([str(real_sweep)])]
    swept = make_tables.swept_keys(runs)
    labels = {plot_runs.label(r, swept, with_model=False) for r in runs}
    assert labels == {f"density={d} update_gap={t}" for d in ("0.125", "0.25") for t in (100, 200)}


@pytest.mark.slow
def test_real_sweep_pivot(real_sweep, capsys):
    """The sweep view of real runs: each cell is its one run's end-row perplexity, each row the density
    the run's start row says the optimizer realised."""
    capsys.readouterr()
    assert make_tables.main([str(real_sweep), "--pivot", "optimizer.density", "optimizer.update_gap",
                             "--format", "csv"]) == 0
    cells = {r["runs"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert len(cells) == 4
    for job in (p for p in real_sweep.iterdir() if (p / "metrics.jsonl").is_file()):
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        start, end = rows[0], rows[-1]
        gap = OmegaConf.load(job / ".hydra" / "config.yaml").optimizer.update_gap
        cell = cells[str(job)]
        assert start["event"] == "start" and end["event"] == "end"
        assert float(cell["mean_ppl"]) == end["val_ppl"] and cell["n"] == "1"
        assert cell["col"] == f"{gap} (no switch)"  # 2 steps: neither gap changes the subspace
        assert float(cell["row_value"]) == start["density_realised"]
        assert cell["row"].startswith(f"{round(start['density_realised'], 4):g}")
    # ... so T=100 and T=200 are one run: the same numbers, and a note under the grid says so
    for row in {c["row"] for c in cells.values()}:
        assert len({c["mean_ppl"] for c in cells.values() if c["row"] == row}) == 1
    assert make_tables.main([str(real_sweep), "--pivot", "optimizer.density", "optimizer.update_gap"]) == 0
    assert capsys.readouterr().out.count("hold one run repeated") == 2


# ---- every row the paper prints is in its preset's multirun, and lands in that row ---------------
def _preset_sweep(preset):
    """One override list per value of each axis of the preset's multirun (as tests/test_experiments.py)."""
    from _train_helpers import compose_once
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.to_container(compose_once(f"experiment={preset}", hydra_cfg=True).hydra.sweeper.params) or {}
    parser = OverridesParser.create()
    return [[f"{k}={v}"] for k, values in params.items()
            for v in parser.parse_override(f"{k}={values}").sweep_string_iterator()]


def preset_run(root: Path, name: str, preset: str, overrides: list[str], ppl: float, state_bytes: int = 1) -> Path:
    """A finished run of one cell of a preset: the config Hydra would save, a start row with the
    density report the optimizer gives on the preset's model (built on the meta device), an end row."""
    import torch
    from _train_helpers import compose_once

    import frugal
    import models

    cfg = compose_once(f"experiment={preset}", *overrides)  # once per session: tests/test_experiments.py's too
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), run / ".hydra" / "overrides.yaml")
    opt = OmegaConf.to_container(cfg.optimizer, resolve=True)
    with torch.device("meta"):
        model = models.build_model(cfg.model)
    start = {"event": "start", "step": 0, "params": sum(p.numel() for p in model.parameters())}
    if opt["name"] not in ("adamw", "apollo", "adam_mini"):
        optimizer = frugal.build_optimizer(model, **opt)
        start.update({f"density_{k}": v for k, v in optimizer.density_report().items()})
    steps = int(cfg.train.steps)
    rows = [start, *({"step": s, "val_loss": 3.0, "val_ppl": ppl, "val_tokens": 100, "val_mode": "tokens"}
                     for s in (4000, 40000, 100000, 200000) if s < steps),
            {"event": "end", "step": steps, "val_loss": 3.0, "val_ppl": ppl, "optimizer_state_bytes": state_bytes}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


# Paper rows that no preset can run: Table 3's 175M model (its shape is not published).
NOT_RUNNABLE = {"table3_precision": {"175M Mixed Precision"}}
ROW_PRESETS = ["table1_projection", "table3_precision", "table10_pure_bf16", "table11_state_free_rule", "table12_lion",
               "table13_gpt2",
               "table14_block_order", "table15_update_gap", "table16_density", "table2", "table4_state_free_modules",
               "table5_3b", "table8_beta2", "table9_adamem", "table17_concurrent", "tables6_7_schedules"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ROW_PRESETS)
def test_every_paper_row_is_in_the_presets_multirun(preset, tmp_path, capsys):
    from scripts.paper_tables import SPECS

    runs = [preset_run(tmp_path, f"r{i}", preset, o, 20.0 + i) for i, o in enumerate(_preset_sweep(preset))]
    rows = [r for r in _csv(capsys, tmp_path) if r["ours"]]
    assert len({r["run"] for r in rows}) == len(runs)
    filed = {r["method"] for r in rows}
    paper = set(SPECS[preset]["paper"]) - NOT_RUNNABLE.get(preset, set())
    assert paper <= filed, f"paper rows without a run: {sorted(paper - filed)}"
    assert not [r["row"] for r in rows if r["method"] not in SPECS[preset]["paper"]], "runs outside the paper's rows"
    # a run's cell carries the paper's number of its row
    assert all(r["paper"] for r in rows if r["column"] != "final" and r["model_differs"] != "True"
               and not r["column"].endswith("final"))


def test_table16_rows_print_the_realised_density(tmp_path, capsys):
    """rho = 1/16 and 1/8 are 5 and 10 of LLaMA-130M's 84 tensors (the authors' selection): their rows
    print that realised density; the same rho with whole layers is filed under what it realised."""
    preset_run(tmp_path, "a", "table16_density", ["setup/table16=rho_0.0625"], 18.9)
    preset_run(tmp_path, "b", "table16_density", ["setup/table16=rho_0.125"], 18.8)
    preset_run(tmp_path, "c", "table16_density", ["setup/table16=rho_0.0625", "setup/algorithm=library"], 18.7)
    rows = {Path(r["run"]).name: r for r in _csv(capsys, tmp_path) if r["ours"]}
    assert rows["a"]["row"] == "0.0625" and float(rows["a"]["density_realised"]) == pytest.approx(5 / 84)
    assert rows["b"]["row"] == "0.125" and float(rows["b"]["density_realised"]) == pytest.approx(10 / 84)
    assert rows["a"]["paper"] == "18.8" and rows["a"]["eval_mode"] == "tokens"
    # whole layers: 1/16 of 12 layers is 1 layer, 1/12 of the weights: not the paper's 0.0625 row
    assert rows["c"]["row"] == "0.0833 (asked 0.0625)" and rows["c"]["paper"] == "" and rows["c"]["diff"] == ""
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 0.0625 | 18.90 | 18.80 | +0.10 | 0.05952 (5/84) | tokens |" in out
    assert "| 0.125 | 18.80 | 18.71 | +0.09 | 0.119 (10/84) | tokens |" in out


def test_table3_prints_read_out_point_and_memory(tmp_path, capsys):
    """Table 3's 350M cell is read at 100k steps, mid-way through the second 60k-step cycle: the
    learning rate there is 0.37x the peak (the table says so); its memory column is the paper's 4.2 GB
    beside ours, fp32 weights + AdamW's 8 bytes per parameter of optimizer state."""
    params = 367_970_304  # LLaMA-350M
    preset_run(tmp_path, "m", "table3_precision", ["setup/table3=mixed_350m"], 15.5, state_bytes=8 * params)
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "175M model's shape is not published" in out
    (line,) = [x for x in out.splitlines() if x.startswith("| 350M Mixed Precision")]
    assert line.endswith(f"| 0.37 (step 100000) | {12 * params / 1e9:.1f} | 4.2 |"), line
    (paper_only,) = [x for x in out.splitlines() if x.startswith("| 175M Mixed Precision")]
    assert paper_only.endswith("|  |  | 2.0 |") and "17.43" in paper_only


def test_each_number_says_which_evaluation_produced_it(tmp_path, capsys):
    fake_run(tmp_path, "a", "table2", "llama_60m", {"name": "adamw"}, {200000: 23.00})
    run = fake_run(tmp_path, "b", "table2", "llama_60m", {"name": "frugal", "density": 0.25}, {200000: 23.5})
    text = (run / "metrics.jsonl").read_text().replace('"val_tokens": 100}',
                                                       '"val_tokens": 100, "val_mode": "authors"}')
    (run / "metrics.jsonl").write_text(text)
    rows = {Path(r["run"]).name: r for r in _csv(capsys, tmp_path) if r["ours"]}
    assert rows["a"]["eval_mode"] == "tokens" and rows["b"]["eval_mode"] == "authors"
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("| FRUGAL, rho=0.25 |")]
    assert line.startswith("| FRUGAL, rho=0.25 | 23.50 | 23.59 | -0.09 |") and line.endswith("| authors |")
