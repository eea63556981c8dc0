"""The sweep view of scripts/make_tables.py (--pivot ROW_KEY COL_KEY [--plot]), plot_runs.py's legend of
swept values, and make_tables' toy (debug=toy) tables without the paper's numbers.

The run directories are fabricated in train.py's format (`.hydra/config.yaml`, `overrides.yaml`,
`hydra.yaml`'s runtime choices; metrics.jsonl with a start row carrying the optimizer's density report,
training rows, an evaluation row and an end row), with known perplexities: every number the tables print
is checked against the mean, min and max computed here from those raw numbers.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from scripts import make_tables, plot_runs

TENSORS = 28  # weight tensors of the 4-layer toy LLaMA: the authors' blocks are round(rho x 28) of them


def write_run(root: Path, name: str, overrides: list[str], *, ppl: float | None, table: str | None = "table2",
              model: str = "llama_60m", optimizer: dict | None = None, seed: int = 0, debug: str | None = None,
              finished: bool = True, steps: int = 2000, schedule: dict | None = None) -> Path:
    """A run directory as train.py leaves it; `ppl` None: a run that has not evaluated yet."""
    opt = {"name": "frugal", "density": 0.25, "update_gap": 200, "lr": 1e-3, "block_granularity": "tensor",
           "seed": "${train.seed}"} if (optimizer or {}).get("name", "frugal") == "frugal" else {"lr": 1e-3}
    opt.update(optimizer or {})
    cfg = {"model": {"name": model, "family": "llama", "hidden_size": 128, "num_hidden_layers": 4},
           "optimizer": opt, "schedule": schedule or {"name": "cosine_restarts", "cycle_length": 10000},
           "train": {"steps": steps, "seed": seed, "precision": "bf16-mixed"}, "paper": {"table": table},
           "wandb": {"name": None}}
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(cfg), run / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), run / ".hydra" / "overrides.yaml")
    choices = {"model": model, "optimizer": opt["name"], "debug": debug}
    OmegaConf.save(OmegaConf.create({"hydra": {"runtime": {"choices": choices}}}), run / ".hydra" / "hydra.yaml")
    start = {"event": "start", "step": 0, "params": 935040, "optimizer": opt["name"], "model": model, "debug": debug}
    if opt["name"] != "adamw":
        k = round(float(opt["density"]) * TENSORS)
        start.update(density_requested=float(opt["density"]), density_realised=k / TENSORS, density_blocks=[k, TENSORS])
    rows = [start, {"step": 1, "loss": 6.2, "lr": 1e-3, "tokens": 1024, "optimizer_state_bytes": 4096}]
    last = steps if finished else steps // 2
    if ppl is not None:
        rows.append({"step": last, "val_loss": math.log(ppl), "val_ppl": ppl, "val_tokens": 100, "val_mode": "tokens"})
    if finished:
        rows.append({"event": "end", "step": steps, "val_loss": math.log(ppl), "val_ppl": ppl,
                     "optimizer_state_bytes": 4096})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def sweep_run(root: Path, density: float, gap: int, seed: int, ppl: float | None, **kw) -> Path:
    """One job of `-m optimizer.density=... optimizer.update_gap=... train.seed=...` under debug=toy."""
    overrides = ["experiment=table2", "model=llama_60m", "optimizer=frugal", f"++optimizer.density={density}",
                 f"optimizer.update_gap={gap}", f"train.seed={seed}", "debug=toy", *kw.pop("extra", [])]
    opt = {"density": density, "update_gap": gap, **kw.pop("optimizer", {})}
    return write_run(root, f"d{density}-T{gap}-s{seed}-{len(list(root.iterdir()))}", overrides, ppl=ppl,
                     optimizer=opt, seed=seed, debug="toy", **kw)


# perplexities of a rho x T x seed sweep; (0.25, 1000) has one seed, (0.125, 1000) no run at all
PPL = {(0.125, 50): [30.1, 30.9, 29.8], (0.125, 200): [28.4, 28.0, 28.9],
       (0.25, 50): [27.2, 27.0, 27.9], (0.25, 200): [26.5, 26.1, 26.6], (0.25, 1000): [25.7]}


@pytest.fixture
def sweep(tmp_path):
    for (density, gap), values in PPL.items():
        for seed, ppl in enumerate(values):
            sweep_run(tmp_path, density, gap, seed, ppl)
    return tmp_path


def pivot_csv(capsys, *args) -> list[dict]:
    capsys.readouterr()
    assert make_tables.main([*map(str, args), "--format", "csv"]) == 0
    return list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


ROW_0125 = "0.1429 (4/28; asked 0.125)"  # round(0.125 x 28) = 4 tensors: what the optimizer realised
ROW_025 = "0.25 (7/28)"


def test_pivot_cells_are_mean_min_max_n_of_the_runs(sweep, capsys):
    rows = pivot_csv(capsys, sweep, "--pivot", "optimizer.density", "optimizer.update_gap")
    got = {(float(r["row_value"]), int(float(r["col_value"]))): r for r in rows}
    realised = {0.125: 4 / TENSORS, 0.25: 7 / TENSORS}
    assert set(got) == {(realised[d], t) for d, t in PPL}  # one line per cell with runs, none for the empty one
    for (density, gap), values in PPL.items():
        r = got[(realised[density], gap)]
        assert float(r["mean_ppl"]) == pytest.approx(sum(values) / len(values), rel=1e-12)
        assert float(r["min_ppl"]) == min(values) and float(r["max_ppl"]) == max(values)
        assert int(r["n"]) == len(values) == len(r["runs"].split())
        assert r["row"] == {0.125: ROW_0125, 0.25: ROW_025}[density] and r["col"] == str(gap)
        assert r["row_key"] == "optimizer.density" and r["col_key"] == "optimizer.update_gap"

    assert make_tables.main([str(sweep), "--pivot", "optimizer.density", "optimizer.update_gap"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    # columns in numeric order (1000 after 200), rows by realised density
    assert table[0] == "| density \\ update_gap | 50 | 200 | 1000 |"
    m = sum(PPL[(0.125, 50)]) / 3
    assert table[1] == f"| {ROW_0125} | {m:.2f} (29.80-30.90, n=3) | 28.43 (28.00-28.90, n=3) |  |"
    assert table[2].endswith("| 25.70 (n=1) |")
    assert ("rows (optimizer.density): what the runs realised (the start row's density_realised (k/L: state-full "
            "blocks)); the value asked after 'asked' where it differs") in out
    assert "toy runs (debug=toy)" in out
    assert "also differ in" not in out  # the cells' runs differ only in the seed


def test_realised_value_groups_requests_and_keys_by_their_last_part(tmp_path, capsys):
    """0.125 and 0.13 both realise 4 of 28 tensors: one row, which names both requests, n counts both;
    `--pivot density seed` finds the swept keys optimizer.density and train.seed."""
    sweep_run(tmp_path, 0.125, 200, 0, 28.0)
    sweep_run(tmp_path, 0.13, 200, 0, 29.0)
    sweep_run(tmp_path, 0.125, 200, 1, 27.5)
    (a, b) = pivot_csv(capsys, tmp_path, "--pivot", "density", "seed")
    assert a["row"] == b["row"] == "0.1429 (4/28; asked 0.125, 0.13)" and a["row_key"] == "optimizer.density"
    assert (a["col"], a["n"], float(a["mean_ppl"])) == ("0", "2", pytest.approx((28.0 + 29.0) / 2))
    assert (b["col"], b["n"], float(b["mean_ppl"])) == ("1", "1", 27.5)


def test_other_keys_that_differ_in_a_cell_are_named(tmp_path, capsys):
    for seed, lr in enumerate((1e-3, 3e-3)):
        sweep_run(tmp_path, 0.25, 200, seed, 26.0 + seed, optimizer={"lr": lr}, extra=[f"optimizer.lr={lr}"])
    sweep_run(tmp_path, 0.25, 50, 0, 27.0, optimizer={"lr": 1e-3}, extra=["optimizer.lr=0.001"])
    assert make_tables.main([str(tmp_path), "--pivot", "optimizer.density", "optimizer.update_gap"]) == 0
    out = capsys.readouterr().out
    assert "| 0.25 (7/28) | 27.00 (n=1) | 26.50 (26.00-27.00, n=2) |" in out  # averaged and counted, not hidden
    (note,) = [line for line in out.splitlines() if "also differ in" in line]
    assert note == ("note: 1 of 2 cells average runs that also differ in optimizer.lr (0.001, 0.003), not only in "
                    "the seed: pivot on it, or give the runs of one value")


def test_unfinished_and_unevaluated_runs_are_counted_apart(tmp_path, capsys):
    sweep_run(tmp_path, 0.25, 200, 0, 26.0)
    sweep_run(tmp_path, 0.25, 200, 1, 27.0, finished=False)  # stopped at step 1000: its last evaluation
    sweep_run(tmp_path, 0.25, 200, 2, None, finished=False)
    assert make_tables.main([str(tmp_path), "--pivot", "optimizer.density", "train.seed"]) == 0
    out = capsys.readouterr().out
    assert "| 0.25 (7/28) | 26.00 (n=1) | 27.00 (n=1)* | 1 no eval yet |" in out
    assert "*: the cell includes runs that have not finished" in out
    assert "final evaluations are at different steps (1000, 2000)" in out


def test_a_key_no_run_has_is_a_one_line_error(sweep, capsys):
    capsys.readouterr()
    assert make_tables.main([str(sweep), "--pivot", "optimizer.densty", "optimizer.update_gap"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err == ("make_tables: --pivot: no run has the key 'optimizer.densty'; the runs differ in: "
                   "optimizer.density, optimizer.update_gap, train.seed\n")
    assert make_tables.main([str(sweep), "--plot", "x.png"]) == 2  # --plot draws the pivot only


def test_plot_is_a_heatmap_with_every_cell_annotated(sweep, tmp_path, capsys):
    runs = [make_tables.load_run(d) for d in make_tables.find_runs([str(sweep)])]
    grid = make_tables.pivot(runs, "optimizer.density", "optimizer.update_gap")
    fig = make_tables.pivot_figure(grid)
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (2, 3)
    assert ax.images[0].get_array().mask.sum() == 1  # (0.125, 1000): no run, drawn grey
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == len(PPL)
    m = sum(PPL[(0.25, 200)]) / 3
    assert f"{m:.2f}\n26.10-26.60\nn=3" in texts and "25.70\nn=1" in texts
    assert "optimizer.density x optimizer.update_gap" in fig.get_suptitle()
    png = tmp_path / "out" / "grid.png"
    assert make_tables.main([str(sweep), "--pivot", "optimizer.density", "optimizer.update_gap", "--plot",
                             str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# ---- train_utils.results.load_runs: the records every program reads ---------------------------------
def test_load_runs_gives_each_run_its_sweep_values_config_density_evaluation_and_state(tmp_path):
    from train_utils.results import load_runs

    sweep_run(tmp_path, 0.25, 200, 0, 26.5)
    sweep_run(tmp_path, 0.125, 50, 1, 30.0, finished=False)  # stopped halfway: its last evaluation counts
    sweep_run(tmp_path, 0.125, 200, 2, None, finished=False)  # no evaluation yet
    runs = load_runs([str(tmp_path)])
    done, half, fresh = sorted(runs, key=lambda r: r["swept"]["train.seed"])  # typed: 0, 1, 2
    assert done["swept"] == {"optimizer.density": 0.25, "optimizer.update_gap": 200, "train.seed": 0}
    assert half["swept"] == {"optimizer.density": 0.125, "optimizer.update_gap": 50, "train.seed": 1}
    assert done["config"]["optimizer"]["seed"] == 0 and half["config"]["optimizer"]["seed"] == 1  # resolved
    assert half["cfg"]["optimizer"]["seed"] == "${train.seed}"  # as saved
    assert (done["density_realised"], done["density_blocks"]) == (7 / 28, (7, 28))
    assert (half["density_realised"], half["density_blocks"]) == (4 / 28, (4, 28))  # 0.125 x 28 tensors -> 4
    assert (done["final_ppl"], done["final_step"], done["finished"]) == (26.5, 2000, True)
    assert done["final_loss"] == pytest.approx(math.log(26.5))
    assert (half["final_ppl"], half["final_step"], half["finished"]) == (30.0, 1000, False)
    assert fresh["final_ppl"] is fresh["final_loss"] is fresh["final_step"] is None and not fresh["finished"]
    assert done["state_bytes"] == half["state_bytes"] == 4096 and done["debug"] == "toy"
    assert load_runs([str(tmp_path / "nowhere")]) == []


# ---- plot_runs.py: a legend of the swept values ---------------------------------------------------
def test_plot_runs_legend_is_the_swept_values(tmp_path):
    for density, gap, seed in [(0.25, 200, 0), (0.25, 200, 1), (0.125, 100, 1)]:
        sweep_run(tmp_path, density, gap, seed, 26.0)
    write_run(tmp_path, "z-adamw", ["experiment=table2", "optimizer=adamw", "train.seed=0", "debug=toy"], ppl=24.0,
              optimizer={"name": "adamw"}, debug="toy")
    dirs = make_tables.find_runs([str(tmp_path)])
    runs = [make_tables.load_run(d) for d in dirs]
    # the keys in the order the sweep's command line gives them; AdamW has no density nor update gap
    want = {"d0.25-T200-s0-0": "optimizer=frugal density=0.25 update_gap=200 seed=0",
            "d0.25-T200-s1-1": "optimizer=frugal density=0.25 update_gap=200 seed=1",
            "d0.125-T100-s1-2": "optimizer=frugal density=0.125 update_gap=100 seed=1",
            "z-adamw": "optimizer=adamw seed=0"}
    assert dict(zip((Path(d).name for d in dirs), plot_runs.labels(runs))) == want
    fig = plot_runs.figure(dirs)
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert sorted(legend) == sorted(want.values())
        assert fig.get_suptitle() == "llama_60m, debug=toy"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_plot_runs_labels_runs_without_swept_keys_apart(tmp_path):
    """Runs launched one by one (no override differs): method, rho and T; twins get their directory."""
    for name in ("a", "b"):
        write_run(tmp_path / name, "run", [], ppl=26.0)
    runs = [make_tables.load_run(d) for d in make_tables.find_runs([str(tmp_path)])]
    assert plot_runs.labels(runs) == ["FRUGAL, rho=0.25, T=200 (a/run)", "FRUGAL, rho=0.25, T=200 (b/run)"]


# ---- toy tables: no paper numbers beside debug=toy runs ---------------------------------------------
def test_toy_table_has_no_paper_column(tmp_path, capsys):
    write_run(tmp_path, "adamw", ["experiment=table2", "optimizer=adamw", "debug=toy"], ppl=480.0,
              optimizer={"name": "adamw"}, debug="toy")
    write_run(tmp_path, "frugal", ["experiment=table2", "optimizer=frugal", "debug=toy"], ppl=505.5, debug="toy")
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (head,) = [line for line in out.splitlines() if line.startswith("| method")]
    assert "paper" not in head and "diff" not in head
    assert head == "| method | 60M ours | 60M state GiB ours | realised rho | eval |"
    assert "| AdamW | 480.00 |" in out and "| FRUGAL, rho=0.25 | 505.50 |" in out
    assert "GaLore" not in out  # the paper's rows without a run are not printed beside toy runs
    (note,) = [line for line in out.splitlines() if line.startswith("toy runs")]
    assert note == ("toy runs (debug=toy): shrunk models and budgets; the paper's numbers are not comparable, so "
                    "no paper or difference column is printed.")
    rows = pivot_csv(capsys, tmp_path)  # the plain --format csv: no paper number, no difference
    assert len(rows) == 2 and all(r["paper"] == r["diff"] == "" and r["debug"] == "toy" for r in rows)


@pytest.mark.parametrize("source", ["choices", "start", "overrides"])
def test_a_toy_run_is_recognised_from_any_record(source):
    """hydra.yaml's choice, the start row's `debug`, or the command line's override each say it."""
    choices, overrides, start = {"debug": None}, {}, {"debug": None}
    {"choices": choices, "start": start, "overrides": overrides}[source]["debug"] = "toy"
    assert make_tables.debug_of(choices, overrides, start) == "toy"
    assert make_tables.debug_of({"debug": None}, {}, {}) is None


def test_a_toy_run_beside_real_runs_gets_no_difference(tmp_path, capsys):
    write_run(tmp_path, "real", ["experiment=table2", "optimizer=adamw"], ppl=23.0, optimizer={"name": "adamw"},
              steps=200000)
    write_run(tmp_path, "toy", ["experiment=table2", "optimizer=frugal", "debug=toy"], ppl=505.5, debug="toy")
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| AdamW | 23.00 | 22.73 | +0.27 |" in out  # the real run: the paper's number and the difference
    assert "| FRUGAL, rho=0.25 | 505.50 [debug=toy] |  |  |" in out
    assert "[debug=toy]: a toy run; the paper's number is not comparable" in out


def test_cells_that_are_one_toy_run_repeated_are_marked(tmp_path, capsys):
    """debug=toy shrinks llama_60m and llama_130m to one shape: with the same schedule their runs are one
    run under two names ([same 1]); a run whose schedule differs is not, but the note on the shared
    model shape still says the columns compare no model sizes."""
    for model in ("llama_60m", "llama_130m"):
        write_run(tmp_path, model, ["experiment=table2", f"model={model}", "debug=toy"], ppl=505.5, model=model,
                  debug="toy")
    write_run(tmp_path, "llama_350m", ["experiment=table2", "model=llama_350m", "debug=toy"], ppl=505.9,
              model="llama_350m", debug="toy", schedule={"name": "cosine_restarts", "cycle_length": 60000})
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 505.50 [same 1] |" in out and out.count("[same 1]") == 3  # two cells and the note
    assert "505.90 [same" not in out
    assert ("[same 1]: FRUGAL, rho=0.25 @ 60M, FRUGAL, rho=0.25 @ 130M are one run repeated (identical configs "
            "apart from names, once what the optimizer realised replaces what was asked: its density; no switch for "
            "an update gap >= train.steps).") in out
    assert ("debug trains llama_130m, llama_350m, llama_60m as one model (4 layers x 128, 935,040 parameters): "
            "their columns are no comparison of model sizes.") in out


def test_update_gaps_a_toy_run_never_reaches_are_one_run(tmp_path, capsys):
    """A constant update gap of at least train.steps never switches the subspace: Table 15's T=200 and
    T=500 in a 200-step run are one run ([same 1] in the table, a note under the grid); T=100 is not."""
    for gap in (100, 200, 500):
        write_run(tmp_path, f"T{gap}", ["experiment=table15_update_gap", f"optimizer.update_gap={gap}", "debug=toy"],
                  ppl=500.0 + gap / 100, table="table15_update_gap", model="llama_130m",
                  optimizer={"update_gap": gap}, debug="toy", steps=200)
    assert make_tables.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| T=100 | 501.00 |" in out and "| T=200 | 502.00 [same 1] |" in out and "| T=500 | 505.00 [same 1] |" in out
    assert make_tables.main([str(tmp_path), "--pivot", "optimizer.density", "optimizer.update_gap"]) == 0
    out = capsys.readouterr().out
    assert "| density \\ update_gap | 100 | 200 (no switch) | 500 (no switch) |" in out
    assert ("note: cells 0.25 (7/28) / 200 (no switch); 0.25 (7/28) / 500 (no switch) hold one run repeated "
            "(identical configs apart from names, once realised)") in out


def test_a_value_the_run_trained_with_instead_of_the_request_says_both(tmp_path, capsys):
    """debug=toy writes the update gap its run trains with into the saved config; the command line's
    request stays in overrides.yaml: the grid and the legend show the first and name the second."""
    for asked, toy in ((10, 1), (1000, 91)):
        run = sweep_run(tmp_path, 0.25, asked, 0, 500.0 + toy)
        conf = OmegaConf.load(run / ".hydra" / "config.yaml")
        conf.optimizer.update_gap = toy
        OmegaConf.save(conf, run / ".hydra" / "config.yaml")
    (a, b) = pivot_csv(capsys, tmp_path, "--pivot", "optimizer.density", "optimizer.update_gap")
    assert (a["col"], b["col"]) == ("1 (asked 10)", "91 (asked 1000)")
    assert (float(a["mean_ppl"]), float(b["mean_ppl"])) == (501.0, 591.0)
    runs = [make_tables.load_run(d) for d in make_tables.find_runs([str(tmp_path)])]
    assert sorted(plot_runs.labels(runs)) == ["update_gap=1 (asked 10)", "update_gap=91 (asked 1000)"]
    assert make_tables.main([str(tmp_path)]) == 0  # the paper table's rows say it too
    out = capsys.readouterr().out
    assert "| FRUGAL, rho=0.25, update_gap=1 (asked update_gap=10) | 501.00 |" in out
    assert "| FRUGAL, rho=0.25, update_gap=91 (asked update_gap=1000) | 591.00 |" in out
